// MXFP8 grouped GEMM on Hopper's FP8 tensor cores (wgmma e4m3, sm_90a). Both operands are K-major
// E4M3 with one E8M0 scale per 32 consecutive K elements (OCP MX). Hopper has no block-scaled MMA,
// so every 32-wide K block is its own wgmma (m64n128k32, into a fresh fp32 partial) and the partial
// is promoted into the accumulator with its row x column scale product:
//     acc[r][c] += partial_kb[r][c] * sa[r][kb] * sb[c][kb]
// kPingPong: two partials alternate so the promotion of block kb-1 overlaps the MMA of block kb (64
// more registers); otherwise each block's MMA is awaited before its promotion and only the other
// warpgroup overlaps it.
//   fprop: y = x · W_e^T    A = x rows (scales along K), B = W_e [N][K] (scales along K)
//   dgrad: dx = dy · W_e    A = dy rows (scales along N), B = W_e^T [K][N] (scales along N)
//   wgrad: dW_e = dy_e^T x_e  A = dy^T [N][rows], B = x^T [K][rows]: the column-wise copies, whose
//          blocks run along the group's rows (groups start on multiples of 32 rows), tiled in
//          128-column strips (kernels/quantize/mxfp8.hpp)
// The tile scheduler, the epilogue (bias, bias scale, gap rows zero) and the 128-byte-swizzled
// K-major shared-memory layout are the bf16 kernel's: 128 bytes of e4m3 are 128 K elements.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/grouped_gemm/sm90_grouped_gemm_16bit_cp_async.cuh"
#include "kernels/grouped_gemm/sm90_mxfp8_scales.cuh"
#include "kernels/quantize/mxfp8.hpp"

namespace moegraph::kernels::mxfp8_gemm {

using cp_async_gemm::BM;
using cp_async_gemm::THREADS;
constexpr int kBlock = 32;                   // elements per E8M0 scale
constexpr int BK = 128;                      // K elements (= bytes) per stage: one swizzle row
constexpr int kBlocksPerStage = BK / kBlock;  // 4
constexpr int STAGES = 4;
constexpr int kTileBytes = 128 * BK;                          // A: 128 rows; B: 128 columns
constexpr int kScaleBytes = 128 * kBlocksPerStage;            // one E8M0 word of 4 blocks per row
constexpr int kStageBytes = 2 * kTileBytes + 2 * kScaleBytes;  // 33 x 1024: tiles stay 1024-aligned
constexpr int kScaleFloats = 2 * kBlocksPerStage * 128;        // the current stage's scales as fp32
constexpr int kSmemBytes = STAGES * kStageBytes + kScaleFloats * 4 + 1024;
static_assert(kStageBytes % 1024 == 0);

// The bf16 kernel's epilogue helpers, for a 128 x 128 tile.
struct Tile128 {
  static constexpr int BN = 128, kStageLd = BN + 4;
  static_assert(BM * kStageLd * 4 <= STAGES * kStageBytes, "the epilogue staging reuses the pipeline");
};

// Scales in shared memory, per stage and operand: row-wise operands (fprop, dgrad) bring each
// row's 4-block word, [row][block]; column-wise operands (wgrad) bring 4 block-rows of 128 bytes,
// [block][row]. Global layouts: row-wise [rows][K / 32]; column-wise [rows / 32][cols] (block-major,
// so a stage's scales are 16-byte chunks wherever the group starts).
enum class ScaleLayout { kRowWise, kBlockMajor };

struct Operand {
  const uint8_t* data;    // tile origin: row 0 at reduction index 0
  const uint8_t* scales;  // row-wise: row 0's scales; block-major: block 0's row of scales, at column 0
  int64_t ld;             // bytes per row (block-major: within a 32-deep block, kBlock)
  int64_t scale_ld;       // row-wise: scale bytes per row; block-major: bytes per block-row
  int64_t rows;           // valid rows of the tile (masked beyond: zeros, zero scales)
  // Block-major only: bytes between 32-deep blocks. The column-wise copies are tiled
  // (mxfp8_colwise_offset): a tile of 128 rows lies in one 128-column strip, whose block j holds
  // each row's 32 bytes one after another.
  int64_t block_ld = 0;
};

// Stage kt of one operand: 128 rows x 128 bytes into the swizzled tile (reduction bytes at or past
// `red` read as zero), and its scales.
template <ScaleLayout kLayout>
__device__ __forceinline__ void load_operand(uint8_t* tile, uint8_t* scales, const Operand& o, int kt, int64_t red,
                                             const uint8_t* safe) {
  const int64_t k0 = static_cast<int64_t>(kt) * BK;
#pragma unroll
  for (int i = 0; i < 128 * 8 / THREADS; ++i) {
    const int c = threadIdx.x + i * THREADS, row = c >> 3, chunk = c & 7;
    const bool valid = row < o.rows && k0 + chunk * 16 < red;
    const int64_t at = kLayout == ScaleLayout::kRowWise
                           ? row * o.ld + k0 + chunk * 16
                           : (k0 / kBlock + (chunk >> 1)) * o.block_ld + row * o.ld + (chunk & 1) * 16;
    cp_async_16(tile + row * 128 + ((chunk ^ (row & 7)) << 4), valid ? o.data + at : safe, valid);
  }
  if constexpr (kLayout == ScaleLayout::kRowWise) {
    if (threadIdx.x < 128) {
      const int row = threadIdx.x;
      const bool valid = row < o.rows;
      cp_async_4(scales + row * 4, valid ? o.scales + row * o.scale_ld + kt * kBlocksPerStage : safe, valid);
    }
  } else if (threadIdx.x < kBlocksPerStage * 8) {  // 4 block-rows x 8 chunks of 16 rows
    const int kb = threadIdx.x >> 3, chunk = threadIdx.x & 7;
    const bool valid = chunk * 16 < o.rows && k0 + kb * kBlock < red;
    cp_async_16(scales + kb * 128 + chunk * 16,
                valid ? o.scales + (k0 / kBlock + kb) * o.scale_ld + chunk * 16 : safe, valid);
  }
}

template <ScaleLayout kLayout>
__device__ __forceinline__ uint32_t scale_byte(const uint8_t* scales, int row, int kb) {
  return kLayout == ScaleLayout::kRowWise ? scales[row * 4 + kb] : scales[kb * 128 + row];
}

// acc += partial (this thread's 2 rows x 32 columns of the warpgroup's 64 x 128) scaled per element.
// sfa / sfb: the stage's fp32 scales, [block][row] and [block][column].
__device__ __forceinline__ void promote(float (&acc)[64], const float (&partial)[64], const float* sfa,
                                        const float* sfb, int kb) {
  const int wg = threadIdx.x / 128, lane = threadIdx.x % 32, warp_in_wg = (threadIdx.x % 128) / 32;
  const int row = wg * 64 + warp_in_wg * 16 + lane / 4;
  const float fa0 = sfa[kb * 128 + row], fa1 = sfa[kb * 128 + row + 8];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float2 fb = *reinterpret_cast<const float2*>(sfb + kb * 128 + j * 8 + (lane % 4) * 2);
    acc[4 * j + 0] = fmaf(partial[4 * j + 0], fa0 * fb.x, acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(partial[4 * j + 1], fa0 * fb.y, acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(partial[4 * j + 2], fa1 * fb.x, acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(partial[4 * j + 3], fa1 * fb.y, acc[4 * j + 3]);
  }
}

__device__ __forceinline__ void mma_block(float (&partial)[64], uint32_t a_addr, uint32_t b_addr, int kb) {
  sm90::fence_registers(partial);
  sm90::wgmma_fence();
  sm90::Wgmma<__nv_fp8_e4m3, 128>::mma<0, 0>(partial, sm90::kmajor_sw128_desc(a_addr + kb * 32),
                                             sm90::kmajor_sw128_desc(b_addr + kb * 32), 0);
  sm90::wgmma_commit();
}

// acc = A(this warpgroup's 64 rows, 0..red) · B(0..red, 128 columns), red a multiple of 32.
template <ScaleLayout kLayout, bool kPingPong>
__device__ __forceinline__ void mainloop(uint8_t* smem, float* sf, const Operand& a, const Operand& b, int64_t red,
                                         const uint8_t* safe, float (&acc)[64]) {
  const int wg = threadIdx.x / 128;
  auto load_stage = [&](int kt) {
    uint8_t* stage = smem + (kt % STAGES) * kStageBytes;
    load_operand<kLayout>(stage, stage + 2 * kTileBytes, a, kt, red, safe);
    load_operand<kLayout>(stage + kTileBytes, stage + 2 * kTileBytes + kScaleBytes, b, kt, red, safe);
  };
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
  const int ktiles = static_cast<int>((red + BK - 1) / BK);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s);
    cp_async_commit();
  }
  float partial[kPingPong ? 2 : 1][64];
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<STAGES - 2>();  // stage kt has landed
    sm90::fence_proxy_async_smem();
    __syncthreads();  // ... for every thread; every thread is done with stage kt-1 (it waited for its MMAs)
    const uint8_t* stage = smem + (kt % STAGES) * kStageBytes;
    // The stage's scale bytes as fp32: sf[operand][block][row], 4 per thread.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int v = threadIdx.x * 4 + i, operand = v >> 9, row = (v >> 2) & 127, kb = v & 3;
      // Blocks past the reduction read as zero whatever their bytes say (a NaN scale there must
      // not meet the zero-filled elements).
      const bool valid = static_cast<int64_t>(kt) * BK + kb * kBlock < red;
      sf[operand * 512 + kb * 128 + row] =
          valid ? e8m0_to_float(scale_byte<kLayout>(stage + 2 * kTileBytes + operand * kScaleBytes, row, kb)) : 0.0f;
    }
    if (kt + STAGES - 1 < ktiles) load_stage(kt + STAGES - 1);  // into stage kt-1's slot
    cp_async_commit();
    __syncthreads();  // the fp32 scales are visible
    // A warpgroup whose 64 rows hold no data (a group's last tile, decode) skips its MMAs and
    // promotions: its accumulators stay zero, which is what the masked rows would give.
    if (wg * 64 >= a.rows) continue;
    const uint32_t a_addr = sm90::smem_addr(stage + wg * (kTileBytes / 2));
    const uint32_t b_addr = sm90::smem_addr(stage + kTileBytes);
    if constexpr (kPingPong) {
      mma_block(partial[0], a_addr, b_addr, 0);
#pragma unroll
      for (int kb = 1; kb < kBlocksPerStage; ++kb) {
        mma_block(partial[kb & 1], a_addr, b_addr, kb);
        sm90::wgmma_wait<1>();  // block kb-1 is done
        sm90::fence_registers(partial[(kb - 1) & 1]);
        promote(acc, partial[(kb - 1) & 1], sf, sf + 512, kb - 1);
      }
      sm90::wgmma_wait<0>();
      sm90::fence_registers(partial[(kBlocksPerStage - 1) & 1]);
      promote(acc, partial[(kBlocksPerStage - 1) & 1], sf, sf + 512, kBlocksPerStage - 1);
    } else {
#pragma unroll
      for (int kb = 0; kb < kBlocksPerStage; ++kb) {
        mma_block(partial[0], a_addr, b_addr, kb);
        sm90::wgmma_wait<0>();
        sm90::fence_registers(partial[0]);
        promote(acc, partial[0], sf, sf + 512, kb);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the epilogue and the next tile reuse the stages
}

// C[r, :] = A[r, :] · B_e^T over group e's rows (ragged by group; gap rows written as zero).
template <class T, bool kPingPong>
__global__ void __launch_bounds__(THREADS, 1) ragged_gemm_kernel(Mxfp8RaggedGemmParams p) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ int tile_prefix[kMaxGroups + 1];
  __shared__ int warp_sums[THREADS / 32];
  uint8_t* smem = sm90::aligned_smem(smem_raw);
  float* sf = reinterpret_cast<float*>(smem + STAGES * kStageBytes);
  const T* bias = static_cast<const T*>(p.bias);
  T* c_all = static_cast<T*>(p.c);
  const int64_t cols = p.n, red = p.k, scale_ld = p.k / kBlock;

  build_tile_prefix<THREADS, BM, true>(p.splits, p.offsets, p.num_groups, tile_prefix, warp_sums);
  const int tiles_n = static_cast<int>((cols + Tile128::BN - 1) / Tile128::BN);
  const int64_t total = static_cast<int64_t>(tile_prefix[p.num_groups]) * tiles_n;
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int mt = static_cast<int>(t / tiles_n), nt = static_cast<int>(t % tiles_n);
    const RaggedTile tile = locate_ragged_tile<BM>(tile_prefix, p.splits, p.offsets, p.num_groups, mt);
    const int64_t n0 = static_cast<int64_t>(nt) * Tile128::BN;
    const int64_t b_row0 = static_cast<int64_t>(tile.group) * cols + n0;  // row of B_e's column n0
    const Operand a{p.a + tile.row0 * red, p.a_scales + tile.row0 * scale_ld, red, scale_ld, tile.data_rows};
    const Operand b{p.b + b_row0 * red, p.b_scales + b_row0 * scale_ld, red, scale_ld, cols - n0};
    float acc[64];
    mainloop<ScaleLayout::kRowWise, kPingPong>(smem, sf, a, b, red, p.a, acc);
    float* staging = reinterpret_cast<float*>(smem);
    cp_async_gemm::stage_accumulators<Tile128>(staging, acc);
    cp_async_gemm::for_each_chunk8<Tile128>(staging, [&](int row, int col, float (&v)[8]) {
      store_ragged_chunk8(c_all, cols, tile, n0, row, col, v, bias, p.bias_scale);
    });
  }
}

// dW_e[n][k] = sum over group e's rows r of dy[r][n] x[r][k] from the column-wise copies: tiles
// (group, n tile, k tile), the reduction over the group's rows rounded up to whole 32-row blocks
// (alignment-gap rows are zero); written (empty group: zeros) or added into fp32 main_grad.
template <class T, bool kPingPong>
__global__ void __launch_bounds__(THREADS, 1) grouped_wgrad_kernel(Mxfp8WgradParams p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = sm90::aligned_smem(smem_raw);
  float* sf = reinterpret_cast<float*>(smem + STAGES * kStageBytes);
  T* dweight = static_cast<T*>(p.dweight);
  const int tiles_n = static_cast<int>((p.n + BM - 1) / BM);
  const int tiles_k = static_cast<int>((p.k + Tile128::BN - 1) / Tile128::BN);
  const int64_t per_group = static_cast<int64_t>(tiles_n) * tiles_k;
  const int64_t total = per_group * p.num_groups;
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int e = static_cast<int>(t / per_group);
    const int64_t local = t % per_group;
    const int64_t n0 = (local / tiles_k) * BM, k0 = (local % tiles_k) * Tile128::BN;
    const int64_t rows = group_rows(p.splits, p.offsets, e);
    if (rows == 0 && p.main_grad != nullptr) continue;  // accumulating nothing leaves main_grad unchanged
    float acc[64];
    if (rows > 0) {
      const int64_t r0 = p.offsets[e], red = (rows + kBlock - 1) / kBlock * kBlock;
      // Each tile's 128 columns of a column-wise copy are one strip of it (n0, k0: multiples of 128).
      static_assert(BM == kMxColwiseStrip && Tile128::BN == kMxColwiseStrip);
      const auto strip = [&](const uint8_t* data, int64_t col0, int64_t cols) {
        return data + mxfp8_colwise_offset(r0, col0, p.capacity_rows, cols);
      };
      const Operand a{strip(p.dy_t, n0, p.n), p.dy_t_scales + (r0 / kBlock) * p.n + n0, kBlock, p.n, p.n - n0,
                      mxfp8_colwise_block_bytes(n0, p.n)};
      const Operand b{strip(p.x_t, k0, p.k), p.x_t_scales + (r0 / kBlock) * p.k + k0, kBlock, p.k, p.k - k0,
                      mxfp8_colwise_block_bytes(k0, p.k)};
      mainloop<ScaleLayout::kBlockMajor, kPingPong>(smem, sf, a, b, red, p.dy_t, acc);
    } else {
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.0f;  // an empty group's gradient is zero
    }
    const int64_t out0 = static_cast<int64_t>(e) * p.n * p.k + n0 * p.k + k0;
    float* staging = reinterpret_cast<float*>(smem);
    cp_async_gemm::stage_accumulators<Tile128>(staging, acc);
    if (p.main_grad != nullptr) {
      cp_async_gemm::accumulate_main_grad<Tile128>(staging, p.main_grad + out0, p.k, p.n - n0, p.k - k0);
    } else {
      cp_async_gemm::for_each_chunk8<Tile128>(staging, [&](int row, int col, float (&v)[8]) {
        if (n0 + row < p.n && k0 + col < p.k) store8(dweight + out0 + row * p.k + col, v);
      });
    }
  }
}

}  // namespace moegraph::kernels::mxfp8_gemm
