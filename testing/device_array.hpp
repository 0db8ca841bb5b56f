// A typed device array for verification: upload, download, and NaN poisoning of outputs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstring>
#include <vector>

#include "moegraph/error.hpp"
#include "src/core/device_buffer.hpp"

namespace moegraph::testing {

// cudaMemset ordered with every stream (the tests' streams are non-blocking): waits for the device
// before and after.
inline void memset_and_wait(void* p, int value, std::size_t bytes) {
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  MG_CUDA_CHECK(cudaMemset(p, value, bytes));
  MG_CUDA_CHECK(cudaDeviceSynchronize());
}

template <class T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(std::size_t count) : count_(count), buf_(count * sizeof(T)) {}
  T* get() const { return buf_.as<T>(); }
  std::size_t size() const { return count_; }
  // The tests' streams are non-blocking, so the legacy-stream copies and memsets below would not
  // order with their work: each waits for the whole device first (and memsets after too).
  void upload(const std::vector<T>& host) {
    MG_CHECK(host.size() == count_, "upload of ", host.size(), " elements into ", count_);
    MG_CUDA_CHECK(cudaDeviceSynchronize());
    MG_CUDA_CHECK(cudaMemcpy(get(), host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    MG_CUDA_CHECK(cudaDeviceSynchronize());
    MG_CUDA_CHECK(cudaMemcpy(host.data(), get(), count_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  // All-ones bytes: NaN in bf16, fp16 and fp32, so any element a kernel fails to write fails the check.
  void poison() { memset_and_wait(get(), 0xff, count_ * sizeof(T)); }

 private:
  std::size_t count_ = 0;
  DeviceBuffer buf_;
};

}  // namespace moegraph::testing
