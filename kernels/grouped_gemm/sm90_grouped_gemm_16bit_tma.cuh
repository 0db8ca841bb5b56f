// Warp-specialized grouped GEMMs on Hopper (sm_90a): one producer thread drives the copy engine (TMA)
// into a ring of shared-memory stages guarded by mbarriers, and two consumer warpgroups issue wgmma
// from those stages. By default they share each 128 x BN tile (64 rows each) and never wait on each
// other; the ping-pong wgrad kernel instead gives whole tiles to one warpgroup at a time, a token on
// named barriers ordering their mainloops, so one's epilogue runs under the other's MMAs. The ring
// runs across tiles (persistent grid, tiles scheduled from the device offsets), so the producer
// fetches the next tile's operands while the consumers run the epilogue. Results go through a
// shared-memory staging area to the copy engine and drain while the next tile computes: fprop and
// dgrad blocks of 64 rows wholly inside their group as tensor stores of swizzled 64 x 128-byte
// boxes, the block at a group's end one bulk copy per row (so rows of other groups are never
// touched); wgrad tiles, whose edges are the weight's own, as boxes, and fp32 main_grad as boxes
// loaded, added to and stored back: in two halves of columns after the tile's MMAs, or (ping-pong)
// in quarters that a streaming thread loads ahead of the consumers. Tiles land in the same
// 128-byte-swizzled layouts as the cp.async kernels (sm90_grouped_gemm_16bit_cp_async.cuh), so the
// wgmma descriptors are shared.
//   fprop: y = x · W_e^T      A = x  (K-major box)       B = W_e (K-major box [BN][64])
//   dgrad: dx = dy · W_e      A = dy (K-major box)       B = W_e (MN-major boxes [64 N][64 K])
//   wgrad: dW_e = dy_e^T x_e  A = dy (MN-major boxes)    B = x   (MN-major boxes), over the group's rows
// Ragged rows need no masks in the loads: a row tile that runs into the next group multiplies rows
// whose outputs are never stored, and past capacity the copy engine reads zeros; a 64-row block
// with no data rows is neither loaded nor multiplied (pass_stages). Only wgrad, whose reduction
// runs over the group's rows, zeroes the rows past the group in its last stage.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common/ragged_tiles.cuh"
#include "kernels/grouped_gemm/grouped_gemm.hpp"
#include "kernels/grouped_gemm/sm90_tma.cuh"
#include "kernels/grouped_gemm/sm90_wgmma_ops.cuh"

namespace moegraph::kernels::tma_gemm {

constexpr int BM = 128, BK = 64;                      // BK * 2 bytes = one 128-byte swizzle row
constexpr int kConsumerThreads = 256, THREADS = 384;  // warpgroup 0: producer; 1, 2: consumers
constexpr int kTileBytesA = BM * BK * 2;
constexpr int kAtomBytes = 64 * BK * 2;  // 64 MN x 64 K: one MN-major box, or a warpgroup's K-major rows
constexpr int kRasterM = 16;             // most row tiles walked together (L2 reuse of both operands)
constexpr int kProducerRegs = 40, kConsumerRegs = 232;

// (BLOCK_M, BLOCK_N) x BLOCK_K = (128, kBN) x 64, one CTA per SM, plus kStagings (128, kBN) 16-bit
// output staging areas (one per warpgroup that owns whole tiles), whose rows are padded by 16 bytes so
// a warp's 8 rows x 4 words hit 32 distinct banks.
template <int kBN, int kStages, int kStagings = 1>
struct TileShape {
  static constexpr int BN = kBN, STAGES = kStages, STAGINGS = kStagings;
  static constexpr int kTileBytesB = BN * BK * 2;
  static constexpr int kStageBytes = kTileBytesA + kTileBytesB;
  static constexpr int kStagingLd = BN * 2 + 16;  // bytes per staged row
  static constexpr int kStagingBytes = BM * kStagingLd;
  static constexpr int kSmemBytes = STAGES * kStageBytes + STAGINGS * kStagingBytes + 1024;  // + align slack
  static_assert(kSmemBytes + 5 * 1024 <= 227 * 1024, "with the static tile prefix and barriers");
};
using Tile128 = TileShape<128, 5>;
using Tile256 = TileShape<256, 3>;

// Boxed staging for tensor stores: the copy engine's boxes of 64 rows x 128 bytes, 128-byte swizzled
// (16-byte chunk c of row r at chunk c ^ (r % 8), so a warp's 8 rows x 4 words of accumulator pairs
// hit 32 distinct banks), box (64-row block, column box cb) at (block * boxes_per_row + cb) * 8 KB.
constexpr int kBoxRows = 64, kBoxBytes = kBoxRows * 128;

// wgrad with ping-pong consumers: each warpgroup owns whole 128 x 128 tiles and, into dW, its own
// staging. Into fp32 main_grad there are no stagings: the results pass through a ring of kResults
// buffers of a quarter tile (128 x 32 floats: two boxes) that a streaming thread fills with main_grad
// ahead of the consumers and stores from (grouped_wgrad_pingpong_main_grad_kernel). Its shared memory
// goes to 5 operand stages and 4 buffers (a tile's main_grad read ahead): 2-8% faster than 4 and 6 on
// groups of 64-500 rows, and 3 and 8 were up to 14% slower (docs/PERF.md): the operand ring matters more.
using TilePingPong = TileShape<128, 4, 2>;
struct TilePingPongMainGrad : TileShape<128, 5, 0> {
  static constexpr int kResults = 4, kResultBytes = 2 * kBoxBytes;
  static constexpr int kSmemBytes = STAGES * kStageBytes + kResults * kResultBytes + 1024;  // + align slack
  static_assert(kSmemBytes + 1024 <= 227 * 1024, "with the barriers");
};

// Kernel parameters: the tensor maps live in parameter space (__grid_constant__) for the copy engine.
struct RaggedTmaParams {
  CUtensorMap a;  // [capacity_rows, red] 2-D, box {64, 64}: a 64-row block
  CUtensorMap b;  // W as [G][N][K] 3-D; fprop box {64, BN, 1}, dgrad box {64, 64, 1}
  CUtensorMap c;  // the output [capacity_rows, cols] 2-D, box {64, 64} (store_ragged_block)
  RaggedGemmParams p;
};
struct WgradTmaParams {
  CUtensorMap dy;  // [capacity_rows, N] 2-D, box {64, 64}
  CUtensorMap x;   // [capacity_rows, K] 2-D, box {64, 64}
  CUtensorMap out; // dW [G][N][K] 3-D, box {64, 64, 1}; or fp32 main_grad, box {32, 64, 1}
  WgradParams p;
};

// Position in the ring, advanced identically by the producer and the consumers.
struct RingPos {
  int stage = 0;
  uint32_t phase = 0;
  template <int kStages>
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) stage = 0, phase ^= 1;
  }
  // Past n positions that another warpgroup consumes (the phase flips at every wrap).
  template <int kStages>
  __device__ __forceinline__ void skip(int n) {
    const int at = stage + n;
    phase ^= (at / kStages) & 1;
    stage = at % kStages;
  }
};

// `releasers`: the consumer threads that arrive on a stage's empty barrier once its MMAs are done
// (both warpgroups when they share tiles, the owner's 128 threads with ping-pong consumers).
// `loaded`, when given: the two consumer warpgroups' epilogue barriers (EpilogueLoad).
template <class Tile>
__device__ __forceinline__ void init_ring(uint64_t* full, uint64_t* empty, uint32_t releasers = kConsumerThreads,
                                          uint64_t* loaded = nullptr) {
  if (threadIdx.x == 0 && loaded != nullptr) sm90::mbar_init(&loaded[0], 1), sm90::mbar_init(&loaded[1], 1);
  sm90::init_stage_barriers<Tile::STAGES>(full, 1, empty, releasers);  // full: the producer's arrive.expect_tx
}

// Row tile mt and column tile nt of virtual tile t. Tiles go group by group (each group's row tiles
// are prefix[e] .. prefix[e + 1]); a group's row tiles are cut into bands of at most kRasterM, as
// even as possible, and a band is walked column tile by column tile. The CTAs running together then
// share a band's A rows and each weight column tile, so an expert's weights are streamed from
// memory once per band (once for an expert of up to kRasterM row tiles, however the routing falls)
// and never for a band that straddles two experts.
__device__ __forceinline__ void raster(int64_t t, const int* prefix, int num_groups, int tiles_n, int& mt, int& nt) {
  const int e = find_group(prefix, num_groups, static_cast<int>(t / tiles_n));
  const int h = prefix[e + 1] - prefix[e];              // the group's row tiles
  const int local_row = static_cast<int>(t / tiles_n) - prefix[e];  // whose band holds virtual tile t
  const int bands = (h + kRasterM - 1) / kRasterM;
  const int base = h / bands, extra = h % bands;        // `extra` bands of base + 1 rows, then base
  const int band = local_row < extra * (base + 1) ? local_row / (base + 1) : extra + (local_row - extra * (base + 1)) / base;
  const int band_row0 = band * base + min(band, extra), band_rows = base + (band < extra ? 1 : 0);
  const int64_t rem = t - (static_cast<int64_t>(prefix[e]) + band_row0) * tiles_n;
  mt = prefix[e] + band_row0 + static_cast<int>(rem % band_rows);
  nt = static_cast<int>(rem / band_rows);
}

template <bool kMnMajor>
__device__ __forceinline__ uint64_t tile_desc(uint32_t addr) {
  return kMnMajor ? sm90::mnmajor_sw128_desc(addr, kAtomBytes) : sm90::kmajor_sw128_desc(addr);
}
template <bool kMnMajor>
__device__ __forceinline__ constexpr uint32_t kstep_bytes() { return kMnMajor ? 2048 : 32; }  // 16 K-elements

// A warpgroup's accumulators: kBlocks blocks of 64 tile rows (1 when the two consumer warpgroups share
// a tile, 2 when one owns it), each a m64nBNk16 accumulator of BN / 2 registers per thread.
template <class Tile, int kBlocks>
using Acc = float[kBlocks][Tile::BN / 2];

template <class Tile, int kBlocks>
__device__ __forceinline__ void zero_acc(Acc<Tile, kBlocks>& acc) {
#pragma unroll
  for (int b = 0; b < kBlocks; ++b)
#pragma unroll
    for (int i = 0; i < Tile::BN / 2; ++i) acc[b][i] = 0.0f;
}

// The consumers' K loop over `ktiles` stages of the ring: acc[b] = A(64-row block a_block0 + b) · B.
// `zero_tail(stage)` may rewrite the last stage before its MMAs (wgrad's rows past the group).
template <class T, class Tile, bool kAMn, bool kBMn, int kBlocks, class ZeroTail>
__device__ __forceinline__ void consume(uint8_t* smem, uint64_t* full, uint64_t* empty, RingPos& pos, int ktiles,
                                        int a_block0, Acc<Tile, kBlocks>& acc, ZeroTail zero_tail) {
  int prev = -1;
  // The first MMA ignores acc (scale-d = 0), but the compiler sees the asm read it: zeroing ends the
  // previous tile's accumulators' lives here, so they are not kept (spilled) across its epilogue.
  zero_acc<Tile, kBlocks>(acc);
  for (int kt = 0; kt < ktiles; ++kt) {
    sm90::mbar_wait(&full[pos.stage], pos.phase);
    uint8_t* stage = smem + pos.stage * Tile::kStageBytes;
    if (kt == ktiles - 1) zero_tail(stage);
    const uint32_t a_addr = sm90::smem_addr(stage + a_block0 * kAtomBytes);
    const uint32_t b_addr = sm90::smem_addr(stage + kTileBytesA);
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) sm90::fence_registers(acc[b]);
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk)
#pragma unroll
      for (int b = 0; b < kBlocks; ++b)
        sm90::Wgmma<T, Tile::BN>::template mma<kAMn, kBMn>(
            acc[b], tile_desc<kAMn>(a_addr + b * kAtomBytes + kk * kstep_bytes<kAMn>()),
            tile_desc<kBMn>(b_addr + kk * kstep_bytes<kBMn>()), kt > 0 || kk > 0);
    sm90::wgmma_commit();
    sm90::wgmma_wait<1>();  // the MMAs of the previous stage are done: release it to the producer
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) sm90::fence_registers(acc[b]);
    if (prev >= 0) sm90::mbar_arrive(&empty[prev]);
    prev = pos.stage;
    pos.template advance<Tile::STAGES>();
  }
  sm90::wgmma_wait<0>();
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) sm90::fence_registers(acc[b]);
  if (prev >= 0) sm90::mbar_arrive(&empty[prev]);
}

// Whether 64-row block `block` of a row tile holds data rows: its consumer warpgroup multiplies it
// and the producer loads its rows of A only then (the one test both sides make).
__device__ __forceinline__ bool block_has_data(const RaggedTile& tile, int block) { return 64 * block < tile.data_rows; }

// A consumer warpgroup with nothing to multiply in a tile (its 64-row block lies past the group's
// data: the tile at a group's end, every tile of a group of up to 64 rows) still takes part in each
// of the tile's stages, as one of the stage's releasers, without MMAs; the producer does not load its
// block of A (ragged_gemm_ws_kernel). Measured: 1-6% on such tiles (docs/PERF.md).
template <class Tile>
__device__ __forceinline__ void pass_stages(uint64_t* full, uint64_t* empty, RingPos& pos, int ktiles) {
  for (int kt = 0; kt < ktiles; ++kt) {
    sm90::mbar_wait(&full[pos.stage], pos.phase);  // not before it is filled: never a phase early
    sm90::mbar_arrive(&empty[pos.stage]);
    pos.template advance<Tile::STAGES>();
  }
}

// Accumulator layout of m64nNk16: warp w of the warpgroup holds rows 16w + lane/4 (+8) of its 64-row
// block; registers 4j + {0,1} are columns 8j + 2(lane%4) + {0,1} of the first row, 4j + {2,3} of
// the second.
__device__ __forceinline__ int acc_row(int block, int half) {
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32;
  return block * 64 + warp * 16 + lane / 4 + half * 8;
}
__device__ __forceinline__ int acc_col(int j) { return j * 8 + (threadIdx.x % 4) * 2; }

template <class T>
struct Pair;
template <>
struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ type make(float a, float b) { return __floats2bfloat162_rn(a, b); }
  static __device__ __forceinline__ float2 to_float2(type v) { return __bfloat1622float2(v); }
};
template <>
struct Pair<__half> {
  using type = __half2;
  static __device__ __forceinline__ type make(float a, float b) { return __floats2half2_rn(a, b); }
  static __device__ __forceinline__ float2 to_float2(type v) { return __half22float2(v); }
};

// The staging protocol of one consumer warpgroup: wait until the copy engine has read what this
// warpgroup's threads handed it last time, write the staging area with write(), publish it to the
// async proxy, and let threads i < kIssuers of the warpgroup issue copy(i). Returns without waiting
// for the copies, which drain under the next tile.
template <int kIssuers, class Write, class Copy>
__device__ __forceinline__ void through_staging(Write write, Copy copy) {
  const int wg = threadIdx.x / 128 - 1, wtid = threadIdx.x % 128;
  sm90::bulk_wait_read();
  sm90::named_barrier(2 + wg, 128);
  write();
  sm90::fence_proxy_async_smem();
  sm90::named_barrier(2 + wg, 128);
  if (wtid < kIssuers) {
    copy(wtid);
    sm90::bulk_commit();
  }
}

// The warpgroup's 64-row block `block` of a row-ragged tile: f(half, row, col, v0, v1) applied to
// the accumulators, stored in T. A block wholly inside the group's span (rows below row_lim) leaves
// as BN / 64 tensor stores of swizzled boxes, element (row, col) at (c0 + col, c1 + row) of `map`;
// the block at the group's end, whose later rows belong to another group, as one bulk copy of
// col_bytes per row below row_lim to dst0 + row * ld. Each block has its own region of the staging.
template <class T, class Tile, class F>
__device__ __forceinline__ void store_ragged_block(uint8_t* staging, const Acc<Tile, 1>& acc, int block,
                                                   const CUtensorMap* map, int64_t c0, int64_t c1, T* dst0,
                                                   int64_t ld, int row_lim, uint32_t col_bytes, F f) {
  constexpr int kBoxes = Tile::BN / 64;
  uint8_t* region = staging + block * 64 * Tile::kStagingLd;  // 1024-byte aligned, as boxes need
  const bool boxed = 64 * (block + 1) <= row_lim;
  through_staging<64>(
      [&] {
        const uint32_t lane_bytes = (threadIdx.x % 4) * 4;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = acc_row(block, half), r = row % 64;
          // Boxed: the swizzled offset is row_off ^ (the pair's column byte in its box), as in store_boxes.
          const uint32_t row_off = boxed ? r * 128 + (lane_bytes ^ ((r % 8) << 4)) : r * Tile::kStagingLd + lane_bytes;
#pragma unroll
          for (int j = 0; j < Tile::BN / 8; ++j) {
            float v0 = acc[0][4 * j + 2 * half], v1 = acc[0][4 * j + 2 * half + 1];
            f(half, row, acc_col(j), v0, v1);
            const uint32_t at = boxed ? (row_off ^ ((j % 8) * 16)) + (j / 8) * kBoxBytes : row_off + j * 16;
            *reinterpret_cast<typename Pair<T>::type*>(region + at) = Pair<T>::make(v0, v1);
          }
        }
      },
      [&](int i) {
        if (boxed) {
          if (i < kBoxes)
            sm90::tma_store_2d(map, region + i * kBoxBytes, static_cast<int>(c0 + 64 * i), static_cast<int>(c1 + 64 * block));
        } else if (const int row = 64 * block + i; row < row_lim) {
          sm90::bulk_store(dst0 + row * ld, region + i * Tile::kStagingLd, col_bytes);
        }
      });
}

// The warpgroup's 64-row block `wg` of an fprop / dgrad tile (output columns n0.. of `tile`) to
// C [capacity_rows, cols] through `map`: data rows plus the group's bias times the row's bias scale,
// alignment gap rows as zero (they read as zero downstream); rows past the group's span and columns
// past `cols` are left alone.
template <class T, class Tile>
__device__ __forceinline__ void finish_ragged_block(uint8_t* staging, const Acc<Tile, 1>& acc, int wg,
                                                    const RaggedTile& tile, int64_t n0, const CUtensorMap* map,
                                                    T* c_all, int64_t cols, const T* bias_all,
                                                    const float* bias_scale) {
  using P = Pair<T>;
  const T* b = bias_all != nullptr ? bias_all + static_cast<int64_t>(tile.group) * cols + n0 : nullptr;
  float s[2];  // this thread's rows' bias scales
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = acc_row(wg, half);
    s[half] = b != nullptr && bias_scale != nullptr && row < tile.data_rows ? bias_scale[tile.row0 + row] : 1.0f;
  }
  store_ragged_block<T, Tile>(staging, acc, wg, map, n0, tile.row0, c_all + tile.row0 * cols + n0, cols,
                              static_cast<int>(tile.span_rows),
                              static_cast<uint32_t>(min(static_cast<int64_t>(Tile::BN), cols - n0) * 2),
                              [&](int half, int row, int col, float& v0, float& v1) {
                                if (row >= tile.data_rows) {
                                  v0 = v1 = 0.0f;  // alignment gap rows read as zero downstream
                                } else if (b != nullptr && n0 + col < cols) {
                                  const float2 bb = P::to_float2(*reinterpret_cast<const typename P::type*>(b + col));
                                  v0 += s[half] * bb.x, v1 += s[half] * bb.y;
                                }
                              });
}

// Writes the warpgroup's 64-row blocks [block0, block0 + kBlocks) of a tile into `boxes`, laid out
// as kBlocks x kBoxes swizzled boxes of kBoxCols columns each (box (b, cb) at ((block0 + b) * kBoxes +
// cb) * kBoxBytes): the accumulator columns [kJ0 * 8, kJ1 * 8), in T, or (kF32) added to the fp32
// values already there.
template <class T, class Tile, int kBlocks, int kJ0, int kJ1, bool kF32>
__device__ __forceinline__ void write_boxes(uint8_t* boxes, const Acc<Tile, kBlocks>& acc, int block0) {
  constexpr int kElem = kF32 ? 4 : 2, kBoxCols = 128 / kElem;
  constexpr int kBoxes = (kJ1 - kJ0) * 8 / kBoxCols;
  static_assert((kJ1 - kJ0) * 8 % kBoxCols == 0);
  // A pair's byte in its row is the column part jb (a multiple of 8 * kElem >= 16) plus this
  // thread's part (below 8 * kElem), so the swizzled offset is row_off ^ jb, one XOR per store,
  // with the thread's part and the row's swizzle folded into row_off once per row.
  const uint32_t lane_bytes = (threadIdx.x % 4) * 2 * kElem;
#pragma unroll
  for (int b = 0; b < kBlocks; ++b)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = acc_row(block0 + b, half) % kBoxRows;
      const uint32_t row_off = (block0 + b) * kBoxes * kBoxBytes + r * 128 + (lane_bytes ^ ((r % 8) << 4));
#pragma unroll
      for (int j = kJ0; j < kJ1; ++j) {
        const uint32_t byte = (j - kJ0) * 8 * kElem;  // the pair's column part in the pass
        uint8_t* at = boxes + (row_off ^ (byte % 128)) + (byte / 128) * kBoxBytes;
        const float v0 = acc[b][4 * j + 2 * half], v1 = acc[b][4 * j + 2 * half + 1];
        if constexpr (kF32) {
          const float2 g = *reinterpret_cast<const float2*>(at);
          *reinterpret_cast<float2*>(at) = make_float2(g.x + v0, g.y + v1);
        } else {
          *reinterpret_cast<typename Pair<T>::type*>(at) = Pair<T>::make(v0, v1);
        }
      }
    }
}

// The mbarrier on which a consumer warpgroup waits for the main_grad boxes it loads, and its phase.
struct EpilogueLoad {
  uint64_t* bar;
  uint32_t phase = 0;
};

// The warpgroup's 64-row blocks [block0, block0 + kBlocks) of a tile whose element (row, col) is
// (c0 + col, c1 + row, c2) of `map`, through boxed staging, as kBlocks x kBoxes tensor stores of
// kBoxCols columns each: the accumulator columns [kJ0 * 8, kJ1 * 8), in T, or (kF32) added to fp32
// main_grad. main_grad's boxes are loaded into the staging first and the sum is stored back: one
// read and one write per element at the copy engine's rate, where reduce-adds at L2 reached only
// ~0.6 of the memory floor (docs/PERF.md, v7). Boxes past the tensor's extent (n, k) are neither
// loaded nor stored, and overhanging ones are cut by the copy engine (they load zeros there).
template <class T, class Tile, int kBlocks, int kJ0, int kJ1, bool kF32>
__device__ __forceinline__ void store_boxes(uint8_t* staging, const Acc<Tile, kBlocks>& acc, int block0,
                                            const CUtensorMap* map, int64_t c0, int64_t c1, int c2, int64_t k,
                                            int64_t n, EpilogueLoad* load = nullptr) {
  constexpr int kElem = kF32 ? 4 : 2, kBoxCols = 128 / kElem;
  constexpr int kBoxes = (kJ1 - kJ0) * 8 / kBoxCols;
  static_assert(2 * kBoxes * kBoxBytes <= Tile::kStagingBytes);
  // Box i of the warpgroup: its coordinates, and whether any of it lies inside the tensor.
  auto box = [&](int i, int& x, int& y, const uint8_t*& src) {
    const int b = i / kBoxes, cb = i % kBoxes;
    const int64_t bx = c0 + kJ0 * 8 + cb * kBoxCols, by = c1 + 64 * (block0 + b);
    x = static_cast<int>(bx), y = static_cast<int>(by);
    src = staging + ((block0 + b) * kBoxes + cb) * kBoxBytes;
    return bx < k && by < n;
  };
  through_staging<kBlocks * kBoxes>(
      [&] {
        if constexpr (kF32) {  // main_grad's boxes into the staging (it is free: through_staging waited)
          if (threadIdx.x % 128 == 0) {
            uint32_t bytes = 0;
            for (int i = 0; i < kBlocks * kBoxes; ++i) {
              int x, y;
              const uint8_t* src;
              if (box(i, x, y, src)) bytes += kBoxBytes;  // overhanging boxes count whole (zero fill)
            }
            sm90::mbar_arrive_expect_tx(load->bar, bytes);
            for (int i = 0; i < kBlocks * kBoxes; ++i) {
              int x, y;
              const uint8_t* src;
              if (box(i, x, y, src)) sm90::tma_load_3d(const_cast<uint8_t*>(src), map, load->bar, x, y, c2);
            }
          }
          sm90::mbar_wait(load->bar, load->phase);
          load->phase ^= 1;
        }
        write_boxes<T, Tile, kBlocks, kJ0, kJ1, kF32>(staging, acc, block0);
      },
      [&](int i) {
        int x, y;
        const uint8_t* src;
        if (box(i, x, y, src)) sm90::tma_store_3d(map, src, x, y, c2);
      });
}

// fprop (kDgrad = false) and dgrad (true): rows ragged by group; gap rows written as zero.
template <class T, class Tile, bool kDgrad>
__global__ void __launch_bounds__(THREADS, 1) ragged_gemm_ws_kernel(const __grid_constant__ RaggedTmaParams tp) {
  constexpr int BN = Tile::BN, STAGES = Tile::STAGES;
  extern __shared__ uint8_t smem_raw[];
  __shared__ int tile_prefix[kMaxGroups + 1];
  __shared__ int warp_sums[THREADS / 32];
  __shared__ alignas(8) uint64_t full[STAGES], empty[STAGES];
  uint8_t* smem = sm90::aligned_smem(smem_raw);
  const RaggedGemmParams& p = tp.p;
  const int64_t red = kDgrad ? p.n : p.k, cols = kDgrad ? p.k : p.n;

  init_ring<Tile>(full, empty);
  build_tile_prefix<THREADS, BM, true>(p.splits, p.offsets, p.num_groups, tile_prefix, warp_sums);  // ends in a barrier
  const int total_mt = tile_prefix[p.num_groups];
  const int tiles_n = static_cast<int>((cols + BN - 1) / BN);
  const int64_t total = static_cast<int64_t>(total_mt) * tiles_n;
  const int ktiles = static_cast<int>((red + BK - 1) / BK);

  if (threadIdx.x < 128) {  // producer warpgroup: one thread issues every copy
    sm90::release_registers<kProducerRegs>();
    if (threadIdx.x != 0) return;
    sm90::prefetch_tensor_map(&tp.a);
    sm90::prefetch_tensor_map(&tp.b);
    RingPos pos;
    for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
      int mt, nt;
      raster(t, tile_prefix, p.num_groups, tiles_n, mt, nt);
      const RaggedTile tile = locate_ragged_tile<BM>(tile_prefix, p.splits, p.offsets, p.num_groups, mt);
      const int n0 = nt * BN, row0 = static_cast<int>(tile.row0);
      // A's second 64-row block only when its warpgroup multiplies it (it holds data rows).
      const int a_blocks = block_has_data(tile, 1) ? 2 : 1;
      for (int kt = 0; kt < ktiles; ++kt) {
        sm90::mbar_wait(&empty[pos.stage], pos.phase ^ 1);
        uint8_t* stage = smem + pos.stage * Tile::kStageBytes;
        uint64_t* bar = &full[pos.stage];
        sm90::mbar_arrive_expect_tx(bar, Tile::kStageBytes - (2 - a_blocks) * kAtomBytes);
        for (int a = 0; a < a_blocks; ++a) sm90::tma_load_2d(stage + a * kAtomBytes, &tp.a, bar, kt * BK, row0 + 64 * a);
        if constexpr (!kDgrad) {
          sm90::tma_load_3d(stage + kTileBytesA, &tp.b, bar, kt * BK, n0, tile.group);
        } else {
#pragma unroll
          for (int b = 0; b < BN / 64; ++b)
            sm90::tma_load_3d(stage + kTileBytesA + b * kAtomBytes, &tp.b, bar, n0 + 64 * b, kt * BK, tile.group);
        }
        pos.advance<STAGES>();
      }
    }
    return;
  }

  sm90::claim_registers<kConsumerRegs>();
  uint8_t* staging = smem + STAGES * Tile::kStageBytes;
  RingPos pos;
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    int mt, nt;
    raster(t, tile_prefix, p.num_groups, tiles_n, mt, nt);
    const RaggedTile tile = locate_ragged_tile<BM>(tile_prefix, p.splits, p.offsets, p.num_groups, mt);
    const int64_t n0 = static_cast<int64_t>(nt) * BN;
    const int wg = threadIdx.x / 128 - 1;  // owns 64-row block wg of the tile
    if (64 * wg >= tile.span_rows) {       // the block lies past the group: nothing to compute or store
      pass_stages<Tile>(full, empty, pos, ktiles);
      continue;
    }
    Acc<Tile, 1> acc;
    if (block_has_data(tile, wg)) {
      consume<T, Tile, false, kDgrad, 1>(smem, full, empty, pos, ktiles, wg, acc, [](uint8_t*) {});
    } else {  // alignment gap rows only: written as zero
      zero_acc<Tile, 1>(acc);
      pass_stages<Tile>(full, empty, pos, ktiles);
    }
    finish_ragged_block<T, Tile>(staging, acc, wg, tile, n0, &tp.c, static_cast<T*>(p.c), cols,
                                 static_cast<const T*>(p.bias), p.bias_scale);
  }
  sm90::bulk_wait();
}

// Zeroes reduction rows [valid, 64) of every operand box of a wgrad stage: those rows lie past the
// group (another group's rows, or padding that may hold anything). The `threads` consumer threads
// that read the stage (from consumer thread `first` on) share the work and meet at named barrier
// `barrier` before their MMAs read it.
template <class Tile>
__device__ __forceinline__ void zero_rows_past(uint8_t* stage, int valid, int first, int threads, int barrier) {
  constexpr int kAtoms = (BM + Tile::BN) / 64;
  const int bad = BK - valid, per_atom = bad * 8;  // 16-byte chunks per atom
  for (int c = threadIdx.x - 128 - first; c < kAtoms * per_atom; c += threads) {
    const int atom = c / per_atom, r = c % per_atom;
    *reinterpret_cast<uint4*>(stage + atom * kAtomBytes + (valid + r / 8) * 128 + (r % 8) * 16) = make_uint4(0, 0, 0, 0);
  }
  sm90::fence_proxy_async_smem();
  sm90::named_barrier(barrier, threads);
}

// wgrad tiles: (group e, 128 n, BN k) of dW, reduced over the group's rows; virtual tile t walks the
// groups in order, each group's tiles k-fastest.
struct WgradTile {
  int e, rows;
  int64_t n0, k0;
};
template <class Tile>
struct WgradGrid {
  int tiles_k;
  int64_t per_group, total;  // tiles per group, and in all
  __device__ explicit WgradGrid(const WgradParams& p)
      : tiles_k(static_cast<int>((p.k + Tile::BN - 1) / Tile::BN)),
        per_group(static_cast<int64_t>((p.n + BM - 1) / BM) * tiles_k),
        total(per_group * p.num_groups) {}
  __device__ WgradTile tile(const WgradParams& p, int64_t t) const {
    WgradTile w;
    w.e = static_cast<int>(t / per_group);
    const int64_t local = t % per_group;
    w.n0 = (local / tiles_k) * BM, w.k0 = (local % tiles_k) * Tile::BN;
    w.rows = static_cast<int>(group_rows(p.splits, p.offsets, w.e));
    return w;
  }
};

// The producer of the wgrad kernels (one thread): loads every tile's (rows + 63) / 64 stages of dy
// (128 n) and x (BN k), 64 rows each, in this CTA's tile order.
template <class Tile>
__device__ __forceinline__ void produce_wgrad(const WgradTmaParams& tp, uint8_t* smem, uint64_t* full, uint64_t* empty,
                                              const WgradGrid<Tile>& grid) {
  sm90::prefetch_tensor_map(&tp.dy);
  sm90::prefetch_tensor_map(&tp.x);
  RingPos pos;
  for (int64_t t = blockIdx.x; t < grid.total; t += gridDim.x) {
    const WgradTile w = grid.tile(tp.p, t);
    const int r0 = static_cast<int>(tp.p.offsets[w.e]);
    for (int kt = 0; kt < (w.rows + BK - 1) / BK; ++kt) {
      sm90::mbar_wait(&empty[pos.stage], pos.phase ^ 1);
      uint8_t* stage = smem + pos.stage * Tile::kStageBytes;
      uint64_t* bar = &full[pos.stage];
      sm90::mbar_arrive_expect_tx(bar, Tile::kStageBytes);
#pragma unroll
      for (int a = 0; a < BM / 64; ++a)
        sm90::tma_load_2d(stage + a * kAtomBytes, &tp.dy, bar, static_cast<int>(w.n0) + 64 * a, r0 + kt * BK);
#pragma unroll
      for (int b = 0; b < Tile::BN / 64; ++b)
        sm90::tma_load_2d(stage + kTileBytesA + b * kAtomBytes, &tp.x, bar, static_cast<int>(w.k0) + 64 * b,
                          r0 + kt * BK);
      pos.advance<Tile::STAGES>();
    }
  }
}

// A wgrad tile's result, held in kBlocks 64-row blocks from block0: written (empty group: zeros) or
// added into fp32 main_grad.
template <class T, class Tile, int kBlocks>
__device__ __forceinline__ void finish_wgrad_tile(const WgradTmaParams& tp, const WgradTile& w, uint8_t* staging,
                                                  const Acc<Tile, kBlocks>& acc, int block0, EpilogueLoad& load) {
  constexpr int kJ = Tile::BN / 8;
  const WgradParams& p = tp.p;
  if (p.main_grad != nullptr) {  // in two halves of columns: half a row of floats is a 16-bit row's bytes
    store_boxes<T, Tile, kBlocks, 0, kJ / 2, true>(staging, acc, block0, &tp.out, w.k0, w.n0, w.e, p.k, p.n, &load);
    store_boxes<T, Tile, kBlocks, kJ / 2, kJ, true>(staging, acc, block0, &tp.out, w.k0, w.n0, w.e, p.k, p.n, &load);
  } else {
    store_boxes<T, Tile, kBlocks, 0, kJ, false>(staging, acc, block0, &tp.out, w.k0, w.n0, w.e, p.k, p.n);
  }
}

// dW_e[n][k] = sum over group e's rows r of dy[r][n] x[r][k]: tiles (group, 128 n, BN k), reduced
// over the group's rows; written (empty group: zeros) or added into fp32 main_grad. The two consumer
// warpgroups share each tile (64 n rows each).
template <class T, class Tile>
__global__ void __launch_bounds__(THREADS, 1) grouped_wgrad_ws_kernel(const __grid_constant__ WgradTmaParams tp) {
  constexpr int STAGES = Tile::STAGES;
  extern __shared__ uint8_t smem_raw[];
  __shared__ alignas(8) uint64_t full[STAGES], empty[STAGES], loaded[2];
  uint8_t* smem = sm90::aligned_smem(smem_raw);
  const WgradParams& p = tp.p;
  init_ring<Tile>(full, empty, kConsumerThreads, loaded);
  __syncthreads();
  const WgradGrid<Tile> grid(p);
  if (threadIdx.x < 128) {
    sm90::release_registers<kProducerRegs>();
    if (threadIdx.x == 0) produce_wgrad<Tile>(tp, smem, full, empty, grid);
    return;
  }

  sm90::claim_registers<kConsumerRegs>();
  uint8_t* staging = smem + STAGES * Tile::kStageBytes;
  const int wg = threadIdx.x / 128 - 1;
  EpilogueLoad load{&loaded[wg]};
  RingPos pos;
  for (int64_t t = blockIdx.x; t < grid.total; t += gridDim.x) {
    const WgradTile w = grid.tile(p, t);
    if (w.rows == 0 && p.main_grad != nullptr) continue;  // accumulating nothing leaves main_grad unchanged
    Acc<Tile, 1> acc;
    if (w.rows > 0) {
      const int tail = w.rows % BK;
      consume<T, Tile, true, true, 1>(smem, full, empty, pos, (w.rows + BK - 1) / BK, wg, acc, [&](uint8_t* stage) {
        if (tail != 0) zero_rows_past<Tile>(stage, tail, 0, kConsumerThreads, 1);
      });
    } else {
      zero_acc<Tile, 1>(acc);  // an empty group's gradient is zero
    }
    finish_wgrad_tile<T, Tile, 1>(tp, w, staging, acc, wg, load);
  }
  sm90::bulk_wait();
}

// The same wgrad with ping-pong consumers, for short reductions (groups of a few hundred rows): the
// CTA's tiles alternate between the two consumer warpgroups, each owning whole 128 x 128 tiles and its
// own staging area, so one warpgroup's epilogue and stores run while the other's MMAs do. Each
// warpgroup steps over the ring positions of the other's tiles. A token passes between them in tile
// order (named barriers 4 and 5): a warpgroup starts waiting on its tile's stages only once the other
// has passed all of its previous tile's, so no one waits on a stage's barrier a phase too early (the
// parity wait could not tell those phases apart) and the MMAs of the two run one tile after the other.
// Launched into dW; into main_grad, grouped_wgrad_pingpong_main_grad_kernel runs instead. The shared
// finish_wgrad_tile keeps its main_grad branch compiled in here: written without it, this kernel
// measured 5% slower on 80-row groups (code generation; docs/PERF.md).
template <class T>
__global__ void __launch_bounds__(THREADS, 1) grouped_wgrad_pingpong_kernel(const __grid_constant__ WgradTmaParams tp) {
  using Tile = TilePingPong;
  constexpr int STAGES = Tile::STAGES;
  extern __shared__ uint8_t smem_raw[];
  __shared__ alignas(8) uint64_t full[STAGES], empty[STAGES], loaded[2];
  uint8_t* smem = sm90::aligned_smem(smem_raw);
  const WgradParams& p = tp.p;
  init_ring<Tile>(full, empty, 128, loaded);
  __syncthreads();
  const WgradGrid<Tile> grid(p);
  if (threadIdx.x < 128) {
    sm90::release_registers<kProducerRegs>();
    if (threadIdx.x == 0) produce_wgrad<Tile>(tp, smem, full, empty, grid);
    return;
  }

  sm90::claim_registers<kConsumerRegs>();
  const int wg = threadIdx.x / 128 - 1;
  uint8_t* staging = smem + STAGES * Tile::kStageBytes + wg * Tile::kStagingBytes;
  const int my_token = 4 + wg, other_token = 5 - wg;  // barrier a warpgroup waits on / signals
  EpilogueLoad load{&loaded[wg]};
  RingPos pos;
  int64_t j = 0;  // the tile's place in this CTA's sequence: warpgroup j % 2 owns it
  for (int64_t t = blockIdx.x; t < grid.total; t += gridDim.x, ++j) {
    const WgradTile w = grid.tile(p, t);
    const int ktiles = (w.rows + BK - 1) / BK;
    if ((j & 1) != wg) {
      pos.skip<STAGES>(ktiles);
      continue;
    }
    if (j > 0) sm90::named_barrier(my_token, 256);  // the other warpgroup passed its previous tile
    const bool skip = w.rows == 0 && p.main_grad != nullptr;  // main_grad stays as it is
    Acc<Tile, 2> acc;
    if (w.rows > 0) {
      const int tail = w.rows % BK;
      consume<T, Tile, true, true, 2>(smem, full, empty, pos, ktiles, 0, acc, [&](uint8_t* stage) {
        if (tail != 0) zero_rows_past<Tile>(stage, tail, 128 * wg, 128, 2 + wg);
      });
    } else {
      zero_acc<Tile, 2>(acc);  // an empty group's gradient is zero
    }
    sm90::named_barrier_arrive(other_token, 256);
    if (!skip) finish_wgrad_tile<T, Tile, 2>(tp, w, staging, acc, 0, load);
  }
  // The last tile's owner signalled the other warpgroup: take that token, so no arrival is left over.
  if (j > 0 && (j & 1) == wg) sm90::named_barrier(my_token, 256);
  sm90::bulk_wait();
}

// A ping-pong wgrad tile's fp32 main_grad passes through the result ring in four parts of 32
// columns: part q is boxes (64 rows, 32 columns) at rows n0 and n0 + 64, columns k0 + 32q.
struct MainGradPart {
  static constexpr int kParts = 4, kBoxes = 2, kCols = 32;
  // Box i's coordinates, and whether any of it lies inside the tensor (boxes past it are neither
  // loaded nor stored; overhanging ones are cut by the copy engine, which loads zeros there).
  static __device__ __forceinline__ bool box(const WgradParams& p, const WgradTile& w, int q, int i, int& x, int& y) {
    const int64_t bx = w.k0 + kCols * q, by = w.n0 + kBoxRows * i;
    x = static_cast<int>(bx), y = static_cast<int>(by);
    return bx < p.k && by < p.n;
  }
};

// The main_grad streamer of the ping-pong wgrad (one thread of the producer warpgroup). It walks the
// CTA's tiles in the consumers' order, the parts of each tile that adds to main_grad taking the
// ring's buffers in turn. Part s is loaded into buffer s % kResults once part s - kResults has been
// added to by its consumer (`ready`), stored from that buffer and read out by the copy engine;
// `filled` then tells the consumer the part has arrived. So main_grad is read up to kResults - 1
// parts ahead of the consumers, whatever their epilogues wait on, where each warpgroup used to load
// its tile's boxes itself after its MMAs (docs/PERF.md).
__device__ __forceinline__ void stream_main_grad(const WgradTmaParams& tp, const WgradGrid<TilePingPongMainGrad>& grid,
                                                 uint8_t* results, uint64_t* filled, uint64_t* ready) {
  using Tile = TilePingPongMainGrad;
  constexpr int kResults = Tile::kResults;
  const WgradParams& p = tp.p;
  sm90::prefetch_tensor_map(&tp.out);
  struct Pending {
    WgradTile w;
    int q;
  } pending[kResults];
  auto store = [&](int64_t s) {  // part s, once its consumer has added to it
    const int b = static_cast<int>(s % kResults);
    sm90::mbar_wait(&ready[b], static_cast<uint32_t>(s / kResults) & 1);
    for (int i = 0; i < MainGradPart::kBoxes; ++i) {
      int x, y;
      if (MainGradPart::box(p, pending[b].w, pending[b].q, i, x, y))
        sm90::tma_store_3d(&tp.out, results + b * Tile::kResultBytes + i * kBoxBytes, x, y, pending[b].w.e);
    }
    sm90::bulk_commit();
  };
  int64_t s = 0;
  for (int64_t t = blockIdx.x; t < grid.total; t += gridDim.x) {
    const WgradTile w = grid.tile(p, t);
    if (w.rows == 0) continue;  // accumulating nothing leaves main_grad unchanged
    for (int q = 0; q < MainGradPart::kParts; ++q, ++s) {
      const int b = static_cast<int>(s % kResults);
      if (s >= kResults) {
        store(s - kResults);
        sm90::bulk_wait_read();  // the buffer is free again
      }
      pending[b] = {w, q};
      uint32_t bytes = 0;
      int x, y;
      for (int i = 0; i < MainGradPart::kBoxes; ++i)
        if (MainGradPart::box(p, w, q, i, x, y)) bytes += kBoxBytes;  // overhanging boxes count whole (zero fill)
      sm90::mbar_arrive_expect_tx(&filled[b], bytes);
      for (int i = 0; i < MainGradPart::kBoxes; ++i)
        if (MainGradPart::box(p, w, q, i, x, y))
          sm90::tma_load_3d(results + b * Tile::kResultBytes + i * kBoxBytes, &tp.out, &filled[b], x, y, w.e);
    }
  }
  for (int64_t r = s > kResults ? s - kResults : 0; r < s; ++r) store(r);
  sm90::bulk_wait();
}

// A consumer warpgroup's accumulators added to part q of its tile's main_grad in buffer `buf`.
template <class T>
__device__ __forceinline__ void add_main_grad_part(uint8_t* buf, const Acc<TilePingPongMainGrad, 2>& acc, int q) {
  using Tile = TilePingPongMainGrad;
  switch (q) {  // the accumulator columns [32q, 32q + 32): register pairs j = 4q .. 4q + 3
    case 0: return write_boxes<T, Tile, 2, 0, 4, true>(buf, acc, 0);
    case 1: return write_boxes<T, Tile, 2, 4, 8, true>(buf, acc, 0);
    case 2: return write_boxes<T, Tile, 2, 8, 12, true>(buf, acc, 0);
    default: return write_boxes<T, Tile, 2, 12, 16, true>(buf, acc, 0);
  }
}

// The ping-pong wgrad into fp32 main_grad: the same tile order, token and mainloop as
// grouped_wgrad_pingpong_kernel, with main_grad taken from the result ring (stream_main_grad), whose
// parts both warpgroups count in tile order; a tile of an empty group adds nothing and has no parts.
// Measured against loading each tile's main_grad after its MMAs (docs/PERF.md): 3-9% faster on groups
// of 64 and 500 rows, from 3% slower to 3.5% faster on 80-128 (with 4 operand stages and 6 buffers;
// 5 and 4 then gained 2-8% more). dW stays with grouped_wgrad_pingpong_kernel: through a shared ring
// (a stage fewer) it was up to 12% slower.
template <class T>
__global__ void __launch_bounds__(THREADS, 1)
    grouped_wgrad_pingpong_main_grad_kernel(const __grid_constant__ WgradTmaParams tp) {
  using Tile = TilePingPongMainGrad;
  constexpr int STAGES = Tile::STAGES, kResults = Tile::kResults;
  // A consumer's wait on `ready` of part s - kResults (before its parity wait on `filled`) is itself
  // unambiguous only once part s - 2 kResults has been added to: with a tile's parts within the ring,
  // that part lies two tiles back or more, which the token guarantees are finished.
  static_assert(kResults >= MainGradPart::kParts, "a tile's main_grad parts fit the ring");
  extern __shared__ uint8_t smem_raw[];
  __shared__ alignas(8) uint64_t full[STAGES], empty[STAGES], filled[kResults], ready[kResults];
  uint8_t* smem = sm90::aligned_smem(smem_raw);
  uint8_t* results = smem + STAGES * Tile::kStageBytes;
  const WgradParams& p = tp.p;
  init_ring<Tile>(full, empty, 128);
  if (threadIdx.x == 0) {
    for (int b = 0; b < kResults; ++b) sm90::mbar_init(&filled[b], 1), sm90::mbar_init(&ready[b], 128);
    sm90::fence_mbarrier_init();
  }
  __syncthreads();
  const WgradGrid<Tile> grid(p);
  if (threadIdx.x < 128) {
    sm90::release_registers<kProducerRegs>();
    if (threadIdx.x == 0) produce_wgrad<Tile>(tp, smem, full, empty, grid);
    else if (threadIdx.x == 32) stream_main_grad(tp, grid, results, filled, ready);
    return;
  }

  sm90::claim_registers<kConsumerRegs>();
  const int wg = threadIdx.x / 128 - 1;
  const int my_token = 4 + wg, other_token = 5 - wg;  // barrier a warpgroup waits on / signals
  RingPos pos;
  int64_t j = 0, s = 0;  // the tile's place in this CTA's sequence (warpgroup j % 2 owns it); the next part
  for (int64_t t = blockIdx.x; t < grid.total; t += gridDim.x, ++j) {
    const WgradTile w = grid.tile(p, t);
    const int ktiles = (w.rows + BK - 1) / BK;
    if ((j & 1) != wg) {
      pos.skip<STAGES>(ktiles);
      if (w.rows > 0) s += MainGradPart::kParts;
      continue;
    }
    if (j > 0) sm90::named_barrier(my_token, 256);  // the other warpgroup passed its previous tile
    Acc<Tile, 2> acc;
    if (w.rows > 0) {
      const int tail = w.rows % BK;
      consume<T, Tile, true, true, 2>(smem, full, empty, pos, ktiles, 0, acc, [&](uint8_t* stage) {
        if (tail != 0) zero_rows_past<Tile>(stage, tail, 128 * wg, 128, 2 + wg);
      });
    }
    sm90::named_barrier_arrive(other_token, 256);
    if (w.rows == 0) continue;  // main_grad stays as it is
    for (int q = 0; q < MainGradPart::kParts; ++q, ++s) {
      const int b = static_cast<int>(s % kResults);
      // The buffer's previous part (s - kResults) may be the other warpgroup's, whose load need not
      // have landed yet (copies complete in any order): `filled` would then still be in that part's
      // phase, and the parity wait below would match the phase before it. Once that part has been
      // added to (`ready`, whose earlier phases are all complete: both warpgroups finished every tile
      // before the other's previous one), `filled` is in this part's phase.
      if (s >= kResults) sm90::mbar_wait(&ready[b], static_cast<uint32_t>(s / kResults - 1) & 1);
      sm90::mbar_wait(&filled[b], static_cast<uint32_t>(s / kResults) & 1);
      add_main_grad_part<T>(results + b * Tile::kResultBytes, acc, q);
      sm90::fence_proxy_async_smem();  // this thread's writes, before the streamer's store reads them
      sm90::mbar_arrive(&ready[b]);
    }
  }
  // The last tile's owner signalled the other warpgroup: take that token, so no arrival is left over.
  if (j > 0 && (j & 1) == wg) sm90::named_barrier(my_token, 256);
}

}  // namespace moegraph::kernels::tma_gemm
