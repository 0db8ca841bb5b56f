// Host mirrors of the device-side rules, for set-up checks, tests and the legacy baseline.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "moegraph/grouped_linear.hpp"

namespace moegraph {

struct HostOffsets {
  std::vector<int64_t> offsets;  // [G + 1], clamped into [0, capacity] exactly as on the device
  DeviceErrorRecord error{};     // what the device would raise (code 0: none)
};

// The same computation as kernels::launch_group_offsets, on the host.
HostOffsets host_group_offsets(std::span<const int32_t> splits, int row_align, int64_t capacity_rows);

// "splits[3] = -5 is negative" and the like; empty for code 0.
std::string describe_device_error(const DeviceErrorRecord& error, int row_align);

}  // namespace moegraph
