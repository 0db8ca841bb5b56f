#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/elementwise/elementwise.hpp"
#include "moegraph/error.hpp"

namespace moegraph::kernels {
namespace {

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

template <class T>
__global__ void fill_uniform_kernel(T* p, std::size_t count, float scale, uint64_t seed) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const float u = static_cast<float>(splitmix64(seed ^ (i * 0x2545f4914f6cdd1dull)) >> 40) * (1.0f / 16777216.0f);
    p[i] = static_cast<T>((2.0f * u - 1.0f) * scale);
  }
}

}  // namespace

void launch_fill_uniform(DType dtype, void* p, std::size_t count, float scale, uint64_t seed, cudaStream_t stream) {
  if (count == 0) return;
  const int grid = 1024;
  switch (dtype) {
    case DType::kBF16: fill_uniform_kernel<<<grid, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(p), count, scale, seed); break;
    case DType::kFP16: fill_uniform_kernel<<<grid, 256, 0, stream>>>(static_cast<__half*>(p), count, scale, seed); break;
    case DType::kFP32: fill_uniform_kernel<<<grid, 256, 0, stream>>>(static_cast<float*>(p), count, scale, seed); break;
  }
  MG_LAUNCH_CHECK();
}

}  // namespace moegraph::kernels
