#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/common/vector_io.cuh"
#include "kernels/elementwise/elementwise.hpp"
#include "moegraph/error.hpp"

namespace moegraph::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // 16-byte accesses; ffn is a multiple of 16

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// Grid-stride over the 8-wide vectors of the used rows: the work follows the routed rows.
template <class T, bool kBackward>
__global__ void __launch_bounds__(kThreads) swiglu_kernel(const T* __restrict__ h, const T* __restrict__ da,
                                                          T* __restrict__ out, int64_t ffn, const int64_t* offsets,
                                                          int num_groups) {
  const int64_t vecs_per_row = ffn / kVec;
  const int64_t total = offsets[num_groups] * vecs_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t row = i / vecs_per_row, col = (i % vecs_per_row) * kVec;
    float gate[kVec], up[kVec];
    load8(h + row * 2 * ffn + col, gate);
    load8(h + row * 2 * ffn + ffn + col, up);
    if constexpr (!kBackward) {
      float a[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) a[j] = gate[j] * sigmoid(gate[j]) * up[j];
      store8(out + row * ffn + col, a);
    } else {
      float g[kVec], dgate[kVec], dup[kVec];
      load8(da + row * ffn + col, g);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float s = sigmoid(gate[j]);
        dup[j] = g[j] * gate[j] * s;
        dgate[j] = g[j] * up[j] * s * (1.0f + gate[j] * (1.0f - s));
      }
      store8(out + row * 2 * ffn + col, dgate);
      store8(out + row * 2 * ffn + ffn + col, dup);
    }
  }
}

template <class T, bool kBackward>
void launch(const void* h, const void* da, void* out, int64_t ffn, const int64_t* offsets, int num_groups, int grid,
            cudaStream_t stream) {
  MG_CHECK(ffn % kVec == 0, "swiglu needs ffn to be a multiple of ", kVec, ", got ", ffn);
  swiglu_kernel<T, kBackward><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(h), static_cast<const T*>(da),
                                                             static_cast<T*>(out), ffn, offsets, num_groups);
  MG_LAUNCH_CHECK();
}

}  // namespace

void launch_swiglu_forward(DType dtype, const void* h, void* a, int64_t ffn, const int64_t* offsets, int num_groups,
                           int grid, cudaStream_t stream) {
  if (dtype == DType::kFP16) launch<__half, false>(h, nullptr, a, ffn, offsets, num_groups, grid, stream);
  else launch<__nv_bfloat16, false>(h, nullptr, a, ffn, offsets, num_groups, grid, stream);
}

void launch_swiglu_backward(DType dtype, const void* h, const void* da, void* dh, int64_t ffn, const int64_t* offsets,
                            int num_groups, int grid, cudaStream_t stream) {
  if (dtype == DType::kFP16) launch<__half, true>(h, da, dh, ffn, offsets, num_groups, grid, stream);
  else launch<__nv_bfloat16, true>(h, da, dh, ffn, offsets, num_groups, grid, stream);
}

}  // namespace moegraph::kernels
