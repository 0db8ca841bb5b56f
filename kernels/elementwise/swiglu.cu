#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/elementwise/elementwise.hpp"
#include "moegraph/error.hpp"

namespace moegraph::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // 16-byte accesses; ffn is a multiple of 16

template <class T>
struct Vec8 {
  float v[kVec];
  __device__ void load(const T* p) {
    alignas(16) T in[kVec];
    *reinterpret_cast<uint4*>(in) = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = static_cast<float>(in[i]);
  }
  __device__ void store(T* p) const {
    alignas(16) T out[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = static_cast<T>(v[i]);
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(out);
  }
};

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
    Vec8<T> gate, up;
    gate.load(h + row * 2 * ffn + col);
    up.load(h + row * 2 * ffn + ffn + col);
    if constexpr (!kBackward) {
      Vec8<T> a;
#pragma unroll
      for (int j = 0; j < kVec; ++j) a.v[j] = gate.v[j] * sigmoid(gate.v[j]) * up.v[j];
      a.store(out + row * ffn + col);
    } else {
      Vec8<T> g, dgate, dup;
      g.load(da + row * ffn + col);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float s = sigmoid(gate.v[j]);
        const float silu = gate.v[j] * s;
        dup.v[j] = g.v[j] * silu;
        dgate.v[j] = g.v[j] * up.v[j] * s * (1.0f + gate.v[j] * (1.0f - s));
      }
      dgate.store(out + row * 2 * ffn + col);
      dup.store(out + row * 2 * ffn + ffn + col);
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
