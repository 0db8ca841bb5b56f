// Grouped GEMMs on Hopper tensor cores (wgmma, sm_90a). Two consumer warpgroups each own 64 rows
// of a 128 x 128 tile. Operands stream through cp.async into 128-byte-swizzled shared memory, K-major
// or MN-major as they lie in global memory (wgmma transposes MN-major tiles itself), so every
// zero-filling mask of the foundation kernels carries over. Persistent grids; tiles are scheduled
// from the device offsets only.
//   fprop: y = x · W_e^T      A = x  (K-major)   B = W_e (K-major: [N][K], K = reduction)
//   dgrad: dx = dy · W_e      A = dy (K-major)   B = W_e (MN-major: [N][K], N = reduction)
//   wgrad: dW_e = dy_e^T x_e  A = dy (MN-major)  B = x  (MN-major), reduction over the group's rows
#pragma once

#include <cstdint>

#include "kernels/common/cp_async.cuh"
#include "kernels/common/ragged_tiles.cuh"
#include "kernels/common/vector_io.cuh"
#include "kernels/grouped_gemm/grouped_gemm.hpp"
#include "kernels/grouped_gemm/sm90_wgmma_ops.cuh"

namespace moegraph::kernels::cp_async_gemm {

constexpr int BM = 128, BK = 64, THREADS = 256;  // 2 warpgroups of 64 rows; BK * 2 bytes = one swizzle row
constexpr int kTileBytesA = BM * BK * 2;         // either layout: 128 M x 64 K of 16-bit elements
constexpr int kHalfTileBytes = kTileBytesA / 2;  // a warpgroup's 64 rows, either layout
constexpr uint32_t kMnAtomStride = 8 * 1024;     // MN-major: 8 K-groups per 64-wide MN atom

// (BLOCK_M, BLOCK_N) x BLOCK_K = (128, kBN) x 64. 128 x 128 with 3 stages fits 2 CTAs per SM
// (latency hiding for small or memory-bound problems); 128 x 256 with 4 stages is one CTA with
// a quarter less operand traffic per FLOP (large problems).
// kOneBarrier: refill the slot of stage kt-2 right after the top-of-loop barrier (its MMAs are known
// complete in both warpgroups there), so the K loop needs one CTA-wide barrier instead of two, at
// the price of one stage of prefetch distance (STAGES - 2 instead of STAGES - 1).
template <int kBN, int kStages, int kCtasPerSm, bool kOneBarrier>
struct TileShape {
  static constexpr int BN = kBN, STAGES = kStages, CTAS_PER_SM = kCtasPerSm;
  static constexpr bool ONE_BARRIER = kOneBarrier;
  static constexpr int PREFETCH = kOneBarrier ? kStages - 2 : kStages - 1;  // stages loaded ahead
  static_assert(PREFETCH >= 1);
  static constexpr int kTileBytesB = BN * BK * 2;
  static constexpr int kStageBytes = kTileBytesA + kTileBytesB;
  static constexpr int kSmemBytes = STAGES * kStageBytes + 1024;  // + slack to align tiles to 1024 bytes
  static constexpr int kStageLd = BN + 4;                         // fp32 epilogue staging row (padded)
  static_assert(BM * kStageLd * 4 <= STAGES * kStageBytes, "the epilogue staging reuses the pipeline");
};
using Tile128 = TileShape<128, 3, 2, false>;
using Tile256 = TileShape<256, 4, 1, true>;

// One 128 (M or N) x 64 (K) operand tile from global memory origin g (row stride ld), masked:
// K-major: element (mn, k) at g[mn * ld + k]; valid while mn < mn_lim and k < k_lim.
// MN-major: element (mn, k) at g[k * ld + mn]; valid while k < k_lim and mn < mn_lim.
// Limits on the contiguous index are multiples of 8, so a 16-byte chunk is all in or all out.
template <class T, bool kMnMajor, int kExt>
__device__ __forceinline__ void load_tile(uint8_t* tile, const T* g, int64_t ld, int64_t mn_lim, int64_t k_lim,
                                          const T* safe) {
  constexpr int kChunksPerKRow = kExt / 8;  // MN-major: 16-byte chunks along one k-row
#pragma unroll
  for (int i = 0; i < kExt * 8 / THREADS; ++i) {
    const int c = threadIdx.x + i * THREADS;
    if constexpr (!kMnMajor) {
      const int row = c >> 3, chunk = c & 7;  // row = mn, chunk of 8 along k
      const bool valid = row < mn_lim && chunk * 8 < k_lim;
      cp_async_16(tile + row * 128 + ((chunk ^ (row & 7)) << 4), valid ? g + row * ld + chunk * 8 : safe, valid);
    } else {
      const int k = c / kChunksPerKRow, chunk = c % kChunksPerKRow;  // 64 k-rows of kExt mn
      const bool valid = k < k_lim && chunk * 8 < mn_lim;
      uint8_t* dst = tile + (chunk >> 3) * kMnAtomStride + (k >> 3) * 1024 + (k & 7) * 128 +
                     (((chunk & 7) ^ (k & 7)) << 4);
      cp_async_16(dst, valid ? g + k * ld + chunk * 8 : safe, valid);
    }
  }
}

template <bool kMnMajor>
__device__ __forceinline__ uint64_t tile_desc(uint32_t addr) {
  return kMnMajor ? sm90::mnmajor_sw128_desc(addr, kMnAtomStride) : sm90::kmajor_sw128_desc(addr);
}
// Bytes to advance a descriptor's start by 16 K-elements.
template <bool kMnMajor>
__host__ __device__ constexpr uint32_t kstep_bytes() { return kMnMajor ? 2048 : 32; }

template <class Tile>
using Acc = float[Tile::BN / 2];

// acc = A(this warpgroup's 64 rows, 0..red_len) · B(0..red_len, BN columns).
// a / b: tile origins at reduction index 0; tiles advance by BK along the reduction.
template <class T, class Tile, bool kAMn, bool kBMn>
__device__ __forceinline__ void mainloop(uint8_t* smem, const T* a, int64_t lda, int64_t a_mn_lim, const T* b,
                                         int64_t ldb, int64_t b_mn_lim, int64_t red_len, const T* a_safe,
                                         const T* b_safe, Acc<Tile>& acc) {
  constexpr int STAGES = Tile::STAGES, BN = Tile::BN, kStageBytes = Tile::kStageBytes;
  const int wg = threadIdx.x / 128;
  auto load_stage = [&](int kt) {
    uint8_t* stage = smem + (kt % STAGES) * kStageBytes;
    const int64_t r0 = static_cast<int64_t>(kt) * BK;
    load_tile<T, kAMn, BM>(stage, kAMn ? a + r0 * lda : a + r0, lda, a_mn_lim, red_len - r0, a_safe);
    load_tile<T, kBMn, BN>(stage + kTileBytesA, kBMn ? b + r0 * ldb : b + r0, ldb, b_mn_lim, red_len - r0, b_safe);
  };
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
  constexpr int PREFETCH = Tile::PREFETCH;
  const int ktiles = static_cast<int>((red_len + BK - 1) / BK);
#pragma unroll
  for (int s = 0; s < PREFETCH; ++s) {
    if (s < ktiles) load_stage(s);
    cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<PREFETCH - 1>();  // one group committed per stage: stage kt has landed
    sm90::fence_proxy_async_smem();
    __syncthreads();  // stage kt is in shared memory for every thread
    if constexpr (Tile::ONE_BARRIER) {
      // Every thread has passed last iteration's wgmma_wait<1>: stage kt-2's slot is free.
      if (kt + PREFETCH < ktiles) load_stage(kt + PREFETCH);
      cp_async_commit();
    }
    const uint8_t* stage = smem + (kt % STAGES) * kStageBytes;
    const uint32_t a_addr = sm90::smem_addr(stage + wg * kHalfTileBytes);
    const uint32_t b_addr = sm90::smem_addr(stage + kTileBytesA);
    sm90::fence_registers(acc);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk)
      sm90::Wgmma<T, BN>::template mma<kAMn, kBMn>(acc, tile_desc<kAMn>(a_addr + kk * kstep_bytes<kAMn>()),
                                                   tile_desc<kBMn>(b_addr + kk * kstep_bytes<kBMn>()), 1);
    sm90::wgmma_commit();
    sm90::wgmma_wait<1>();  // this warpgroup's MMAs of stage kt-1 have finished reading it
    sm90::fence_registers(acc);
    if constexpr (!Tile::ONE_BARRIER) {
      __syncthreads();      // ... and the other warpgroup's: stage kt-1's slot may be refilled
      if (kt + PREFETCH < ktiles) load_stage(kt + PREFETCH);
      cp_async_commit();
    }
  }
  sm90::wgmma_wait<0>();
  sm90::fence_registers(acc);
  cp_async_wait<0>();
  __syncthreads();  // the next tile's prologue overwrites the stages
}

// The accumulators go through shared memory so that global stores are 16-byte vectors along rows
// (and main_grad's loads can all be issued before its stores). Layout of m64nNk16: warp w of the
// warpgroup holds rows 16w + lane/4 (+8); registers 4j + {0,1} are columns 8j + 2(lane%4) + {0,1}
// of the first row, 4j + {2,3} of the second.
template <class Tile>
__device__ __forceinline__ void stage_accumulators(float* staging, const Acc<Tile>& acc) {
  constexpr int BN = Tile::BN, kStageLd = Tile::kStageLd;
  const int wg = threadIdx.x / 128, lane = threadIdx.x % 32, warp_in_wg = (threadIdx.x % 128) / 32;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = wg * 64 + warp_in_wg * 16 + lane / 4 + half * 8;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
      *reinterpret_cast<float2*>(staging + row * kStageLd + j * 8 + (lane % 4) * 2) =
          make_float2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
  }
  __syncthreads();
}

// f(row, col, v[8]) for each 8-column chunk of the staged tile this thread writes; ends with a
// barrier so the next tile may reuse shared memory.
template <class Tile, class F>
__device__ __forceinline__ void for_each_chunk8(const float* staging, F f) {
  constexpr int kChunksPerRow = Tile::BN / 8, kStageLd = Tile::kStageLd;
#pragma unroll 2
  for (int c = threadIdx.x; c < BM * kChunksPerRow; c += THREADS) {
    const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    const float4 lo = *reinterpret_cast<const float4*>(staging + row * kStageLd + col);
    const float4 hi = *reinterpret_cast<const float4*>(staging + row * kStageLd + col + 4);
    float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    f(row, col, v);
  }
  __syncthreads();
}

// main_grad[row][col] += staged tile, as float4s: every load is issued before any store (the
// compiler may not reorder a load past a store that could alias it).
template <class Tile>
__device__ __forceinline__ void accumulate_main_grad(const float* staging, float* main_grad, int64_t ld,
                                                     int64_t row_lim, int64_t col_lim) {
  constexpr int kVecsPerRow = Tile::BN / 4, kStageLd = Tile::kStageLd, kPerRound = 4;
  constexpr int kRounds = BM * kVecsPerRow / THREADS / kPerRound;
#pragma unroll 1
  for (int round = 0; round < kRounds; ++round) {  // rounds keep the batch within the register budget
    float4 old[kPerRound];
#pragma unroll
    for (int i = 0; i < kPerRound; ++i) {
      const int c = threadIdx.x + (round * kPerRound + i) * THREADS, row = c / kVecsPerRow, col = (c % kVecsPerRow) * 4;
      if (row < row_lim && col < col_lim) old[i] = *reinterpret_cast<const float4*>(main_grad + row * ld + col);
    }
#pragma unroll
    for (int i = 0; i < kPerRound; ++i) {
      const int c = threadIdx.x + (round * kPerRound + i) * THREADS, row = c / kVecsPerRow, col = (c % kVecsPerRow) * 4;
      if (row >= row_lim || col >= col_lim) continue;
      const float4 add = *reinterpret_cast<const float4*>(staging + row * kStageLd + col);
      *reinterpret_cast<float4*>(main_grad + row * ld + col) =
          make_float4(old[i].x + add.x, old[i].y + add.y, old[i].z + add.z, old[i].w + add.w);
    }
  }
  __syncthreads();
}

// fprop (kDgrad = false) and dgrad (true): rows ragged by group; gap rows written as zero.
template <class T, class Tile, bool kDgrad>
__global__ void __launch_bounds__(THREADS, Tile::CTAS_PER_SM) ragged_gemm_kernel(RaggedGemmParams p) {
  constexpr int BN = Tile::BN;
  extern __shared__ uint8_t smem_raw[];
  __shared__ int tile_prefix[kMaxGroups + 1];
  __shared__ int warp_sums[THREADS / 32];
  uint8_t* smem = sm90::aligned_smem(smem_raw);
  const T* a_all = static_cast<const T*>(p.a);
  const T* w = static_cast<const T*>(p.w);
  const T* bias = static_cast<const T*>(p.bias);
  T* c_all = static_cast<T*>(p.c);
  const int64_t red = kDgrad ? p.n : p.k, cols = kDgrad ? p.k : p.n;

  build_tile_prefix<THREADS, BM, true>(p.splits, p.offsets, p.num_groups, tile_prefix, warp_sums);
  const int tiles_n = static_cast<int>((cols + BN - 1) / BN);
  const int64_t total = static_cast<int64_t>(tile_prefix[p.num_groups]) * tiles_n;
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int mt = static_cast<int>(t / tiles_n), nt = static_cast<int>(t % tiles_n);
    const RaggedTile tile = locate_ragged_tile<BM>(tile_prefix, p.splits, p.offsets, p.num_groups, mt);
    const int64_t n0 = static_cast<int64_t>(nt) * BN;
    const T* w_e = w + static_cast<int64_t>(tile.group) * p.n * p.k;
    // fprop: B(k, n) = W_e[n][k] (K-major, origin row n0); dgrad: B(n, k) = W_e[n][k] (MN-major, origin column n0).
    const T* b_origin = kDgrad ? w_e + n0 : w_e + n0 * p.k;
    Acc<Tile> acc;
    mainloop<T, Tile, false, kDgrad>(smem, a_all + tile.row0 * red, red, tile.data_rows, b_origin, p.k, cols - n0,
                                      red, a_all, w, acc);
    float* staging = reinterpret_cast<float*>(smem);
    stage_accumulators<Tile>(staging, acc);
    for_each_chunk8<Tile>(staging, [&](int row, int col, float (&v)[8]) {
      store_ragged_chunk8(c_all, cols, tile, n0, row, col, v, bias, p.bias_scale);
    });
  }
}

// dW_e[n][k] = sum over group e's rows r of dy[r][n] x[r][k]: tiles (group, n tile, k tile), the
// reduction over the group's rows; written (empty group: zeros) or added into fp32 main_grad.
template <class T, class Tile>
__global__ void __launch_bounds__(THREADS, Tile::CTAS_PER_SM) grouped_wgrad_kernel(WgradParams p) {
  constexpr int BN = Tile::BN;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = sm90::aligned_smem(smem_raw);
  const T* dy = static_cast<const T*>(p.dy);
  const T* x = static_cast<const T*>(p.x);
  T* dweight = static_cast<T*>(p.dweight);
  const int tiles_n = static_cast<int>((p.n + BM - 1) / BM);
  const int tiles_k = static_cast<int>((p.k + BN - 1) / BN);
  const int64_t per_group = static_cast<int64_t>(tiles_n) * tiles_k;
  const int64_t total = per_group * p.num_groups;
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int e = static_cast<int>(t / per_group);
    const int64_t local = t % per_group;
    const int64_t n0 = (local / tiles_k) * BM, k0 = (local % tiles_k) * BN;
    const int64_t rows = group_rows(p.splits, p.offsets, e);
    if (rows == 0 && p.main_grad != nullptr) continue;  // accumulating nothing leaves main_grad unchanged
    Acc<Tile> acc;
    if (rows > 0) {
      const int64_t r0 = p.offsets[e];
      mainloop<T, Tile, true, true>(smem, dy + r0 * p.n + n0, p.n, p.n - n0, x + r0 * p.k + k0, p.k, p.k - k0, rows, dy, x,
                              acc);
    } else {
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;  // an empty group's gradient is zero
    }
    const int64_t out0 = static_cast<int64_t>(e) * p.n * p.k + n0 * p.k + k0;
    float* staging = reinterpret_cast<float*>(smem);
    stage_accumulators<Tile>(staging, acc);
    if (p.main_grad != nullptr) {
      accumulate_main_grad<Tile>(staging, p.main_grad + out0, p.k, p.n - n0, p.k - k0);
    } else {
      for_each_chunk8<Tile>(staging, [&](int row, int col, float (&v)[8]) {
        if (n0 + row < p.n && k0 + col < p.k) store8(dweight + out0 + row * p.k + col, v);
      });
    }
  }
}

}  // namespace moegraph::kernels::cp_async_gemm
