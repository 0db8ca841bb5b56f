// The device an operator is set up on: asked once at set-up (an attribute query, no
// synchronization) and kept by the operator, so each device keeps its own facts.
#pragma once

#include <string>

namespace moegraph {

struct DeviceInfo {
  int device = -1;
  int sm_count = 0;
  int major = 0, minor = 0;  // compute capability
  std::string name;
};

// The current device. Throws (ErrorKind::kNoDevice) when the process sees no usable CUDA device.
DeviceInfo current_device_info();
// Throws ErrorKind::kUnsupportedDevice, naming the device and its capability, unless it is compute
// capability 9.0.
void require_hopper(const DeviceInfo& info);
// The current device, which must be compute capability 9.0 (Hopper: the sm_90a kernels); throws
// ErrorKind::kUnsupportedDevice naming the device and its capability otherwise. Set-up only.
DeviceInfo require_supported_device();

}  // namespace moegraph
