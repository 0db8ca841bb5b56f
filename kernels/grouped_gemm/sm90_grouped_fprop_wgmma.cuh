// fprop on Hopper tensor cores: y[r, :] = x[r, :] · W_e^T (+ s_r b_e) with wgmma.
// Two consumer warpgroups each own 64 rows of a 128 x 128 tile; x and W_e are both K-major, so
// both stream through cp.async into 128-byte-swizzled shared memory (the zero-filling masks of
// the foundation kernel carry over) and feed wgmma directly through smem descriptors. Persistent,
// with the tile scheduler of the foundation kernel (device offsets only).
#pragma once

#include <cstdint>

#include "kernels/common/cp_async.cuh"
#include "kernels/common/ragged_tiles.cuh"
#include "kernels/grouped_gemm/grouped_gemm.hpp"
#include "kernels/grouped_gemm/sm90_wgmma_ops.cuh"

namespace moegraph::kernels::wgmma_fprop {

constexpr int BM = 128, BN = 128, BK = 64;  // (BLOCK_M, BLOCK_N) x BLOCK_K; BK * 2 bytes = one swizzle row
constexpr int STAGES = 3, THREADS = 256;    // 2 warpgroups; 3 stages let 2 CTAs share an SM
constexpr int kTileBytes = BM * BK * 2;     // A and B tiles are both 128 rows x 128 bytes
constexpr int kStageBytes = 2 * kTileBytes;
constexpr int kSmemBytes = STAGES * kStageBytes + 1024;  // + slack to align the tiles to 1024 bytes
static_assert(BM == BN && BK == 64);

// Rows [0, ROWS) x 64 K-elements from g (row stride ld) into a swizzled tile; masked chunks are
// zero-filled (row >= row_lim, or K chunk >= k_lim; k_lim is a multiple of 8).
template <class T>
__device__ __forceinline__ void load_tile_sw128(uint8_t* tile, const T* g, int64_t ld, int64_t row_lim,
                                                int64_t k_lim, const T* safe) {
  constexpr int kChunks = BM * 8;
#pragma unroll
  for (int i = 0; i < kChunks / THREADS; ++i) {
    const int c = threadIdx.x + i * THREADS;
    const int row = c >> 3, chunk = c & 7;
    const bool valid = row < row_lim && chunk * 8 < k_lim;
    const T* src = valid ? g + row * ld + chunk * 8 : safe;
    cp_async_16(tile + row * 128 + ((chunk ^ (row & 7)) << 4), src, valid);
  }
}

template <class T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  T pair[2] = {static_cast<T>(a), static_cast<T>(b)};
  return *reinterpret_cast<const uint32_t*>(pair);
}

template <class T>
__global__ void __launch_bounds__(THREADS, 2) grouped_fprop_wgmma_kernel(RaggedGemmParams p) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ int tile_prefix[kMaxGroups + 1];
  __shared__ int warp_sums[THREADS / 32];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});

  const T* x = static_cast<const T*>(p.a);
  const T* w = static_cast<const T*>(p.w);
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.c);
  const int wg = threadIdx.x / 128, lane = threadIdx.x % 32, warp_in_wg = (threadIdx.x % 128) / 32;

  build_tile_prefix<THREADS, BM, true>(p.splits, p.offsets, p.num_groups, tile_prefix, warp_sums);
  const int tiles_n = static_cast<int>((p.n + BN - 1) / BN);
  const int64_t total = static_cast<int64_t>(tile_prefix[p.num_groups]) * tiles_n;
  const int ktiles = static_cast<int>((p.k + BK - 1) / BK);

  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int mt = static_cast<int>(t / tiles_n), nt = static_cast<int>(t % tiles_n);
    const int e = find_group(tile_prefix, p.num_groups, mt);
    const int64_t local_row = static_cast<int64_t>(mt - tile_prefix[e]) * BM;
    const int64_t row0 = p.offsets[e] + local_row;
    const int64_t span_rows = min(static_cast<int64_t>(BM), group_span(p.offsets, e) - local_row);
    const int64_t data_rows = max(int64_t{0}, min(span_rows, group_rows(p.splits, p.offsets, e) - local_row));
    const int64_t n0 = static_cast<int64_t>(nt) * BN;
    const T* a_tile = x + row0 * p.k;
    const T* b_tile = w + (static_cast<int64_t>(e) * p.n + n0) * p.k;

    auto load_stage = [&](int kt) {
      uint8_t* stage = smem + (kt % STAGES) * kStageBytes;
      const int64_t k0 = static_cast<int64_t>(kt) * BK;
      load_tile_sw128(stage, a_tile + k0, p.k, data_rows, p.k - k0, x);
      load_tile_sw128(stage + kTileBytes, b_tile + k0, p.k, p.n - n0, p.k - k0, w);
    };

    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < ktiles) load_stage(s);
      cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; ++kt) {
      cp_async_wait<STAGES - 2>();
      sm90::fence_proxy_async_smem();
      __syncthreads();  // stage kt is in shared memory for every thread
      const uint8_t* stage = smem + (kt % STAGES) * kStageBytes;
      const uint32_t a_addr = sm90::smem_addr(stage + wg * 64 * 128);
      const uint32_t b_addr = sm90::smem_addr(stage + kTileBytes);
      sm90::fence_registers(acc);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
        sm90::Wgmma<T>::template mma<0, 0>(acc, sm90::kmajor_sw128_desc(a_addr + kk * 32),
                                           sm90::kmajor_sw128_desc(b_addr + kk * 32), 1);
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>();  // this warpgroup's MMAs of stage kt-1 have finished reading it
      sm90::fence_registers(acc);
      __syncthreads();        // ... and the other warpgroup's: its slot may be refilled
      if (kt + STAGES - 1 < ktiles) load_stage(kt + STAGES - 1);
      cp_async_commit();
    }
    sm90::wgmma_wait<0>();
    sm90::fence_registers(acc);

    // Accumulator layout of m64nNk16: warp w of the warpgroup holds rows 16w + lane/4 (+8);
    // register 4j + {0,1} are columns 8j + 2(lane%4) + {0,1} of the first row, 4j + {2,3} of the second.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = wg * 64 + warp_in_wg * 16 + lane / 4 + half * 8;
      if (row >= span_rows) continue;
      const bool data = row < data_rows;
      const float s = (data && bias != nullptr && p.bias_scale != nullptr) ? p.bias_scale[row0 + row] : 1.0f;
      T* out = y + (row0 + row) * p.n + n0;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int col = j * 8 + (lane % 4) * 2;
        if (n0 + col >= p.n) continue;
        float v0 = data ? acc[4 * j + 2 * half] : 0.0f, v1 = data ? acc[4 * j + 2 * half + 1] : 0.0f;
        if (data && bias != nullptr) {
          const T* b = bias + static_cast<int64_t>(e) * p.n + n0 + col;
          v0 += s * static_cast<float>(b[0]);
          v1 += s * static_cast<float>(b[1]);
        }
        *reinterpret_cast<uint32_t*>(out + col) = pack2<T>(v0, v1);
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the next tile's prologue overwrites the stages
  }
}

}  // namespace moegraph::kernels::wgmma_fprop
