// Device-side tile scheduling over ragged groups. Each block of a persistent kernel rebuilds, in
// shared memory, the exclusive prefix of tiles per group from the device offsets/splits, so no
// host ever needs the group sizes. G is at most kMaxGroups.
#pragma once

#include <cstdint>

#include "kernels/common/vector_io.cuh"
#include "kernels/common/warp_scan.cuh"
#include "moegraph/types.hpp"

namespace moegraph::kernels {

__device__ __forceinline__ int64_t group_span(const int64_t* offsets, int e) {
  return offsets[e + 1] - offsets[e];
}

// Rows of group e that hold data: its split, clamped into its (already clamped) aligned span, so a
// negative or oversized split never makes a kernel touch another group's rows.
__device__ __forceinline__ int64_t group_rows(const int32_t* splits, const int64_t* offsets, int e) {
  const int64_t span = group_span(offsets, e);
  const int64_t s = splits[e];
  return s < 0 ? 0 : (s > span ? span : s);
}

// prefix[e] = sum over groups before e of ceil(units(e) / tile), prefix[G] = total.
// units(e) is the group's aligned span (kUseSpan) or its data rows. Must be called by all
// THREADS threads of the block; `warp_sums` holds THREADS / 32 ints. Ends with a barrier.
template <int THREADS, int TILE, bool kUseSpan>
__device__ void build_tile_prefix(const int32_t* splits, const int64_t* offsets, int num_groups,
                                  int* prefix, int* warp_sums) {
  static_assert(THREADS % 32 == 0 && THREADS / 32 <= 32);
  constexpr int kPerThread = (kMaxGroups + THREADS - 1) / THREADS;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int tiles[kPerThread];
  int sum = 0;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = tid * kPerThread + i;
    int64_t units = 0;
    if (e < num_groups) units = kUseSpan ? group_span(offsets, e) : group_rows(splits, offsets, e);
    tiles[i] = static_cast<int>((units + TILE - 1) / TILE);
    sum += tiles[i];
  }
  const int inclusive = warp_inclusive_sum(sum);
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int w = warp_exclusive_sum(lane < THREADS / 32 ? warp_sums[lane] : 0);
    if (lane < THREADS / 32) warp_sums[lane] = w;
  }
  __syncthreads();
  int running = warp_sums[warp] + inclusive - sum;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = tid * kPerThread + i;
    if (e < num_groups) prefix[e] = running;
    running += tiles[i];
  }
  if (tid == THREADS - 1) prefix[num_groups] = running;
  __syncthreads();
}

// The group owning virtual tile `t`: the largest e with prefix[e] <= t (empty groups share their
// prefix with the next group, so they are skipped).
__device__ __forceinline__ int find_group(const int* prefix, int num_groups, int t) {
  int lo = 0, hi = num_groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (prefix[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Where virtual M-tile `mt` (of TILE rows) of a row-ragged GEMM lies: its group, its first row, the
// rows of the group's aligned span it covers (written), and those that hold data (the rest are
// alignment gap rows, written as zero).
struct RaggedTile {
  int group;
  int64_t row0, span_rows, data_rows;
};

// M-tile `local` (of TILE rows) of group `group`.
template <int TILE>
__device__ __forceinline__ RaggedTile ragged_tile_of_group(const int32_t* splits, const int64_t* offsets, int group,
                                                           int local) {
  RaggedTile t;
  t.group = group;
  const int64_t local_row = static_cast<int64_t>(local) * TILE;
  t.row0 = offsets[group] + local_row;
  t.span_rows = min(static_cast<int64_t>(TILE), group_span(offsets, group) - local_row);
  t.data_rows = max(int64_t{0}, min(t.span_rows, group_rows(splits, offsets, group) - local_row));
  return t;
}

template <int TILE>
__device__ __forceinline__ RaggedTile locate_ragged_tile(const int* prefix, const int32_t* splits,
                                                         const int64_t* offsets, int num_groups, int mt) {
  const int group = find_group(prefix, num_groups, mt);
  return ragged_tile_of_group<TILE>(splits, offsets, group, mt - prefix[group]);
}

// The epilogue of a row-ragged GEMM for 8 output columns [n0 + col, n0 + col + 8) of tile row
// `row`: gap rows become zero, data rows get s_r * b_e added (bias may be null, bias_scale too),
// and rows past the span or columns past `cols` are left alone.
template <class T>
__device__ __forceinline__ void store_ragged_chunk8(T* c, int64_t cols, const RaggedTile& t, int64_t n0, int row,
                                                    int col, float (&v)[8], const T* bias,
                                                    const float* bias_scale) {
  if (row >= t.span_rows || n0 + col >= cols) return;
  if (row >= t.data_rows) {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.0f;  // alignment gap rows read as zero downstream
  } else if (bias != nullptr) {
    const float s = bias_scale != nullptr ? bias_scale[t.row0 + row] : 1.0f;
    const T* b = bias + static_cast<int64_t>(t.group) * cols + n0 + col;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] += s * static_cast<float>(b[i]);
  }
  store8(c + (t.row0 + row) * cols + n0 + col, v);
}

}  // namespace moegraph::kernels
