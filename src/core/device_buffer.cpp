#include "src/core/device_buffer.hpp"

#include <cuda_runtime_api.h>

#include "moegraph/error.hpp"
#include "src/core/byte_units.hpp"

namespace moegraph {

DeviceBuffer::DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  const cudaError_t status = cudaMalloc(&ptr_, bytes);
  if (status == cudaSuccess) return;
  ptr_ = nullptr;
  if (status != cudaErrorMemoryAllocation) detail::throw_cuda_error(__FILE__, __LINE__, "cudaMalloc", status);
  // Out of memory: say how much was asked and what the device has, so that a caller can size a
  // smaller bucket (the bare runtime message names neither).
  (void)cudaGetLastError();
  int device = -1;
  std::size_t free = 0, total = 0;
  const bool known = cudaGetDevice(&device) == cudaSuccess && cudaMemGetInfo(&free, &total) == cudaSuccess;
  (void)cudaGetLastError();
  detail::throw_error(__FILE__, __LINE__,
                      known ? detail::concat("cannot allocate ", human_bytes(bytes), " (", bytes, " bytes) on device ",
                                             device, ": ", human_bytes(free), " free of ", human_bytes(total),
                                             " (cudaErrorMemoryAllocation)")
                            : detail::concat("cannot allocate ", human_bytes(bytes), " (", bytes,
                                             " bytes) of device memory (cudaErrorMemoryAllocation)"),
                      ErrorKind::kCuda);
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
