#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/common/alignment.hpp"
#include "kernels/common/dtype_dispatch.cuh"
#include "kernels/common/row_lanes.cuh"
#include "kernels/common/swiglu_math.cuh"
#include "kernels/common/vector_io.cuh"
#include "kernels/elementwise/elementwise.hpp"
#include "kernels/routing/moe_routing.hpp"
#include "moegraph/error.hpp"

namespace moegraph::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // 16-byte accesses; ffn is a multiple of 16

// Grid-stride over the 8-wide vectors of the used rows: the work follows the routed rows.
// kWeighted (forward only): a = w_r * silu(gate) * up with w_r = row_weight[r].
template <class T, bool kBackward, bool kWeighted = false>
__global__ void __launch_bounds__(kThreads) swiglu_kernel(const T* __restrict__ h, const T* __restrict__ da,
                                                          T* __restrict__ out, int64_t ffn, const int64_t* offsets,
                                                          int num_groups, const float* __restrict__ row_weight) {
  static_assert(!(kBackward && kWeighted), "the weighted backward reduces per row: swiglu_weighted_backward_kernel");
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
      for (int j = 0; j < kVec; ++j) a[j] = swiglu_value(gate[j], up[j]);
      if constexpr (kWeighted) {
        const float w = row_weight[row];
#pragma unroll
        for (int j = 0; j < kVec; ++j) a[j] *= w;
      }
      store8(out + row * ffn + col, a);
    } else {
      float g[kVec], dgate[kVec], dup[kVec];
      load8(da + row * ffn + col, g);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        dup[j] = swiglu_grad_up(gate[j], g[j]);
        dgate[j] = swiglu_grad_gate(gate[j], up[j], g[j]);
      }
      store8(out + row * 2 * ffn + col, dgate);
      store8(out + row * 2 * ffn + ffn + col, dup);
    }
  }
}

template <class T, bool kBackward, bool kWeighted = false>
void launch(const void* h, const void* da, void* out, int64_t ffn, const int64_t* offsets, int num_groups, int grid,
            cudaStream_t stream, const float* row_weight = nullptr) {
  MG_CHECK(ffn % kVec == 0, "swiglu needs ffn to be a multiple of ", kVec, ", got ", ffn);
  swiglu_kernel<T, kBackward, kWeighted><<<grid, kThreads, 0, stream>>>(
      static_cast<const T*>(h), static_cast<const T*>(da), static_cast<T*>(out), ffn, offsets, num_groups, row_weight);
  MG_LAUNCH_CHECK();
}

// The backward of a = w_r * silu(gate) * up: `lanes` threads per row (a fixed-order reduction of
// d_row_weight[r] = <da_r, silu(gate_r) * up_r> + extra[r]), rows r < offsets[G].
template <class T>
__global__ void __launch_bounds__(kThreads) swiglu_weighted_backward_kernel(
    const T* __restrict__ h, const float* __restrict__ row_weight, const T* __restrict__ da, T* __restrict__ dh,
    const float* __restrict__ extra, float* __restrict__ d_row_weight, int64_t ffn, const int64_t* offsets,
    int num_groups, int lanes) {
  const int64_t vectors = ffn / kVec;
  for_each_row(offsets[num_groups], lanes, [&](int64_t r, int lane, bool active) {
    float dot = 0.0f;
    if (active) {
      const float w = row_weight != nullptr ? row_weight[r] : 1.0f;
      const T* gate_row = h + r * 2 * ffn;
      for (int64_t v = lane; v < vectors; v += lanes) {
        const int64_t col = v * kVec;
        float gate[kVec], up[kVec], g[kVec], dgate[kVec], dup[kVec];
        load8(gate_row + col, gate);
        load8(gate_row + ffn + col, up);
        load8(da + r * ffn + col, g);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float s = swiglu_sigmoid(gate[j]);
          const float silu = gate[j] * s;
          dot = fmaf(g[j], silu * up[j], dot);
          const float gw = g[j] * w;
          dup[j] = gw * silu;
          dgate[j] = swiglu_grad_gate(gate[j], up[j], gw);
        }
        store8(dh + r * 2 * ffn + col, dgate);
        store8(dh + r * 2 * ffn + ffn + col, dup);
      }
    }
    dot = row_lanes_sum(dot, lanes);  // all 32 lanes: the step is warp-uniform
    if (active && lane == 0 && d_row_weight != nullptr) d_row_weight[r] = dot + (extra != nullptr ? extra[r] : 0.0f);
  });
}

void check_weighted_args(int64_t ffn, int experts, const void* a, const void* b) {
  MG_CHECK(ffn > 0 && ffn % kVec == 0, "swiglu_weighted needs ffn to be a positive multiple of ", kVec, ", got ", ffn);
  MG_CHECK(experts >= 1, "swiglu_weighted: experts must be positive, got ", experts);
  MG_CHECK(aligned16(a) && aligned16(b),
           "swiglu_weighted: buffers must be 16-byte aligned");
}

template <class T>
void launch_weighted_forward(const void* h, const float* row_weight, void* a, int64_t ffn, const int64_t* offsets,
                             int experts, cudaStream_t stream) {
  const int blocks_per_sm = resident_blocks_per_sm(swiglu_kernel<T, false, true>, kThreads);
  const int grid = grid_blocks(INT64_MAX, blocks_per_sm);  // the rows are known on the device only
  launch<T, false, true>(h, nullptr, a, ffn, offsets, experts, grid, stream, row_weight);
}

template <class T>
void launch_weighted_backward(const void* h, const float* row_weight, const void* da, void* dh, const float* extra,
                              float* d_row_weight, int64_t ffn, const int64_t* offsets, int experts,
                              cudaStream_t stream) {
  const int blocks_per_sm = resident_blocks_per_sm(swiglu_weighted_backward_kernel<T>, kThreads);
  const int grid = grid_blocks(INT64_MAX, blocks_per_sm);  // the rows are known on the device only
  swiglu_weighted_backward_kernel<T><<<grid, kThreads, 0, stream>>>(
      static_cast<const T*>(h), row_weight, static_cast<const T*>(da), static_cast<T*>(dh), extra, d_row_weight, ffn,
      offsets, experts, lanes_per_row(ffn / kVec));
  MG_LAUNCH_CHECK();
}

}  // namespace

void launch_swiglu_forward(DType dtype, const void* h, void* a, int64_t ffn, const int64_t* offsets, int num_groups,
                           int grid, cudaStream_t stream) {
  with_16bit_type(dtype, "swiglu_forward", [&](auto t) {
    launch<decltype(t), false>(h, nullptr, a, ffn, offsets, num_groups, grid, stream);
  });
}

void launch_swiglu_backward(DType dtype, const void* h, const void* da, void* dh, int64_t ffn, const int64_t* offsets,
                            int num_groups, int grid, cudaStream_t stream) {
  with_16bit_type(dtype, "swiglu_backward", [&](auto t) {
    launch<decltype(t), true>(h, da, dh, ffn, offsets, num_groups, grid, stream);
  });
}

int swiglu_grid(DType dtype, bool backward) {
  int grid = 0;
  with_16bit_type(dtype, "swiglu_grid", [&](auto t) {
    using T = decltype(t);
    const int blocks_per_sm = backward ? resident_blocks_per_sm(swiglu_kernel<T, true>, kThreads)
                                       : resident_blocks_per_sm(swiglu_kernel<T, false>, kThreads);
    grid = grid_blocks(INT64_MAX, blocks_per_sm);
  });
  return grid;
}

void launch_swiglu_weighted_forward(DType dtype, const void* h, const float* row_weight, void* a, int64_t ffn,
                                    const int64_t* offsets, int experts, cudaStream_t stream) {
  check_weighted_args(ffn, experts, h, a);
  MG_CHECK(row_weight != nullptr, "swiglu_weighted_forward: row_weight is required");
  with_16bit_type(dtype, "swiglu_weighted_forward", [&](auto t) {
    launch_weighted_forward<decltype(t)>(h, row_weight, a, ffn, offsets, experts, stream);
  });
}

void launch_swiglu_weighted_backward(DType dtype, const void* h, const float* row_weight, const void* da, void* dh,
                                     const float* extra, float* d_row_weight, int64_t ffn, const int64_t* offsets,
                                     int experts, cudaStream_t stream) {
  check_weighted_args(ffn, experts, h, dh);
  MG_CHECK(aligned16(da), "swiglu_weighted_backward: da must be 16-byte aligned");
  with_16bit_type(dtype, "swiglu_weighted_backward", [&](auto t) {
    launch_weighted_backward<decltype(t)>(h, row_weight, da, dh, extra, d_row_weight, ffn, offsets, experts, stream);
  });
}

}  // namespace moegraph::kernels
