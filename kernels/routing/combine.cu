// Combine (expert rows -> tokens) and the backward copies around it. All memory-bound: `lanes`
// threads per row or token move 16-byte vectors (8 bf16/fp16 elements), accumulate in fp32 in a
// fixed order and round once per output element.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common/alignment.hpp"
#include "kernels/common/dtype_dispatch.cuh"
#include "kernels/common/ragged_tiles.cuh"
#include "kernels/common/row_lanes.cuh"
#include "kernels/common/vector_io.cuh"
#include "kernels/routing/moe_routing.hpp"
#include "kernels/routing/routing_common.cuh"
#include "moegraph/error.hpp"

namespace moegraph::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // elements per 16-byte vector

// out[t] = sum_j w[t, j] * rows[row_of[t, j]] for t < n, j in order; dropped (-1) rows skipped.
// kZeroPastN: also out[t] = 0 for n <= t < max_tokens (unpermute); else those rows are untouched (combine).
// One thread per (token, 16-byte vector), and each thread issues its k loads before it sums them:
// a decode step has few tokens, and a warp per token walking its row vector by vector, one row
// after the other, spent a memory round trip per load (tens of microseconds for a few hundred
// tokens) where this takes about one.
template <class T, bool kZeroPastN>
__global__ void __launch_bounds__(kThreads)
    token_sum_kernel(const T* __restrict__ rows, const int32_t* __restrict__ row_of, const float* __restrict__ weights,
                     const int32_t* num_tokens, int64_t max_tokens, int k, int64_t hidden, T* __restrict__ out) {
  const int64_t n = load_token_count(num_tokens, max_tokens);
  const int64_t vectors = hidden / kVec;
  const int64_t total = (kZeroPastN ? max_tokens : n) * vectors;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total; i += stride) {
    const int64_t t = i / vectors, v = i - t * vectors;
    T* dst = out + t * hidden + v * kVec;
    if (kZeroPastN && t >= n) {
      const float zero[kVec] = {};
      store8(dst, zero);
      continue;
    }
    uint4 raw[kMaxTopK];
    float w[kMaxTopK];
    unsigned used = 0;  // bit j: row j is routed (not dropped)
#pragma unroll
    for (int j = 0; j < kMaxTopK; ++j) {
      raw[j] = uint4{};
      w[j] = 0.0f;
      if (j < k) {
        const int32_t src = row_of[t * k + j];
        if (src >= 0) {
          raw[j] = *reinterpret_cast<const uint4*>(rows + src * hidden + v * kVec);
          w[j] = weights != nullptr ? weights[t * k + j] : 1.0f;
          used |= 1u << j;
        }
      }
    }
    float acc[kVec] = {};
#pragma unroll
    for (int j = 0; j < kMaxTopK; ++j) {
      if (!(used >> j & 1u)) continue;  // dropped rows add nothing (not even 0 * NaN)
      const T* x = reinterpret_cast<const T*>(&raw[j]);
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] = fmaf(w[j], static_cast<float>(x[e]), acc[e]);
    }
    store8(dst, acc);
  }
}

// d_rows[r] = w_r * dy[token_of_row[r]] over rows r < offsets[E] (gap rows 0); kDot: also
// d_row_weight[r] = <dy[token], rows[r]>, a fixed-order sub-warp reduction.
template <class T, bool kDot>
__global__ void __launch_bounds__(kThreads) combine_backward_kernel(
    const T* __restrict__ dy, const int32_t* __restrict__ token_of_row, const float* __restrict__ row_weight,
    const T* __restrict__ rows, const int32_t* splits, const int64_t* offsets, int experts, int64_t hidden,
    int lanes, T* __restrict__ d_rows, float* __restrict__ d_row_weight) {
  const int64_t vectors = hidden / kVec;
  for_each_row(offsets[experts], lanes, [&](int64_t r, int lane, bool active) {
    float dot = 0.0f;
    if (active) {
      const int e = expert_of_row(offsets, experts, r);
      const int64_t token = r - offsets[e] < group_rows(splits, offsets, e) ? token_of_row[r] : -1;
      T* dst = d_rows + r * hidden;
      if (token < 0) {
        const float zero[kVec] = {};
        for (int64_t v = lane; v < vectors; v += lanes) store8(dst + v * kVec, zero);
      } else {
        const float w = row_weight != nullptr ? row_weight[r] : 1.0f;
        const T* g = dy + token * hidden;
        for (int64_t v = lane; v < vectors; v += lanes) {
          float gv[kVec], o[kVec];
          load8(g + v * kVec, gv);
          if constexpr (kDot) {
            float xv[kVec];
            load8(rows + r * hidden + v * kVec, xv);
#pragma unroll
            for (int i = 0; i < kVec; ++i) dot = fmaf(gv[i], xv[i], dot);
          }
#pragma unroll
          for (int i = 0; i < kVec; ++i) o[i] = w * gv[i];
          store8(dst + v * kVec, o);
        }
      }
    }
    if constexpr (kDot) {
      dot = row_lanes_sum(dot, lanes);  // all 32 lanes: the step is warp-uniform
      if (active && lane == 0) d_row_weight[r] = dot;
    }
  });
}

__global__ void __launch_bounds__(kThreads) gather_row_values_kernel(const float* __restrict__ d_row_weight,
                                                                     const int32_t* __restrict__ row_of,
                                                                     const int32_t* num_tokens, int64_t max_tokens,
                                                                     int k, float* __restrict__ d_topk_weights) {
  const int64_t used = load_token_count(num_tokens, max_tokens) * k;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t a = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; a < max_tokens * k; a += stride) {
    float v = 0.0f;
    if (a < used) {
      const int32_t r = row_of[a];
      if (r >= 0) v = d_row_weight[r];
    }
    d_topk_weights[a] = v;
  }
}

// V: the widest unit the row size and the pointers allow (uint4, unsigned, or unsigned char).
template <class V>
__global__ void __launch_bounds__(kThreads) copy_tokens_kernel(const V* __restrict__ src, V* __restrict__ dst,
                                                               int64_t units_per_row, const int32_t* num_tokens,
                                                               int64_t max_tokens) {
  const int64_t copied = load_token_count(num_tokens, max_tokens) * units_per_row;
  const int64_t total = max_tokens * units_per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total; i += stride)
    dst[i] = i < copied ? src[i] : V{};
}

void check_rows_args(const char* what, int64_t hidden, const void* a, const void* b) {
  MG_CHECK(hidden > 0 && hidden % 16 == 0, what, ": hidden must be a positive multiple of 16, got ", hidden);
  MG_CHECK(aligned16(a) && aligned16(b), what,
           ": buffers must be 16-byte aligned");
}

void check_tokens_args(const char* what, int64_t max_tokens, int top_k, const void* row_of, const void* num_tokens) {
  MG_CHECK(max_tokens >= 0, what, ": max_tokens must not be negative, got ", max_tokens);
  MG_CHECK(top_k >= 1 && top_k <= kMaxTopK, what, ": top_k must be in [1, ", kMaxTopK, "], got ", top_k);
  MG_CHECK(row_of != nullptr && num_tokens != nullptr, what, ": row_of and num_tokens are required");
}

template <class T, bool kZeroPastN>
void launch_token_sum(const void* rows, const int32_t* row_of, const float* weights, const int32_t* num_tokens,
                      int64_t max_tokens, int top_k, int64_t hidden, void* out, cudaStream_t stream) {
  const int blocks_per_sm = resident_blocks_per_sm(token_sum_kernel<T, kZeroPastN>, kThreads);
  // max_tokens * hidden is a buffer's element count (the callers bound its bytes): no overflow.
  const int64_t vectors = max_tokens * (hidden / kVec);
  const int grid = grid_blocks((vectors + kThreads - 1) / kThreads, blocks_per_sm);
  token_sum_kernel<T, kZeroPastN><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(rows), row_of, weights,
                                                                  num_tokens, max_tokens, top_k, hidden,
                                                                  static_cast<T*>(out));
  MG_LAUNCH_CHECK();
}

template <class T, bool kDot>
void launch_combine_backward_typed(const void* dy, const int32_t* token_of_row, const float* row_weight,
                                   const void* rows, const int32_t* splits, const int64_t* offsets, int experts,
                                   int64_t hidden, void* d_rows, float* d_row_weight, cudaStream_t stream) {
  const int blocks_per_sm = resident_blocks_per_sm(combine_backward_kernel<T, kDot>, kThreads);
  const int grid = grid_blocks(INT64_MAX, blocks_per_sm);  // the rows are known on the device only
  combine_backward_kernel<T, kDot><<<grid, kThreads, 0, stream>>>(
      static_cast<const T*>(dy), token_of_row, row_weight, static_cast<const T*>(rows), splits, offsets, experts,
      hidden, lanes_per_row(hidden / kVec), static_cast<T*>(d_rows), d_row_weight);
  MG_LAUNCH_CHECK();
}

template <class V>
void launch_copy(const void* src, void* dst, std::size_t row_bytes, const int32_t* num_tokens, int64_t max_tokens,
                 cudaStream_t stream) {
  const int64_t units = static_cast<int64_t>(row_bytes / sizeof(V));
  const int blocks_per_sm = resident_blocks_per_sm(copy_tokens_kernel<V>, kThreads);
  const int grid = grid_blocks((max_tokens * units + kThreads - 1) / kThreads, blocks_per_sm);
  copy_tokens_kernel<V><<<grid, kThreads, 0, stream>>>(static_cast<const V*>(src), static_cast<V*>(dst), units,
                                                       num_tokens, max_tokens);
  MG_LAUNCH_CHECK();
}

}  // namespace

void launch_combine(DType dtype, const void* rows, const int32_t* row_of, const float* topk_weights,
                    const int32_t* num_tokens, int64_t max_tokens, int top_k, int64_t hidden, void* y,
                    cudaStream_t stream) {
  check_rows_args("combine", hidden, rows, y);
  check_tokens_args("combine", max_tokens, top_k, row_of, num_tokens);
  with_16bit_type(dtype, "combine", [&](auto t) {
    launch_token_sum<decltype(t), false>(rows, row_of, topk_weights, num_tokens, max_tokens, top_k, hidden, y, stream);
  });
}

void launch_combine_backward(DType dtype, const void* dy, const int32_t* token_of_row, const float* row_weight,
                             const void* rows, const int32_t* splits, const int64_t* offsets, int experts,
                             int64_t hidden, void* d_rows, float* d_row_weight, cudaStream_t stream) {
  check_rows_args("combine_backward", hidden, dy, d_rows);
  MG_CHECK(experts >= 1 && experts <= kMaxExperts, "combine_backward: experts must be in [1, ", kMaxExperts, "]");
  MG_CHECK(token_of_row != nullptr && splits != nullptr && offsets != nullptr,
           "combine_backward: token_of_row, splits and offsets are required");
  const bool dot = rows != nullptr && d_row_weight != nullptr;
  MG_CHECK(!dot || aligned16(rows), "combine_backward: rows must be 16-byte aligned");
  with_16bit_type(dtype, "combine_backward", [&](auto t) {
    using T = decltype(t);
    if (dot)
      launch_combine_backward_typed<T, true>(dy, token_of_row, row_weight, rows, splits, offsets, experts, hidden,
                                             d_rows, d_row_weight, stream);
    else
      launch_combine_backward_typed<T, false>(dy, token_of_row, row_weight, rows, splits, offsets, experts, hidden,
                                              d_rows, d_row_weight, stream);
  });
}

void launch_gather_row_values(const float* d_row_weight, const int32_t* row_of, const int32_t* num_tokens,
                              int64_t max_tokens, int top_k, float* d_topk_weights, cudaStream_t stream) {
  check_tokens_args("gather_row_values", max_tokens, top_k, row_of, num_tokens);
  MG_CHECK(d_row_weight != nullptr && d_topk_weights != nullptr,
           "gather_row_values: d_row_weight and d_topk_weights are required");
  const int blocks_per_sm = resident_blocks_per_sm(gather_row_values_kernel, kThreads);
  const int grid = grid_blocks((max_tokens * top_k + kThreads - 1) / kThreads, blocks_per_sm);
  gather_row_values_kernel<<<grid, kThreads, 0, stream>>>(d_row_weight, row_of, num_tokens, max_tokens, top_k,
                                                          d_topk_weights);
  MG_LAUNCH_CHECK();
}

void launch_unpermute(DType dtype, const void* d_rows, const int32_t* row_of, const int32_t* num_tokens,
                      int64_t max_tokens, int top_k, int64_t hidden, void* dx, cudaStream_t stream) {
  check_rows_args("unpermute", hidden, d_rows, dx);
  check_tokens_args("unpermute", max_tokens, top_k, row_of, num_tokens);
  with_16bit_type(dtype, "unpermute", [&](auto t) {
    launch_token_sum<decltype(t), true>(d_rows, row_of, nullptr, num_tokens, max_tokens, top_k, hidden, dx, stream);
  });
}

void launch_copy_tokens(const void* src, void* dst, std::size_t row_bytes, const int32_t* num_tokens,
                        int64_t max_tokens, cudaStream_t stream) {
  MG_CHECK(max_tokens >= 0, "copy_tokens: max_tokens must not be negative, got ", max_tokens);
  MG_CHECK(src != nullptr && dst != nullptr && num_tokens != nullptr,
           "copy_tokens: src, dst and num_tokens are required");
  const std::uintptr_t bits = reinterpret_cast<std::uintptr_t>(src) | reinterpret_cast<std::uintptr_t>(dst) | row_bytes;
  if (bits % 16 == 0) launch_copy<uint4>(src, dst, row_bytes, num_tokens, max_tokens, stream);
  else if (bits % 4 == 0) launch_copy<unsigned>(src, dst, row_bytes, num_tokens, max_tokens, stream);
  else launch_copy<unsigned char>(src, dst, row_bytes, num_tokens, max_tokens, stream);
}

}  // namespace moegraph::kernels
