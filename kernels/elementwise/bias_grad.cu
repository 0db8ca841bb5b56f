#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/common/dtype_dispatch.cuh"
#include "kernels/common/ragged_tiles.cuh"
#include "kernels/common/vector_io.cuh"
#include "kernels/elementwise/elementwise.hpp"
#include "moegraph/error.hpp"

namespace moegraph::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kColsPerBlock = 256;  // 32 lanes x 8 columns; 8 warps stride over the rows
constexpr int kRowLanes = kThreads / 32;

// partials[chunk][col] = sum over the chunk's rows of s_r * dy[r][col].
template <class T>
__global__ void __launch_bounds__(kThreads) bias_grad_partials_kernel(BiasGradParams p) {
  __shared__ int chunk_prefix[kMaxGroups + 1];
  __shared__ int warp_sums[kThreads / 32];
  __shared__ float lane_sums[kRowLanes][kColsPerBlock];
  build_tile_prefix<kThreads, kBiasGradChunkRows, false>(p.splits, p.offsets, p.num_groups, chunk_prefix, warp_sums);
  const T* dy = static_cast<const T*>(p.dy);
  const int col_blocks = static_cast<int>((p.n + kColsPerBlock - 1) / kColsPerBlock);
  const int64_t total = static_cast<int64_t>(chunk_prefix[p.num_groups]) * col_blocks;
  const int lane = threadIdx.x & 31, row_lane = threadIdx.x >> 5;
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int chunk = static_cast<int>(t / col_blocks);
    const int64_t col0 = (t % col_blocks) * kColsPerBlock;
    const int e = find_group(chunk_prefix, p.num_groups, chunk);
    const int64_t local = static_cast<int64_t>(chunk - chunk_prefix[e]) * kBiasGradChunkRows;
    const int64_t rows = min(static_cast<int64_t>(kBiasGradChunkRows), group_rows(p.splits, p.offsets, e) - local);
    const int64_t row0 = p.offsets[e] + local;
    const int64_t col = col0 + lane * 8;
    float acc[8] = {};
    if (col < p.n) {
      for (int64_t r = row_lane; r < rows; r += kRowLanes) {
        float v[8];
        load8(dy + (row0 + r) * p.n + col, v);
        const float s = p.bias_scale != nullptr ? p.bias_scale[row0 + r] : 1.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += s * v[i];
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) lane_sums[row_lane][lane * 8 + i] = acc[i];
    __syncthreads();
    const int64_t c = col0 + threadIdx.x;
    if (c < p.n) {
      float sum = 0.0f;
#pragma unroll
      for (int l = 0; l < kRowLanes; ++l) sum += lane_sums[l][threadIdx.x];
      p.partials[static_cast<int64_t>(chunk) * p.n + c] = sum;
    }
    __syncthreads();
  }
}

// dbias[e][col] = sum of group e's chunk partials, in chunk order.
template <class T>
__global__ void __launch_bounds__(kThreads) bias_grad_reduce_kernel(BiasGradParams p) {
  __shared__ int chunk_prefix[kMaxGroups + 1];
  __shared__ int warp_sums[kThreads / 32];
  build_tile_prefix<kThreads, kBiasGradChunkRows, false>(p.splits, p.offsets, p.num_groups, chunk_prefix, warp_sums);
  const int e = blockIdx.y;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (col >= p.n) return;
  float sum = 0.0f;
  for (int chunk = chunk_prefix[e]; chunk < chunk_prefix[e + 1]; ++chunk) sum += p.partials[chunk * p.n + col];
  static_cast<T*>(p.dbias)[static_cast<int64_t>(e) * p.n + col] = static_cast<T>(sum);
}

// dbias_scale[r] = <dy_r, b_e>, one warp per used row; gap rows get 0.
template <class T>
__global__ void __launch_bounds__(kThreads) bias_scale_grad_kernel(BiasGradParams p) {
  const T* dy = static_cast<const T*>(p.dy);
  const T* bias = static_cast<const T*>(p.bias);
  const int lane = threadIdx.x & 31;
  const int64_t used = p.offsets[p.num_groups];
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t r = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5); r < used; r += warps) {
    int lo = 0, hi = p.num_groups - 1;  // the group whose span holds row r
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (p.offsets[mid] <= r) lo = mid; else hi = mid - 1;
    }
    const bool data = r - p.offsets[lo] < group_rows(p.splits, p.offsets, lo);
    float sum = 0.0f;
    if (data) {
      for (int64_t c = lane * 8; c < p.n; c += 32 * 8) {
        float a[8], b[8];
        load8(dy + r * p.n + c, a);
        load8(bias + static_cast<int64_t>(lo) * p.n + c, b);
#pragma unroll
        for (int i = 0; i < 8; ++i) sum += a[i] * b[i];
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    if (lane == 0) p.dbias_scale[r] = sum;
  }
}

template <class T>
void launch(const BiasGradParams& p, int grid, cudaStream_t stream) {
  if (p.dbias != nullptr) {
    bias_grad_partials_kernel<T><<<grid, kThreads, 0, stream>>>(p);
    MG_LAUNCH_CHECK();
    const dim3 reduce_grid(static_cast<unsigned>((p.n + kThreads - 1) / kThreads), p.num_groups);
    bias_grad_reduce_kernel<T><<<reduce_grid, kThreads, 0, stream>>>(p);
    MG_LAUNCH_CHECK();
  }
  if (p.dbias_scale != nullptr) {
    bias_scale_grad_kernel<T><<<grid, kThreads, 0, stream>>>(p);
    MG_LAUNCH_CHECK();
  }
}

}  // namespace

std::size_t bias_grad_workspace_floats(int64_t capacity_rows, int num_groups, int64_t n) {
  const int64_t chunks = (capacity_rows + kBiasGradChunkRows - 1) / kBiasGradChunkRows + num_groups;
  return static_cast<std::size_t>(chunks * n);
}

void launch_bias_grad(DType dtype, const BiasGradParams& p, int grid, cudaStream_t stream) {
  MG_CHECK(p.dbias == nullptr || p.partials != nullptr, "bias gradient needs its workspace");
  MG_CHECK(p.dbias_scale == nullptr || p.bias != nullptr, "dbias_scale needs the bias");
  with_16bit_type(dtype, "bias_grad", [&](auto t) { launch<decltype(t)>(p, grid, stream); });
}

}  // namespace moegraph::kernels
