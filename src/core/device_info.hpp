// The device an operator is set up on: asked once at set-up (an attribute query, no
// synchronization) and kept by the operator, so each device keeps its own facts.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

namespace moegraph {

struct DeviceInfo {
  int device = -1;
  int sm_count = 0;
  int major = 0, minor = 0;  // compute capability
  std::string name;
  std::size_t total_memory = 0;  // bytes
};

// The current device. Throws (ErrorKind::kNoDevice) when the process sees no usable CUDA device.
DeviceInfo current_device_info();
// The same, or nothing when there is no usable device (or the query fails): for reports that
// compare with a GPU when there is one and must work without (moegraph-bench --plan). Never throws.
std::optional<DeviceInfo> find_current_device() noexcept;
// Throws ErrorKind::kUnsupportedDevice, naming the device and its capability, unless it is compute
// capability 9.0.
void require_hopper(const DeviceInfo& info);
// The current device, which must be compute capability 9.0 (Hopper: the sm_90a kernels); throws
// ErrorKind::kUnsupportedDevice naming the device and its capability otherwise. Set-up only.
DeviceInfo require_supported_device();

}  // namespace moegraph
