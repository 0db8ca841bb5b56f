#include "src/core/device_info.hpp"

#include <cuda_runtime_api.h>

#include "kernels/common/device_query.hpp"
#include "moegraph/error.hpp"

namespace moegraph {

DeviceInfo current_device_info() {
  int count = 0;
  const cudaError_t st = cudaGetDeviceCount(&count);
  if (st != cudaSuccess || count == 0) {
    cudaGetLastError();  // the failed query must not poison a later check
    const char* why = st == cudaSuccess || st == cudaErrorNoDevice ? "the driver sees none"
                      : st == cudaErrorInsufficientDriver
                          ? "no NVIDIA driver is loaded, or it is older than the CUDA runtime moegraph was built with"
                          : cudaGetErrorString(st);
    detail::throw_error(__FILE__, __LINE__, detail::concat("no CUDA device is available (", why, ")"),
                        ErrorKind::kNoDevice);
  }
  DeviceInfo info;
  MG_CUDA_CHECK(cudaGetDevice(&info.device));
  info.sm_count = kernels::current_sm_count();
  MG_CUDA_CHECK(cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, info.device));
  MG_CUDA_CHECK(cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, info.device));
  cudaDeviceProp prop{};
  MG_CUDA_CHECK(cudaGetDeviceProperties(&prop, info.device));
  info.name = prop.name;
  info.total_memory = prop.totalGlobalMem;
  return info;
}

std::optional<DeviceInfo> find_current_device() noexcept {
  try {
    return current_device_info();
  } catch (...) {  // no device, no driver, or a failed query: all mean nothing to compare with
    cudaGetLastError();
    return std::nullopt;
  }
}

DeviceInfo require_supported_device() {
  DeviceInfo info = current_device_info();
  require_hopper(info);
  return info;
}

void require_hopper(const DeviceInfo& info) {
  if (info.major != 9 || info.minor != 0)
    detail::throw_error(__FILE__, __LINE__,
                        detail::concat("device ", info.device, " (", info.name, ") has compute capability ", info.major,
                                       ".", info.minor, "; moegraph's kernels need 9.0 (Hopper, sm_90a)"),
                        ErrorKind::kUnsupportedDevice);
}

}  // namespace moegraph
