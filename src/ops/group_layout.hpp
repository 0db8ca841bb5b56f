// One micro-batch's group layout (splits, offsets and the record the offsets scan raises) is
// produced once (by the dispatch, or one offsets launch) and read by every grouped operator of the
// step. Here: its host mirror and the device error record's description.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "moegraph/types.hpp"

namespace moegraph {

class DeviceBuffer;

struct HostOffsets {
  std::vector<int64_t> offsets;  // [G + 1], clamped into [0, capacity] exactly as on the device
  DeviceErrorRecord error{};     // what the device would raise (code 0: none)
};

// The same computation as kernels::launch_group_offsets, on the host.
HostOffsets host_group_offsets(std::span<const int32_t> splits, int row_align, int64_t capacity_rows);

// "splits[3] = -5 is negative" and the like; empty for kDeviceErrorNone. `group` names the group of
// ranks in the peer errors (a peer's token count, a barrier a peer did not reach).
std::string describe_device_error(const DeviceErrorRecord& error, int row_align,
                                  std::string_view group = "expert-parallel");

// Reads a DeviceErrorRecord held at device address `record` (or in a buffer) and clears it if one
// was raised. The caller has synchronized the stream that writes it. Never inside capture.
DeviceErrorRecord take_device_error_record(DeviceErrorRecord* record);
DeviceErrorRecord take_device_error_record(DeviceBuffer& record);

}  // namespace moegraph
