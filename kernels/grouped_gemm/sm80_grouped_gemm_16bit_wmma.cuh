// The foundation grouped GEMMs: tensor-core (WMMA, mma.sync) tiles fed by a cp.async multi-stage
// shared-memory pipeline, in persistent kernels that schedule their tiles from device offsets.
// Correct for any split; the TMA + wgmma kernels of a later version are measured against these.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cstdint>

#include "kernels/common/cp_async.cuh"
#include "kernels/common/ragged_tiles.cuh"
#include "kernels/common/vector_io.cuh"
#include "kernels/grouped_gemm/grouped_gemm.hpp"

namespace moegraph::kernels::reference_gemm {

namespace wmma = nvcuda::wmma;

constexpr int BM = 128, BN = 128, BK = 32;   // block tile (BLOCK_M, BLOCK_N) x BLOCK_K
constexpr int STAGES = 4, THREADS = 256;
constexpr int WARPS_M = 2, WARPS_N = 4;      // warp tile 64 x 32 = 4 x 2 fragments of 16 x 16
constexpr int FM = BM / WARPS_M / 16, FN = BN / WARPS_N / 16;
constexpr int PAD = 8;                       // 16 bytes per smem row: breaks bank alignment
constexpr int STAGE_LD = BN + 4;             // fp32 epilogue staging row, floats
static_assert(WARPS_M * WARPS_N * 32 == THREADS);

// One operand tile in shared memory. The reduction index is contiguous ("red-inner",
// [EXT][BK + PAD]) or the M/N index is ([BK][EXT + PAD]): whichever is contiguous in global
// memory, so every global load is a 16-byte cp.async.
template <bool RED_INNER, int EXT>
struct OperandTile {
  static constexpr int rows = RED_INNER ? EXT : BK;
  static constexpr int inner = RED_INNER ? BK : EXT;
  static constexpr int ld = inner + PAD;
  static constexpr int elems = rows * ld;
};

constexpr int max_tile_elems() {
  constexpr int a = OperandTile<true, BM>::elems, b = OperandTile<false, BM>::elems;
  return a > b ? a : b;
}
constexpr int kTileElems = max_tile_elems();                 // BM == BN, so A and B share it
constexpr int kPipelineBytes = STAGES * 2 * kTileElems * 2;  // 16-bit elements
constexpr int kStagingBytes = BM * STAGE_LD * 4;
constexpr int kSmemBytes = kPipelineBytes > kStagingBytes ? kPipelineBytes : kStagingBytes;
static_assert(BM == BN, "A and B tiles share one extent");

template <class T> struct WmmaType;
template <> struct WmmaType<__nv_bfloat16> { using type = __nv_bfloat16; };
template <> struct WmmaType<__half> { using type = half; };


// Loads one operand tile whose origin is `g`. Element (mn, red) lives at g[mn * ld + red]
// (RED_INNER) or g[red * ld + mn]. Out-of-range chunks (mn >= mn_lim or red >= red_lim) are
// zero-filled; limits on the contiguous index are multiples of 8, so a chunk is all in or all out.
template <class T, bool RED_INNER, int EXT>
__device__ __forceinline__ void load_tile(T* smem, const T* g, int64_t ld, int64_t mn_lim,
                                          int64_t red_lim, const T* safe) {
  using Tile = OperandTile<RED_INNER, EXT>;
  constexpr int kChunksPerRow = Tile::inner / 8;
  constexpr int kChunks = Tile::rows * kChunksPerRow;
  static_assert(kChunks % THREADS == 0);
#pragma unroll
  for (int i = 0; i < kChunks / THREADS; ++i) {
    const int c = threadIdx.x + i * THREADS;
    const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    const bool valid = RED_INNER ? (row < mn_lim && col < red_lim) : (row < red_lim && col < mn_lim);
    const T* src = valid ? g + row * ld + col : safe;
    cp_async_16(smem + row * Tile::ld + col, src, valid);
  }
}

template <class T>
using AccFrag = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// acc += A(mn_a, red) · B(red, mn_b) over red in [0, red_len), for this block's BM x BN tile.
// a / b are tile origins (red = 0); the *_safe pointers are any valid address of each tensor.
template <class T, bool A_RI, bool B_RI>
__device__ __forceinline__ void mainloop(T* smem, const T* a, int64_t lda, int64_t a_mn_lim,
                                         const T* b, int64_t ldb, int64_t b_mn_lim, int64_t red_len,
                                         const T* a_safe, const T* b_safe,
                                         AccFrag<T> (&acc)[FM][FN]) {
  using WT = typename WmmaType<T>::type;
  using ALayout = typename std::conditional<A_RI, wmma::row_major, wmma::col_major>::type;
  using BLayout = typename std::conditional<B_RI, wmma::col_major, wmma::row_major>::type;
  using ATile = OperandTile<A_RI, BM>;
  using BTile = OperandTile<B_RI, BN>;
  const int warp = threadIdx.x >> 5;
  const int wm = (warp % WARPS_M) * (BM / WARPS_M), wn = (warp / WARPS_M) * (BN / WARPS_N);

  auto stage_a = [&](int s) { return smem + s * 2 * kTileElems; };
  auto stage_b = [&](int s) { return smem + s * 2 * kTileElems + kTileElems; };
  auto load_stage = [&](int kt) {
    const int s = kt % STAGES;
    const int64_t r0 = static_cast<int64_t>(kt) * BK;
    load_tile<T, A_RI, BM>(stage_a(s), A_RI ? a + r0 : a + r0 * lda, lda, a_mn_lim, red_len - r0, a_safe);
    load_tile<T, B_RI, BN>(stage_b(s), B_RI ? b + r0 : b + r0 * ldb, ldb, b_mn_lim, red_len - r0, b_safe);
  };

  const int ktiles = static_cast<int>((red_len + BK - 1) / BK);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s);
    cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage kt landed for all threads; stage kt-1 is no longer being read
    if (kt + STAGES - 1 < ktiles) load_stage(kt + STAGES - 1);
    cp_async_commit();
    const T* as = stage_a(kt % STAGES);
    const T* bs = stage_b(kt % STAGES);
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, WT, ALayout> fa[FM];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, WT, BLayout> fb[FN];
#pragma unroll
      for (int i = 0; i < FM; ++i) {
        const int m = wm + i * 16;
        const T* p = A_RI ? as + m * ATile::ld + kk : as + kk * ATile::ld + m;
        wmma::load_matrix_sync(fa[i], reinterpret_cast<const WT*>(p), ATile::ld);
      }
#pragma unroll
      for (int j = 0; j < FN; ++j) {
        const int n = wn + j * 16;
        const T* p = B_RI ? bs + n * BTile::ld + kk : bs + kk * BTile::ld + n;
        wmma::load_matrix_sync(fb[j], reinterpret_cast<const WT*>(p), BTile::ld);
      }
#pragma unroll
      for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline buffers become the epilogue staging area
}

// Writes the accumulators into the fp32 staging tile [BM][STAGE_LD] and waits for all warps.
template <class T>
__device__ __forceinline__ void stage_accumulators(float* staging, AccFrag<T> (&acc)[FM][FN]) {
  const int warp = threadIdx.x >> 5;
  const int wm = (warp % WARPS_M) * (BM / WARPS_M), wn = (warp / WARPS_M) * (BN / WARPS_N);
#pragma unroll
  for (int i = 0; i < FM; ++i)
#pragma unroll
    for (int j = 0; j < FN; ++j)
      wmma::store_matrix_sync(staging + (wm + i * 16) * STAGE_LD + wn + j * 16, acc[i][j], STAGE_LD,
                              wmma::mem_row_major);
  __syncthreads();
}


// fprop and dgrad. A_RI: A is row-major with the reduction contiguous (always, here).
// B_RI: fprop reads W_e as [N][K] (K = reduction contiguous); dgrad reads it as [N][K] with
// N = reduction, so the output index K is contiguous.
template <class T, bool B_RI>
__global__ void __launch_bounds__(THREADS, 2) ragged_gemm_kernel(RaggedGemmParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ int tile_prefix[kMaxGroups + 1];
  __shared__ int warp_sums[THREADS / 32];
  T* smem = reinterpret_cast<T*>(smem_raw);
  float* staging = reinterpret_cast<float*>(smem_raw);

  const int64_t red = B_RI ? p.k : p.n;   // reduction length
  const int64_t cols = B_RI ? p.n : p.k;  // output columns
  const T* a_all = static_cast<const T*>(p.a);
  const T* w_all = static_cast<const T*>(p.w);
  const T* bias = static_cast<const T*>(p.bias);
  T* c_all = static_cast<T*>(p.c);

  build_tile_prefix<THREADS, BM, true>(p.splits, p.offsets, p.num_groups, tile_prefix, warp_sums);
  const int tiles_n = static_cast<int>((cols + BN - 1) / BN);
  const int64_t total = static_cast<int64_t>(tile_prefix[p.num_groups]) * tiles_n;

  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int mt = static_cast<int>(t / tiles_n), nt = static_cast<int>(t % tiles_n);
    const RaggedTile tile = locate_ragged_tile<BM>(tile_prefix, p.splits, p.offsets, p.num_groups, mt);
    const int64_t n0 = static_cast<int64_t>(nt) * BN;
    const T* w_e = w_all + static_cast<int64_t>(tile.group) * p.n * p.k;

    AccFrag<T> acc[FM][FN];
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
      for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

    // fprop: B(red = k, mn = n) = W_e[n][k];  dgrad: B(red = n, mn = k) = W_e[n][k]
    const T* b_origin = B_RI ? w_e + n0 * p.k : w_e + n0;
    mainloop<T, true, B_RI>(smem, a_all + tile.row0 * red, red, tile.data_rows, b_origin, p.k, cols - n0, red,
                            a_all, w_all, acc);
    stage_accumulators<T>(staging, acc);

    constexpr int kChunksPerRow = BN / 8;
    for (int c = threadIdx.x; c < BM * kChunksPerRow; c += THREADS) {
      const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      const float4 lo = *reinterpret_cast<const float4*>(staging + row * STAGE_LD + col);
      const float4 hi = *reinterpret_cast<const float4*>(staging + row * STAGE_LD + col + 4);
      float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      store_ragged_chunk8(c_all, cols, tile, n0, row, col, v, bias, p.bias_scale);
    }
    __syncthreads();  // staging is read before the next tile's loads overwrite it
  }
}

// dW_e[n][k] = sum over group e's rows r of dy[r][n] * x[r][k]. Tiles: (group, n tile, k tile).
template <class T>
__global__ void __launch_bounds__(THREADS, 2) grouped_wgrad_kernel(WgradParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  float* staging = reinterpret_cast<float*>(smem_raw);
  const T* dy = static_cast<const T*>(p.dy);
  const T* x = static_cast<const T*>(p.x);
  T* dweight = static_cast<T*>(p.dweight);

  const int tiles_n = static_cast<int>((p.n + BM - 1) / BM);
  const int tiles_k = static_cast<int>((p.k + BN - 1) / BN);
  const int64_t per_group = static_cast<int64_t>(tiles_n) * tiles_k;
  const int64_t total = per_group * p.num_groups;
  constexpr int kChunksPerRow = BN / 8;

  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int e = static_cast<int>(t / per_group);
    const int64_t local = t % per_group;
    const int64_t n0 = (local / tiles_k) * BM, k0 = (local % tiles_k) * BN;
    const int64_t rows = group_rows(p.splits, p.offsets, e);
    const int64_t out0 = static_cast<int64_t>(e) * p.n * p.k;
    if (rows == 0) {
      if (p.main_grad != nullptr) continue;  // accumulating nothing leaves main_grad unchanged
      for (int c = threadIdx.x; c < BM * kChunksPerRow; c += THREADS) {
        const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
        if (n0 + row >= p.n || k0 + col >= p.k) continue;
        const float zeros[8] = {};
        store8(dweight + out0 + (n0 + row) * p.k + k0 + col, zeros);
      }
      continue;
    }
    AccFrag<T> acc[FM][FN];
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
      for (int j = 0; j < FN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
    const int64_t r0 = p.offsets[e];
    // A(mn = n, red = r) = dy[r][n]; B(red = r, mn = k) = x[r][k]: both M/N-contiguous.
    mainloop<T, false, false>(smem, dy + r0 * p.n + n0, p.n, p.n - n0, x + r0 * p.k + k0, p.k,
                              p.k - k0, rows, dy, x, acc);
    stage_accumulators<T>(staging, acc);
    for (int c = threadIdx.x; c < BM * kChunksPerRow; c += THREADS) {
      const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      if (n0 + row >= p.n || k0 + col >= p.k) continue;
      const float4 lo = *reinterpret_cast<const float4*>(staging + row * STAGE_LD + col);
      const float4 hi = *reinterpret_cast<const float4*>(staging + row * STAGE_LD + col + 4);
      const int64_t o = out0 + (n0 + row) * p.k + k0 + col;
      if (p.main_grad != nullptr) {
        float4* mg = reinterpret_cast<float4*>(p.main_grad + o);
        float4 m0 = mg[0], m1 = mg[1];
        m0.x += lo.x; m0.y += lo.y; m0.z += lo.z; m0.w += lo.w;
        m1.x += hi.x; m1.y += hi.y; m1.z += hi.z; m1.w += hi.w;
        mg[0] = m0;
        mg[1] = m1;
      } else {
        const float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        store8(dweight + o, v);
      }
    }
    __syncthreads();
  }
}

}  // namespace moegraph::kernels::reference_gemm
