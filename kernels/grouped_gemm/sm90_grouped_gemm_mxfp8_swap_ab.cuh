// MXFP8 ragged GEMM for groups of few rows (decode, fine-grained experts), fprop and dgrad, with the
// operands swapped: a tile computes C_e^T = B_e · A^T, so the expert's weight rows fill wgmma's M
// (64 per consumer warpgroup, 128 per tile) and the group's rows sit on its N, 32 at a time. A tile
// runs wgmma's N at the least multiple of 8 that covers its data rows, so a group of a handful of
// rows costs an m64n8 MMA and 4 accumulators per thread, not the m64n128 and 64 of the row-major
// kernel (sm90_grouped_gemm_mxfp8_cp_async.cuh), and every 32-deep block's promotion with them (the
// promotions bound this kernel, not the weight stream); the weights, which are nearly all the bytes,
// stream through a TMA producer several stages ahead.
//   fprop: y = x · W_e^T     A = x rows (scales along K), B = W_e [N][K]
//   dgrad: dx = dy · W_e     A = dy rows (scales along N), B = W_e^T [K][N]
// Per stage (128 reduction bytes): the B tile 128 x 128 and the A tile 32 x 128 by TMA (128-byte
// swizzle, what wgmma's K-major descriptors read); A's scales as fp32 (16 bytes a row:
// Mxfp8RaggedGemmParams::a_scale_floats, stage-major, so a stage's 32 rows are one 512-byte bulk
// copy); B's E8M0 scales (4 bytes a row) as one 512-byte bulk copy from their tiled copy
// (b_scales_tiled), or, without it, by 4-byte cp.async from the producer warp's lanes, which then
// also arrive on the stage's mbarrier. A's scales come as floats because each of a tile's rows is
// promoted by 64 consumer threads: decoding its bytes there cost each thread two instructions a row
// and block (docs/PERF.md, "MXFP8 swap-AB: A's scales as floats"); both come as whole copies because
// 160 scattered small copies a stage held each stage's turnaround (docs/PERF.md, "MXFP8 swap-AB:
// each stage's scales as two bulk copies"). Two CTAs per SM (one producer warp each, no idle
// producer warpgroup), so that while one CTA's consumers wait on an MMA or a scale conversion, the
// other's issue.
// Split reductions (the kSplit kernel): a launch with a quarter as many tiles as CTAs or fewer
// (decode: a token's few experts, such as two of 32 tiles each with reductions of 14336) would leave
// most SMs idle or with one ring of loads in flight, bound by the latency of those loads. There
// each tile's reduction is cut into `splits` ranges of whole stages, one per CTA (splits = CTAs /
// tiles, at least kMinSplits and kMinSplitStages stages each, decided on the device from the tiles
// that exist). Every split writes its fp32 accumulators to the scratch; the last of a tile's splits
// to arrive (a counter per tile, zeroed by the launch) sums them in split order (the same result
// whichever arrives last) and runs the epilogue. Two splits measured no faster than one CTA a tile
// once the launch zeroes the counters (docs/PERF.md), hence kMinSplits; the launcher takes the
// kernel without splits wherever the tiles may be more, whose code is the same as before splits.
// The deep-ring kernel (one CTA per SM) runs two pairs of consumer warpgroups that take the ring's
// stages in turn (pair q the stages s with s % 2 == q) and add their accumulators at the tile's end
// (pair 1's through shared memory, in that fixed order): with one CTA an SM, one pair left each
// scheduler two warps, whose per-stage chains (the barrier wait, the scale words, four MMAs and
// their promotions) issued on a third of the cycles (Nsight Compute, docs/PERF.md). Its launches
// give a CTA one tile at most, but the rings' positions and the two barriers also carry a CTA
// through several.
// Each 32-deep block is its own MMA into a fresh partial, promoted as
//     acc[m][r] += partial[m][r] * sb[m][kb] * sa[r][kb]
// with two partials alternating, so block kb's MMA runs while block kb-1 is promoted.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common/cp_async.cuh"
#include "kernels/common/ragged_tiles.cuh"
#include "kernels/grouped_gemm/grouped_gemm.hpp"
#include "kernels/grouped_gemm/sm90_tma.cuh"
#include "kernels/grouped_gemm/sm90_mxfp8_scales.cuh"
#include "kernels/grouped_gemm/sm90_wgmma_ops.cuh"
#include "kernels/quantize/mxfp8.hpp"

namespace moegraph::kernels::mxfp8_swap_ab {

constexpr int kBlock = 32;                      // elements per E8M0 scale
constexpr int BK = 128;                         // reduction bytes (= elements) per stage
constexpr int kBlocksPerStage = BK / kBlock;    // 4
constexpr int BM = 128;                         // weight rows (output columns) per tile
constexpr int BR = 32;                          // group rows per tile: wgmma's N
constexpr int STAGES = 4;
// A's scale floats and B's tiled scales are laid out in this kernel's stages and weight tiles
// (kernels/quantize/mxfp8.hpp: mxfp8_scale_float_index, launch_tile_mxfp8_scales).
static_assert(BK == kMxStageCols && kBlocksPerStage == kMxStageBlocks && BM == kMxTileRows,
              "the swap-AB stage and tile must be the scale layouts' stage and tile");
// The deep-ring kernel, one CTA per SM: for a launch with at most one tile per SM (a token's few
// experts, such as the decode preset's FC1 at one token: 132 tiles), where the second CTA of the
// two-CTA kernel idles and each SM streams its tile through one ring of STAGES. Measured on one
// H200 (docs/PERF.md, "Decode with few tiles"): that FC1 0.036 -> 0.028 ms with 8 stages; every
// launch with more tiles needs the two CTAs' interleaved promotions instead.
constexpr int kDeepStages = 8;
constexpr int kConsumerThreads = 256;           // a pair of consumer warpgroups, 64 weight rows each
constexpr int THREADS = kConsumerThreads + 32;  // and one producer warp after them
// Consumer pairs and threads of the kernel with a ring of `stages`: two pairs in the deep ring.
constexpr int pairs_of(int stages) { return stages == kDeepStages ? 2 : 1; }
constexpr int threads_of(int stages) { return pairs_of(stages) * kConsumerThreads + 32; }
constexpr int kCtasPerSm = 2;                   // two tiles' promotions interleave on every scheduler
constexpr int kTileBytesB = BM * BK;            // 16 KB of weights
constexpr int kTileBytesA = BR * BK;            // 4 KB of rows
constexpr int kScaleOffset = kTileBytesB + kTileBytesA;  // B's scale words, then A's scale floats
constexpr int kScaleFloatsOffset = kScaleOffset + BM * 4;   // a float4 a group row: its 4 blocks' scales
constexpr int kStageBytes = (kScaleFloatsOffset + BR * 16 + 1023) / 1024 * 1024;  // tiles stay 1024-aligned
constexpr int smem_bytes(int stages) { return stages * kStageBytes + 1024; }
constexpr int kSmemBytes = smem_bytes(STAGES);
constexpr int kTxBytes = kTileBytesB + kTileBytesA;  // what the TMA boxes bring per stage
// Split reductions (mxfp8_swap_ab_split_bytes sizes their scratch on the host).
constexpr int kSplitItemsCap = 264;    // items (a tile's split) at most: two CTAs on each of 132 SMs
constexpr int kMinSplitStages = 4;     // a split fills the ring once at least
constexpr int kMinSplits = 4;          // fewer: one CTA a tile
constexpr int kPartialFloats = 4 * (BR / 8);  // a consumer thread's accumulators, J = 4

struct Params {
  Mxfp8RaggedGemmParams p;
  CUtensorMap a;  // rows [capacity_rows, red] e4m3, box 32 rows x 128 bytes
  CUtensorMap b;  // weights [G, cols, red] e4m3, box 128 rows x 128 bytes
  // The kSplit kernel's scratch: [kSplitItemsCap][kConsumerThreads][kPartialFloats] accumulators
  // and one counter per tile, zero at the launch.
  float* split_partials = nullptr;
  unsigned* split_counters = nullptr;
};

// How many ranges each tile's reduction is cut into: as many as keep every CTA busy, each of
// kMinSplitStages stages at least; 1 where that is under kMinSplits.
__device__ __forceinline__ int split_count(int64_t tiles, int ktiles) {
  if (tiles == 0) return 1;
  const int64_t by_ctas = min(static_cast<int64_t>(gridDim.x), static_cast<int64_t>(kSplitItemsCap)) / tiles;
  const int64_t splits = min(by_ctas, static_cast<int64_t>(ktiles / kMinSplitStages));
  return splits >= kMinSplits ? static_cast<int>(splits) : 1;
}

// Item i of a launch: split i % splits of tile i / splits, over stages [kt0, kt1).
struct Item {
  int64_t tile;
  int split, kt0, kt1;
};
__device__ __forceinline__ Item item_of(int64_t i, int splits, int ktiles) {
  Item it;
  it.tile = i / splits;
  it.split = static_cast<int>(i % splits);
  it.kt0 = it.split * ktiles / splits;
  it.kt1 = (it.split + 1) * ktiles / splits;
  return it;
}

// Virtual tile t: a row tile (a group's rows, 32 at a time) and a weight tile of the same group. The
// tile prefix counts row tiles, so group g owns tiles [prefix[g], prefix[g + 1]) * tiles_n; within
// them the row tile runs fastest, so the CTAs working at one time share weight tiles (16 KB a stage)
// through L2 and re-read only row tiles (4 KB a stage). For groups of many rows that lifts the L2 hit
// rate to 85% (fine64_k2048_n2048, 500 rows) and took 40-80-row groups under skew 3-9% faster
// (docs/PERF.md); a group of one row tile is walked as before.
struct Tile {
  RaggedTile rows;
  int64_t n0;
};
__device__ __forceinline__ Tile locate(int64_t t, const int* prefix, const Mxfp8RaggedGemmParams& p, int tiles_n) {
  const int group = find_group(prefix, p.num_groups, static_cast<int>(t / tiles_n));
  const int row_tiles = prefix[group + 1] - prefix[group];  // >= 1: find_group skips empty groups
  const int64_t local = t - static_cast<int64_t>(prefix[group]) * tiles_n;
  Tile tile;
  tile.rows = ragged_tile_of_group<BR>(p.splits, p.offsets, group, static_cast<int>(local % row_tiles));
  tile.n0 = local / row_tiles * BM;
  return tile;
}

// The producer warp: lane 0 issues every stage's two boxes and its two scale copies (A's floats of
// the tile's rows up to capacity_rows; B's words from the tiled copy). Without the tiled copy, every
// lane copies 4 weight rows' scale words (rows past the tensor read as zeros) and arrives on the
// stage's barrier when they land (the barrier then counts 33 arrivals: kernel).
template <int kStages>
__device__ __forceinline__ void produce(const Params& tp, uint8_t* smem, uint64_t* full, uint64_t* empty,
                                       const int* prefix, int64_t items, int tiles_n, int ktiles, int splits) {
  const Mxfp8RaggedGemmParams& p = tp.p;
  const int lane = threadIdx.x - pairs_of(kStages) * kConsumerThreads;
  const int64_t red = p.k, cols = p.n, scale_ld = red / kBlock;
  const bool tiled = p.b_scales_tiled != nullptr;
  if (lane == 0) sm90::prefetch_tensor_map(&tp.a), sm90::prefetch_tensor_map(&tp.b);
  int stage = 0;
  uint32_t phase = 0;
  for (int64_t i = blockIdx.x; i < items; i += gridDim.x) {
    const Item it = item_of(i, splits, ktiles);
    const Tile tile = locate(it.tile, prefix, p, tiles_n);
    const int64_t b_row0 = static_cast<int64_t>(tile.rows.group) * cols + tile.n0;
    // The tile's first stage of B's tiled words (mxfp8_tiled_scale_bytes: tiles_n tiles a group).
    const uint8_t* b_tiled =
        tiled ? p.b_scales_tiled + (static_cast<int64_t>(tile.rows.group) * tiles_n + tile.n0 / BM) * ktiles * (BM * 4)
              : nullptr;
    const int64_t a_rows = min(p.capacity_rows - tile.rows.row0, static_cast<int64_t>(BR));  // >= 1
    const uint32_t a_bytes = static_cast<uint32_t>(a_rows) * 16;
    for (int kt = it.kt0; kt < it.kt1; ++kt) {
      sm90::mbar_wait(&empty[stage], phase ^ 1);
      uint8_t* s = smem + stage * kStageBytes;
      uint64_t* bar = &full[stage];
      if (lane == 0) {
        sm90::mbar_arrive_expect_tx(bar, kTxBytes + a_bytes + (tiled ? BM * 4 : 0));
        sm90::tma_load_3d(s, &tp.b, bar, kt * BK, static_cast<int>(tile.n0), tile.rows.group);
        sm90::tma_load_2d(s + kTileBytesB, &tp.a, bar, kt * BK, static_cast<int>(tile.rows.row0));
        sm90::bulk_load(s + kScaleFloatsOffset,
                        p.a_scale_floats + (kt * p.capacity_rows + tile.rows.row0) * kBlocksPerStage, a_bytes, bar);
        if (tiled) sm90::bulk_load(s + kScaleOffset, b_tiled + kt * (BM * 4), BM * 4, bar);
      }
      if (!tiled) {
        uint8_t* scales = s + kScaleOffset;
#pragma unroll
        for (int i = 0; i < BM / 32; ++i) {
          const int row = lane + 32 * i;
          const bool valid = tile.n0 + row < cols;
          cp_async_4(scales + row * 4,
                     valid ? p.b_scales + (b_row0 + row) * scale_ld + kt * kBlocksPerStage : p.b_scales, valid);
        }
        cp_async_arrive_noinc(bar);
      }
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
  }
}

// Whether every byte of every word lies in [64, 190]: then none is 0 (a subnormal scale) or 0xFF
// (NaN), so each scale is the fp32 whose exponent field is its byte. (The bound also keeps the
// product of two such scales normal, which promotions formed by adding exponent fields once needed.)
// Per byte, without carries between bytes: b >= 64 when bit 6 or 7 is set; b <= 190 when b + 65
// does not carry out of the byte. The words are folded with and/or first and tested once (about 5
// instructions a word, no branches).
template <int N>
__device__ __forceinline__ bool scale_bytes_mid(const uint32_t (&w)[N]) {
  uint32_t at_least_64 = 0xffffffffu, over_190 = 0u;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    at_least_64 &= w[i] | (w[i] << 1);
    over_190 |= w[i] & ((w[i] & 0x7f7f7f7fu) + 0x41414141u);
  }
  return (at_least_64 & 0x80808080u) == 0x80808080u && (over_190 & 0x80808080u) == 0u;
}

// E8M0 byte kb of w, shifted into an fp32's exponent field (kb a compile-time constant after unrolling).
__device__ __forceinline__ uint32_t exponent_field(uint32_t w, int kb) {
  return (kb < 3 ? w << (23 - 8 * kb) : w >> 1) & 0x7f800000u;
}

// A's scales of blocks 2h and 2h + 1 of the stage for this thread's group rows (r = 8j + 2(lane % 4) + c
// at fa[2j + c]). Half a stage at a time: the kernel runs at 96 registers (5 warps of 288-thread CTAs
// on a scheduler), and the whole stage's 8J floats held at once spilled 80-108 bytes; halves spill
// 16-24 bytes (ptxas) and measured faster than a block at a time from 24 rows a tile, the same below
// (docs/PERF.md, "MXFP8 swap-AB: each stage's scales as two bulk copies").
static_assert(kBlocksPerStage == 4, "a stage's A scales are loaded as two halves of two blocks");
template <int J>
__device__ __forceinline__ void load_scale_half(float2 (&fa)[2 * J], const float2* floats, int lane, int h) {
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) fa[2 * j + c] = floats[2 * (8 * j + 2 * (lane % 4) + c) + h];
}

// B's scales of the stage's blocks for this thread's 2 weight rows, as fp32: fb[2kb + h] for block kb
// and row m_h. When both words are mid-range (scale_bytes_mid) a scale is its byte shifted into an
// fp32's exponent field; otherwise it is decoded (0 and 0xFF included). Threads decide on their own
// words, so a warpgroup's threads may take different sides: the branch holds no collective
// instruction (wgmma is .aligned: the whole warpgroup must execute the same one), and the stage's
// MMAs and promotions after it are one path for all.
__device__ __forceinline__ void stage_b_scales(float (&fb)[2 * kBlocksPerStage], const uint32_t (&wb)[2]) {
  if (scale_bytes_mid(wb)) {
#pragma unroll
    for (int kb = 0; kb < kBlocksPerStage; ++kb)
#pragma unroll
      for (int h = 0; h < 2; ++h) fb[2 * kb + h] = __uint_as_float(exponent_field(wb[h], kb));
  } else {
#pragma unroll
    for (int kb = 0; kb < kBlocksPerStage; ++kb)
#pragma unroll
      for (int h = 0; h < 2; ++h) fb[2 * kb + h] = e8m0_to_float((wb[h] >> (8 * kb)) & 0xffu);
  }
}

// acc[4j + 2h + c] (weight row m_h = this thread's 2 rows, group row r = 8j + 2(lane % 4) + c, j < J) +=
// partial * (sa[r][kb] * sb[m_h][kb]), with A's scales as floats (fa[2j + c]: the row's half holding kb) and
// B's from stage_b_scales (fb: both rows' of block kb). The product of two powers of two is exact
// wherever it is a normal fp32, and either way it is the one multiplication the decoded scales would
// take, so both sides of stage_b_scales give the same result.
template <int J>
__device__ __forceinline__ void promote(float (&acc)[4 * J], const float (&partial)[4 * J], const float* fb,
                                        const float2 (&fa)[2 * J], int kb) {
#pragma unroll
  for (int j = 0; j < J; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const float a = kb % 2 == 0 ? fa[2 * j + c].x : fa[2 * j + c].y;
      acc[4 * j + c] = fmaf(partial[4 * j + c], a * fb[0], acc[4 * j + c]);
      acc[4 * j + 2 + c] = fmaf(partial[4 * j + 2 + c], a * fb[1], acc[4 * j + 2 + c]);
    }
  }
}

// One 32-deep block kb of the stage as an m64n(8J)k32 MMA into `partial`: only the tile's first 8J
// group rows take part. w_lo, r_lo: the low descriptor words of the stage's weight rows (this
// warpgroup's 64) and group rows (sm90::kmajor_sw128_desc_lo); a block is 32 bytes further along K.
template <int J>
__device__ __forceinline__ void mma_block(float (&partial)[4 * J], uint32_t w_lo, uint32_t r_lo, int kb) {
  sm90::fence_registers(partial);
  sm90::wgmma_fence();
  sm90::Wgmma<__nv_fp8_e4m3, 8 * J>::template mma<0, 0>(partial,
                                                        sm90::desc_of(w_lo + 2 * kb, sm90::kKmajorSw128DescHi),
                                                        sm90::desc_of(r_lo + 2 * kb, sm90::kKmajorSw128DescHi), 0);
  sm90::wgmma_commit();
}

// One stage's four blocks: each block's MMA into one of two partials while the previous block's is
// promoted; releases the stage once its MMAs are done. B's scales are decoded once a stage
// (stage_b_scales), so that the blocks run without branches (a decision per block cost a branch and
// its reconvergence each: docs/PERF.md, "MXFP8 swap-AB: a leaner consumer loop").
template <int J>
__device__ __forceinline__ void consume_stage(float (&acc)[4 * J], float (&partial)[2][4 * J], const uint32_t (&wb)[2],
                                              const float2* floats, int lane, uint32_t w_lo, uint32_t r_lo,
                                              uint64_t* empty) {
  float fb[2 * kBlocksPerStage];
  stage_b_scales(fb, wb);
  float2 fa[2 * J];
  load_scale_half<J>(fa, floats, lane, 0);
  mma_block<J>(partial[0], w_lo, r_lo, 0);
#pragma unroll
  for (int kb = 1; kb < kBlocksPerStage; ++kb) {
    mma_block<J>(partial[kb & 1], w_lo, r_lo, kb);
    sm90::wgmma_wait<1>();  // block kb-1 is done
    sm90::fence_registers(partial[(kb - 1) & 1]);
    if (kb - 1 == 2) load_scale_half<J>(fa, floats, lane, 1);  // blocks 2 and 3
    promote<J>(acc, partial[(kb - 1) & 1], fb + 2 * (kb - 1), fa, kb - 1);
  }
  sm90::wgmma_wait<0>();
  sm90::fence_registers(partial[(kBlocksPerStage - 1) & 1]);
  sm90::mbar_arrive(empty);  // the stage's MMAs are done and its scale words are in registers
  promote<J>(acc, partial[(kBlocksPerStage - 1) & 1], fb + 2 * (kBlocksPerStage - 1), fa, kBlocksPerStage - 1);
}

// What a consumer thread needs of its place in the tile.
struct Consumer {
  int wg, lane, m_local;  // wg: 0 or 1 within the pair; m_local: this thread's weight rows are m_local and m_local + 8
  int pair, tid;          // the pair (0 or 1) and the thread's index within it
};

// A split's end: its accumulators go to the scratch (slot `item`, 4J floats a thread), and the last
// split of the tile to arrive sums every split's, in split order, into acc. Returns whether this CTA
// was that last one. The fences make the other CTAs' stores visible before the counter says they are
// done (the classic last-block reduction); the partials are read through L2 (ld.global.cg), since
// this SM's L1 may hold stale lines of the scratch from an earlier launch.
template <int J>
__device__ __forceinline__ bool reduce_split(float (&acc)[4 * J], const Params& tp, int64_t item, int splits,
                                             int* last) {
  constexpr int kSlotFloats = kConsumerThreads * kPartialFloats;
  const int tid = threadIdx.x;  // a consumer thread: < kConsumerThreads
  const int64_t tile = item / splits;
  float4* mine = reinterpret_cast<float4*>(tp.split_partials + item * kSlotFloats + tid * kPartialFloats);
#pragma unroll
  for (int j = 0; j < J; ++j) mine[j] = make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
  __threadfence();
  sm90::named_barrier(1, kConsumerThreads);
  if (tid == 0) *last = atomicAdd(&tp.split_counters[tile], 1u) == static_cast<unsigned>(splits - 1);
  sm90::named_barrier(1, kConsumerThreads);
  if (*last == 0) return false;
  __threadfence();
#pragma unroll
  for (int i = 0; i < 4 * J; ++i) acc[i] = 0.0f;
  const float* first = tp.split_partials + tile * splits * kSlotFloats + tid * kPartialFloats;
  for (int q = 0; q < splits; ++q) {
    const float4* theirs = reinterpret_cast<const float4*>(first + q * kSlotFloats);
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const float4 v = __ldcg(theirs + j);
      acc[4 * j] += v.x, acc[4 * j + 1] += v.y, acc[4 * j + 2] += v.z, acc[4 * j + 3] += v.w;
    }
  }
  return true;
}

// One tile on a consumer thread, with wgmma's N = 8J: the tile's data rows all lie below 8J (the
// caller picks the least J that covers them), so the MMAs and promotions of a group of a few rows do
// not pay for 32. The A box still brings 32 rows; wgmma reads the first 8J of them (whole 1024-byte
// swizzle atoms of 8 rows). Writes C[row0 + r][n0 + m] for r < span_rows: data rows from the
// accumulators, alignment gap rows as zero; columns past `cols` are left alone.
template <int J, class T, int kStages>
__device__ __forceinline__ void consume_tile(const Tile& tile, const Params& tp, int64_t item, int splits,
                                             int stages, const Consumer& me, const uint8_t* smem, uint64_t* full,
                                             uint64_t* empty, int* last, float4* pair_sums, int& stage,
                                             uint32_t& phase) {
  const Mxfp8RaggedGemmParams& p = tp.p;
  const int64_t cols = p.n;
  float acc[4 * J];
#pragma unroll
  for (int i = 0; i < 4 * J; ++i) acc[i] = 0.0f;
  float partial[2][4 * J];
  constexpr int kPairs = pairs_of(kStages);
  static_assert(kPairs == 1 || kStages % 2 == 0, "the pairs take the ring's even and odd stages");
  // Stage 0's descriptor words; stage s's are (s * kStageBytes) >> 4 further.
  const uint32_t stage0 = sm90::smem_addr(smem);
  const uint32_t w_lo0 = sm90::kmajor_sw128_desc_lo(stage0 + me.wg * (kTileBytesB / 2));
  const uint32_t r_lo0 = sm90::kmajor_sw128_desc_lo(stage0 + kTileBytesB);
  static_assert(kStageBytes % 16 == 0, "stages step the descriptors' address field");
  for (; stages > 0; --stages) {
    if (kPairs == 2 && (stage & 1) != me.pair) {  // the other pair's stage
      if (++stage == kStages) stage = 0, phase ^= 1;
      continue;
    }
    sm90::mbar_wait(&full[stage], phase);
    const uint8_t* s = smem + stage * kStageBytes;
    const uint32_t* scales = reinterpret_cast<const uint32_t*>(s + kScaleOffset);
    // Weight rows past `cols` read padding: scales of 1 from the tiled copy, zero fill from the
    // gathered words (which sends their threads down the decoding path; their results are never stored).
    uint32_t wb[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) wb[h] = scales[me.m_local + 8 * h];
    // Group rows past the data read whatever floats the stage holds: their results are never stored.
    const float2* floats = reinterpret_cast<const float2*>(s + kScaleFloatsOffset);
    const uint32_t step = static_cast<uint32_t>(stage) * (kStageBytes >> 4);
    consume_stage<J>(acc, partial, wb, floats, me.lane, w_lo0 + step, r_lo0 + step, &empty[stage]);
    if (++stage == kStages) stage = 0, phase ^= 1;
  }
  if (splits > 1 && !reduce_split<J>(acc, tp, item, splits, last)) return;  // another split writes C
  if constexpr (kPairs == 2) {  // pair 1's sums to pair 0, which writes C
#pragma unroll
    for (int j = 0; j < J; ++j)
      if (me.pair == 1)
        pair_sums[j * kConsumerThreads + me.tid] =
            make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
    sm90::named_barrier(2, 2 * kConsumerThreads);
    if (me.pair == 0) {
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const float4 v = pair_sums[j * kConsumerThreads + me.tid];
        acc[4 * j] += v.x, acc[4 * j + 1] += v.y, acc[4 * j + 2] += v.z, acc[4 * j + 3] += v.w;
      }
    }
    sm90::named_barrier(3, 2 * kConsumerThreads);  // read before pair 1 writes the next tile's
    if (me.pair == 1) return;
  }
  // Epilogue: this thread holds C[row0 + r][n0 + m] for its 2 weight rows m and the group rows r < 8J.
  const RaggedTile& rt = tile.rows;
  const T* bias_all = static_cast<const T*>(p.bias);
  const T* b = bias_all != nullptr ? bias_all + static_cast<int64_t>(rt.group) * cols + tile.n0 : nullptr;
  T* c_all = static_cast<T*>(p.c);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = me.m_local + 8 * h;
    if (tile.n0 + m >= cols) continue;
    const float bm = b != nullptr ? static_cast<float>(b[m]) : 0.0f;
#pragma unroll
    for (int j = 0; j < BR / 8; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int r = 8 * j + 2 * (me.lane % 4) + c;
        if (r >= rt.span_rows) continue;
        float v = 0.0f;  // alignment gap rows read as zero downstream
        if (j < J && r < rt.data_rows) {
          const float s = b != nullptr && p.bias_scale != nullptr ? p.bias_scale[rt.row0 + r] : 1.0f;
          v = acc[(j < J ? 4 * j : 0) + 2 * h + c] + s * bm;
        }
        c_all[(rt.row0 + r) * cols + tile.n0 + m] = static_cast<T>(v);
      }
  }
}

// C[r, n] for the rows of group e: tiles of 128 output columns x 32 rows; gap rows written as zero,
// rows past the group's span and columns past `cols` left alone.
// kStages: STAGES with two CTAs per SM, or kDeepStages with one.
template <class T, bool kSplit, int kStages>
__global__ void __launch_bounds__(threads_of(kStages), kStages == STAGES ? kCtasPerSm : 1)
    ragged_gemm_kernel(const __grid_constant__ Params tp) {
  constexpr int kThreads = threads_of(kStages), kPairs = pairs_of(kStages);
  static_assert(!(kSplit && kPairs == 2), "the split kernel has one consumer pair");
  extern __shared__ uint8_t smem_raw[];
  __shared__ int tile_prefix[kMaxGroups + 1];
  __shared__ int warp_sums[kThreads / 32];
  __shared__ float4 pair_sums[kPairs == 2 ? kPartialFloats / 4 * kConsumerThreads : 1];  // pair 1's sums
  __shared__ alignas(8) uint64_t full[kStages], empty[kStages];
  __shared__ int last_split;  // reduce_split: whether this CTA sums the tile
  uint8_t* smem = sm90::aligned_smem(smem_raw);
  const Mxfp8RaggedGemmParams& p = tp.p;
  // full: lane 0's arrive.expect_tx, and without B's tiled scales the 32 lanes' scale copies; empty:
  // the threads of the one pair that consumes the stage (with two pairs, the pair stage % 2)
  sm90::init_stage_barriers<kStages>(full, p.b_scales_tiled != nullptr ? 1 : 1 + 32, empty, kConsumerThreads);
  // ends in a barrier
  build_tile_prefix<kThreads, BR, true>(p.splits, p.offsets, p.num_groups, tile_prefix, warp_sums);
  const int tiles_n = static_cast<int>((p.n + BM - 1) / BM);
  const int64_t total = static_cast<int64_t>(tile_prefix[p.num_groups]) * tiles_n;
  const int ktiles = static_cast<int>(p.k / BK);
  const int splits = kSplit ? split_count(total, ktiles) : 1;
  const int64_t items = total * splits;

  if (threadIdx.x >= kPairs * kConsumerThreads)
    return produce<kStages>(tp, smem, full, empty, tile_prefix, items, tiles_n, ktiles, splits);
  Consumer me;
  // The pair and warpgroup through a shuffle, so that the compiler knows them to be the same across
  // the warp (the J = 4 loop of the two-CTA kernel: 273 -> 263 instructions a stage in the SASS).
  me.pair = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / kConsumerThreads), 0);
  me.tid = threadIdx.x % kConsumerThreads;
  me.wg = __shfl_sync(0xffffffffu, me.tid / 128, 0), me.lane = threadIdx.x % 32;
  me.m_local = me.wg * 64 + ((me.tid % 128) / 32) * 16 + me.lane / 4;
  int stage = 0;
  uint32_t phase = 0;
  for (int64_t i = blockIdx.x; i < items; i += gridDim.x) {
    const Item it = item_of(i, splits, ktiles);
    const Tile tile = locate(it.tile, tile_prefix, p, tiles_n);
    // The same for every thread of the CTA, so the warpgroups' wgmma shapes agree.
    const int64_t rows = tile.rows.data_rows;
    const int stages = it.kt1 - it.kt0;
    int* last = &last_split;
    const auto consume = [&](auto j) {  // j: std::integral_constant, wgmma's N / 8
      consume_tile<decltype(j)::value, T, kStages>(tile, tp, i, splits, stages, me, smem, full, empty, last,
                                                   pair_sums, stage, phase);
    };
    if (rows <= 8) consume(std::integral_constant<int, 1>{});
    else if (rows <= 16) consume(std::integral_constant<int, 2>{});
    else if (rows <= 24) consume(std::integral_constant<int, 3>{});
    else consume(std::integral_constant<int, 4>{});
  }
}

}  // namespace moegraph::kernels::mxfp8_swap_ab
