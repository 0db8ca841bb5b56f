#include "src/core/device_buffer.hpp"

#include <cuda_runtime_api.h>

#include "moegraph/error.hpp"

namespace moegraph {

DeviceBuffer::DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
  if (bytes > 0) MG_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);  // never throws
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

void zero_now(void* p, std::size_t bytes) {
  MG_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, nullptr));
  MG_CUDA_CHECK(cudaStreamSynchronize(nullptr));
}

}  // namespace moegraph
