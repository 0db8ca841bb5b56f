// Row-parallel memory-bound kernels: `lanes` threads of a warp (a power of two <= 32) share one row
// and move it as 16-byte vectors, so narrow rows still keep every lane busy. Rows are strided over
// the grid in warp-uniform steps: every lane of a warp runs every step (rows past the end are
// inactive), so sub-warp shuffles are legal inside the step.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "kernels/common/device_query.hpp"
#include "moegraph/error.hpp"

namespace moegraph::kernels {

// Calls f(row, lane_in_row, active) for the rows [0, rows) owned by this warp.
template <class F>
__device__ __forceinline__ void for_each_row(int64_t rows, int lanes, F&& f) {
  const int lane = threadIdx.x & 31;
  const int rows_per_warp = 32 / lanes;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t base = warp * rows_per_warp; base < rows; base += warps * rows_per_warp) {
    const int64_t row = base + lane / lanes;
    f(row, lane % lanes, row < rows);
  }
}

// Sum over the `lanes` lanes sharing a row, in a fixed order (deterministic). All 32 lanes call it.
__device__ __forceinline__ float row_lanes_sum(float v, int lanes) {
  for (int o = lanes >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Lanes per row for rows of `vectors` 16-byte vectors: the largest power of two <= min(vectors, 32).
inline int lanes_per_row(int64_t vectors) {
  int lanes = 32;
  while (lanes > 1 && lanes > vectors) lanes >>= 1;
  return lanes;
}

// How many blocks of `kernel` (at `threads` threads) fit on one SM of the current device (cached
// per device, kernels/common/device_query.hpp).
template <class Kernel>
int resident_blocks_per_sm(Kernel kernel, int threads) {
  return resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), threads);
}

// Blocks of a grid-stride kernel: every SM filled `blocks_per_sm` times (the resident count: more
// would only queue behind the first wave), no more than `max_useful` (the most the work can ever
// need, known on the host), at least one.
inline int grid_blocks(int64_t max_useful, int blocks_per_sm) {
  const int64_t full = static_cast<int64_t>(current_sm_count()) * blocks_per_sm;
  return static_cast<int>(std::max<int64_t>(1, std::min(max_useful, full)));
}

}  // namespace moegraph::kernels
