// Makes an operator's device current for one call and gives the caller's back after it.
//
// An operator is set up on the current device and keeps its number. The host thread that enqueues
// its work later may have another device current: a server's thread pool, a rank's worker thread,
// Python. cuBLASLt handles, kernel attributes and lazily loaded kernels belong to the device that
// was current when they were made; called from another device they fail (cuBLASLt answers
// CUBLAS_STATUS_INTERNAL_ERROR) or reach the wrong context. cudaGetDevice and cudaSetDevice are
// host-side only: no synchronization, and legal while a stream is being captured.
#pragma once

#include <cuda_runtime_api.h>

#include <new>

#include "moegraph/error.hpp"

namespace moegraph {

class DeviceScope {
 public:
  // cudaSetDevice runs even when the device is already the caller's: on a thread that has made no
  // CUDA call yet, cudaGetDevice answers 0 while no context is current, and the first driver call
  // (the TMA encoder of a Hopper GEMM) would fail with CUDA_ERROR_INVALID_CONTEXT. cudaSetDevice
  // makes the device's primary context current.
  explicit DeviceScope(int device) {
    if (device < 0) return;  // stay on the caller's device: nothing to switch or restore
    MG_CUDA_CHECK(cudaGetDevice(&caller_));
    MG_CUDA_CHECK(cudaSetDevice(device));
    restore_ = device != caller_;
  }
  // For destructors: a failed query or switch leaves the current device as it is, and throws nothing.
  DeviceScope(int device, std::nothrow_t) {
    restore_ = device >= 0 && cudaGetDevice(&caller_) == cudaSuccess && cudaSetDevice(device) == cudaSuccess &&
               device != caller_;
  }
  ~DeviceScope() {
    if (restore_) cudaSetDevice(caller_);  // a destructor does not throw; the device was valid before
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int caller_ = 0;
  bool restore_ = false;
};

}  // namespace moegraph
