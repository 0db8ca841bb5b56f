#include "kernels/common/alignment.hpp"
#include "kernels/elementwise/elementwise.hpp"
#include "moegraph/error.hpp"

namespace moegraph::kernels {
namespace {

__global__ void copy_used_rows_kernel(unsigned char* __restrict__ dst, const unsigned char* __restrict__ src,
                                      std::size_t row_bytes, const int64_t* offsets, int num_groups) {
  const std::size_t bytes = static_cast<std::size_t>(offsets[num_groups]) * row_bytes;
  const std::size_t vectors = bytes / 16;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t tid = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (std::size_t i = tid; i < vectors; i += stride)
    reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  for (std::size_t i = vectors * 16 + tid; i < bytes; i += stride) dst[i] = src[i];
}

}  // namespace

void launch_copy_used_rows(void* dst, const void* src, std::size_t row_bytes, const int64_t* offsets,
                           int num_groups, int grid, cudaStream_t stream) {
  MG_CHECK(aligned16(dst) && aligned16(src),
           "copy_used_rows needs 16-byte aligned buffers");
  copy_used_rows_kernel<<<grid, 256, 0, stream>>>(static_cast<unsigned char*>(dst),
                                                  static_cast<const unsigned char*>(src), row_bytes,
                                                  offsets, num_groups);
  MG_LAUNCH_CHECK();
}

}  // namespace moegraph::kernels
