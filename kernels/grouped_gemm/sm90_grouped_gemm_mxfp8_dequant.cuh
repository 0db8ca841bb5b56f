// MXFP8 ragged GEMM (fprop, dgrad) on the bf16 tensor cores: the operands stream from memory as E4M3
// codes and E8M0 scales (half the bytes of bf16), are dequantized once per element in shared memory
// and multiplied by bf16 wgmma with fp32 accumulation. There is no per-32-block promotion, which
// bounds the E4M3 kernels (sm90_grouped_gemm_mxfp8_cp_async.cuh, ..._swap_ab.cuh) on groups of more
// than a few dozen rows; the price is one conversion per element loaded, overlapped with the MMAs.
//   fprop: y = x · W_e^T     A = x rows (scales along K), B = W_e [N][K]
//   dgrad: dx = dy · W_e     A = dy rows (scales along N), B = W_e^T [K][N]
// Both operands are K-major with blocks along the reduction, so one kernel runs both phases.
//
// Exactness: e4m3(q) · 2^(s - 127) has 4 significant bits and bf16's exponent range, so the bf16
// operand equals the dequantized value (docs/mxfp8.md) whenever that value is 0 or at least 2^-126
// in magnitude and finite; NaN codes and NaN scales give NaN. Below 2^-126 it is rounded to a bf16
// subnormal (an error under 2^-134); the quantizer makes such values only for blocks whose largest
// magnitude is below about 2^-109.
//
// Pipeline (one CTA per SM, persistent, tiles in the bf16 kernels' order):
// - producer warp: lane 0 loads each stage's two 128 x 128-byte E4M3 boxes by TMA (128-byte
//   swizzle), every lane copies 8 rows' scale words by cp.async; STAGES stages of 128 reduction
//   elements in a ring, guarded by mbarriers.
// - the two consumer warpgroups convert each stage in two chunks of 64 reduction elements into one of
//   CBUFS bf16 chunk buffers (A 128 x 64 and B 128 x 64, the 128-byte-swizzled K-major layout the
//   bf16 kernels' TMA boxes have), then issue the chunk's wgmma asynchronously and convert the next
//   chunk while it runs. Each warpgroup computes 64 rows of the 128 x 128 tile and reads all of B, so
//   a chunk is published to both by one 256-thread named barrier after its conversion. Three buffers
//   make that one barrier per chunk enough: a warpgroup writes chunk j + 1 into the buffer chunk
//   j - 2 used once its own MMAs of chunk j - 1 are done, and the other warpgroup waited for its MMAs
//   of chunk j - 2 before the barrier that published chunk j (convert_and_publish).
// - the epilogue is the bf16 kernel's (finish_ragged_block): bias, gap rows as zero, tensor stores.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common/cp_async.cuh"
#include "kernels/grouped_gemm/sm90_grouped_gemm_16bit_tma.cuh"
#include "kernels/grouped_gemm/sm90_mxfp8_scales.cuh"

namespace moegraph::kernels::mxfp8_dequant {

namespace tg = tma_gemm;

constexpr int kBlock = 32;                      // elements per E8M0 scale
constexpr int BM = tg::BM, BN = 128;
constexpr int BK = 128;                         // reduction elements (E4M3 bytes) per stage
constexpr int CK = 64;                          // reduction elements per converted chunk (128 bf16 bytes)
constexpr int STAGES = 2, CBUFS = 3;
constexpr int THREADS = tg::THREADS, kConsumerThreads = tg::kConsumerThreads;
constexpr int kTileBytes8 = BM * BK;            // one operand's E4M3 box: 16 KB
constexpr int kScaleOffset = 2 * kTileBytes8;   // then a scale word (4 blocks) per A row and per B row
constexpr int kStageBytes = kScaleOffset + (BM + BN) * 4;
constexpr int kChunkTileBytes = 128 * CK * 2;   // one operand's converted chunk: 16 KB
constexpr int kChunkBytes = 2 * kChunkTileBytes;
using OutTile = tg::TileShape<BN, 1>;           // the accumulators and output staging of the bf16 kernel
constexpr int kSmemBytes = STAGES * kStageBytes + CBUFS * kChunkBytes + OutTile::kStagingBytes + 1024;
constexpr int kConvertBarrier = 1;              // named barrier 1 (2, 3: the epilogue's, per warpgroup)
static_assert(kStageBytes % 1024 == 0 && kChunkBytes % 1024 == 0, "boxes and chunks stay 1024-aligned");
static_assert(BM == 128 && BN == 128, "the conversion's thread map covers 128 A rows and 128 B rows");
static_assert(kSmemBytes + 5 * 1024 <= 227 * 1024, "with the static tile prefix and barriers");

struct Params {
  Mxfp8RaggedGemmParams p;
  CUtensorMap a;  // rows [capacity_rows, red] e4m3, box 128 rows x 128 bytes
  CUtensorMap b;  // weights [G, cols, red] e4m3, box 128 rows x 128 bytes
  CUtensorMap c;  // the output [capacity_rows, cols] 16-bit, box 64 x 64 (store_ragged_block)
};

// The producer warp (warp 0): lane 0 issues both boxes of every stage; every lane copies 4 A rows'
// and 4 B rows' scale words (rows past the tensors read as zero scales, and their codes as zero).
__device__ __forceinline__ void produce(const Params& tp, uint8_t* smem, uint64_t* full, uint64_t* empty,
                                       const int* prefix, int64_t total, int tiles_n, int ktiles) {
  const Mxfp8RaggedGemmParams& p = tp.p;
  const int lane = threadIdx.x;
  const int64_t scale_ld = p.k / kBlock;
  if (lane == 0) sm90::prefetch_tensor_map(&tp.a), sm90::prefetch_tensor_map(&tp.b);
  tg::RingPos pos;
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    int mt, nt;
    tg::raster(t, prefix, p.num_groups, tiles_n, mt, nt);
    const RaggedTile tile = locate_ragged_tile<BM>(prefix, p.splits, p.offsets, p.num_groups, mt);
    const int64_t n0 = static_cast<int64_t>(nt) * BN, b_row0 = static_cast<int64_t>(tile.group) * p.n + n0;
    for (int kt = 0; kt < ktiles; ++kt) {
      sm90::mbar_wait(&empty[pos.stage], pos.phase ^ 1);
      uint8_t* s = smem + pos.stage * kStageBytes;
      uint64_t* bar = &full[pos.stage];
      if (lane == 0) {
        sm90::mbar_arrive_expect_tx(bar, 2 * kTileBytes8);
        sm90::tma_load_2d(s, &tp.a, bar, kt * BK, static_cast<int>(tile.row0));
        sm90::tma_load_3d(s + kTileBytes8, &tp.b, bar, kt * BK, static_cast<int>(n0), tile.group);
      }
      uint8_t* scales = s + kScaleOffset;
#pragma unroll
      for (int i = 0; i < BM / 32; ++i) {
        const int r = lane + 32 * i;
        const bool a_ok = tile.row0 + r < p.capacity_rows, b_ok = n0 + r < p.n;
        cp_async_4(scales + r * 4, a_ok ? p.a_scales + (tile.row0 + r) * scale_ld + kt * (BK / kBlock) : p.a_scales,
                   a_ok);
        cp_async_4(scales + (BM + r) * 4, b_ok ? p.b_scales + (b_row0 + r) * scale_ld + kt * (BK / kBlock) : p.b_scales,
                   b_ok);
      }
      cp_async_arrive_noinc(bar);
      pos.advance<STAGES>();
    }
  }
}

// Two E4M3 codes (the low 16 bits of `two`) times 2^(e - 127), e the scale byte, as a bf16 pair:
// exact conversions to f16 and fp32, one fp32 multiply by a power of two, and a rounding that is
// exact save for the subnormal case in the header comment. On the conversion pipe (a quarter of the
// integer rate), so only for what the fast path below does not take.
__device__ __forceinline__ uint32_t dequant_pair_exact(uint32_t two, uint32_t e) {
  uint32_t h;
  asm("{\n.reg .b16 t;\ncvt.u16.u32 t, %1;\ncvt.rn.f16x2.e4m3x2 %0, t;\n}\n" : "=r"(h) : "r"(two));
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  const float scale = e8m0_to_float(e);
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * scale, f.y * scale);
  return *reinterpret_cast<const uint32_t*>(&b);
}

// Codes bytes (2i, 2i + 1) of w as a bf16 pair of the same bits moved into place: sign to bit 15,
// the 4 exponent and 3 mantissa bits to bits 10..4, which reads as the E4M3 value times 2^-120 for
// normals and subnormals alike (bf16's exponent bias is 127, E4M3's 7, and both subnormal ranges
// scale linearly). Integer instructions only: a byte permute makes each 16-bit lane the code over a
// byte of copies of its sign bit (the selector's bit 3 replicates a byte's sign), so shifting the
// lane left by 4 puts the sign on bits 15..11 and the code's low 7 bits on 10..4; a mask keeps
// bits 15 and 10..4.
__device__ __forceinline__ uint32_t e4m3_pair_bits(uint32_t w, int i) {
  uint32_t v;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(v) : "r"(w), "r"(i == 0 ? 0x9180u : 0xB3A2u));
  return (v << 4) & 0x87F087F0u;
}
// Whether any of the 16 codes is a NaN (0x7F or 0xFF): a byte's low 7 bits plus one carry into its
// bit 7 exactly then, and never into the next byte.
__device__ __forceinline__ bool has_nan_code(const uint4& q) {
  const uint32_t m = 0x7f7f7f7fu, one = 0x01010101u;
  return (((q.x & m) + one) | ((q.y & m) + one) | ((q.z & m) + one) | ((q.w & m) + one)) & 0x80808080u;
}
// Whether 16 codes of one 32-element block with scale byte e can take the fast conversion: it
// multiplies the moved bits (e4m3_pair_bits) by 2^(e - 7) in bf16, exact while the multiplier is
// normal (e <= 134) and every product is too (e >= 10: the least E4M3 magnitude is 2^-9). The bf16
// multiply does not produce subnormals correctly (measured: 2^-126 x 2^-7 gave 2^-117), so smaller
// scales, larger ones, the NaN scale and NaN codes take dequant_pair_exact.
__device__ __forceinline__ bool fast_dequant_ok(const uint4& q, uint32_t e) {
  return e - 10u <= 124u && !has_nan_code(q);
}
__device__ __forceinline__ void dequant16_fast(const uint4& q, uint32_t e, uint4& lo, uint4& hi) {
  const uint32_t m16 = (e + 120u) << 7, m32 = m16 | (m16 << 16);
  const __nv_bfloat162 m = *reinterpret_cast<const __nv_bfloat162*>(&m32);
  auto pair = [&](uint32_t w, int i) {
    const uint32_t bits = e4m3_pair_bits(w, i);
    const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits), m);
    return *reinterpret_cast<const uint32_t*>(&r);
  };
  lo = make_uint4(pair(q.x, 0), pair(q.x, 1), pair(q.y, 0), pair(q.y, 1));
  hi = make_uint4(pair(q.z, 0), pair(q.z, 1), pair(q.w, 0), pair(q.w, 1));
}
__device__ __forceinline__ void dequant16_exact(const uint4& q, uint32_t e, uint4& lo, uint4& hi) {
  lo = make_uint4(dequant_pair_exact(q.x, e), dequant_pair_exact(q.x >> 16, e), dequant_pair_exact(q.y, e),
                  dequant_pair_exact(q.y >> 16, e));
  hi = make_uint4(dequant_pair_exact(q.z, e), dequant_pair_exact(q.z >> 16, e), dequant_pair_exact(q.w, e),
                  dequant_pair_exact(q.w >> 16, e));
}

// Chunk h (reduction elements [64h, 64h + 64) of the stage) of both operands into bf16 chunk buffer
// `cb`. Consumer warp w converts rows [32w, 32w + 32) of the 256 (A's 128, then B's): lane l takes
// row 8i + l % 8 of each octet i and its 16-byte piece l / 8 of the chunk's 64 code bytes. A quarter
// warp then reads one piece of 8 consecutive rows and writes two 16-byte bf16 pieces of each, which
// the 128-byte swizzle (piece c of row r at c ^ (r % 8)) spreads over all 32 banks both ways.
__device__ __forceinline__ void convert_chunk(const uint8_t* stage, uint8_t* cb, int h) {
  constexpr int kPieces = 4;
  const int ct = threadIdx.x - 128, warp = ct / 32, lane = ct % 32;
  const int r8 = lane % 8, piece = lane / 8;
  const int kb = 2 * h + piece / 2;  // the 32-element block of the stage this piece lies in
  // All loads first and one path for all four pieces, so their latencies overlap (a decision per
  // piece serialized them: load, test, branch, convert, store).
  uint4 q[kPieces];
  uint32_t e[kPieces];
  bool fast = true;
#pragma unroll
  for (int i = 0; i < kPieces; ++i) {
    const int row = warp * 32 + i * 8 + r8;  // warp-uniform operand: rows 0-127 A, 128-255 B; r % 8 == r8
    q[i] = *reinterpret_cast<const uint4*>(stage + (row / BM) * kTileBytes8 + (row % BM) * 128 +
                                           (((4 * h + piece) ^ r8) * 16));
    e[i] = (*reinterpret_cast<const uint32_t*>(stage + kScaleOffset + row * 4) >> (8 * kb)) & 0xffu;
    fast = fast && fast_dequant_ok(q[i], e[i]);
  }
#pragma unroll
  for (int i = 0; i < kPieces; ++i) {
    const int row = warp * 32 + i * 8 + r8;
    uint4 lo, hi;
    if (fast) dequant16_fast(q[i], e[i], lo, hi);
    else dequant16_exact(q[i], e[i], lo, hi);
    uint8_t* dst = cb + (row / BM) * kChunkTileBytes + (row % BM) * 128;
    *reinterpret_cast<uint4*>(dst + (((2 * piece) ^ r8) * 16)) = lo;
    *reinterpret_cast<uint4*>(dst + (((2 * piece + 1) ^ r8) * 16)) = hi;
  }
}

// C[r, n] for the rows of each group: 128 x 128 tiles; gap rows written as zero, rows past the
// group's span and columns past `cols` left alone.
template <class T>
__global__ void __launch_bounds__(THREADS, 1) ragged_gemm_kernel(const __grid_constant__ Params tp) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ int tile_prefix[kMaxGroups + 1];
  __shared__ int warp_sums[THREADS / 32];
  __shared__ alignas(8) uint64_t full[STAGES], empty[STAGES];
  uint8_t* smem = sm90::aligned_smem(smem_raw);
  const Mxfp8RaggedGemmParams& p = tp.p;
  // full: lane 0's arrive.expect_tx and the 32 lanes' scale copies
  sm90::init_stage_barriers<STAGES>(full, 1 + 32, empty, kConsumerThreads);
  build_tile_prefix<THREADS, BM, true>(p.splits, p.offsets, p.num_groups, tile_prefix, warp_sums);  // ends in a barrier
  const int tiles_n = static_cast<int>((p.n + BN - 1) / BN);
  const int64_t total = static_cast<int64_t>(tile_prefix[p.num_groups]) * tiles_n;
  const int ktiles = static_cast<int>(p.k / BK);

  if (threadIdx.x < 128) {
    sm90::release_registers<tg::kProducerRegs>();
    if (threadIdx.x < 32) produce(tp, smem, full, empty, tile_prefix, total, tiles_n, ktiles);
    return;
  }
  sm90::claim_registers<tg::kConsumerRegs>();
  uint8_t* chunks = smem + STAGES * kStageBytes;
  uint8_t* staging = chunks + CBUFS * kChunkBytes;
  const int wg = threadIdx.x / 128 - 1;  // owns 64-row block wg of the tile
  tg::RingPos pos;
  int buf = 0;  // the chunk buffer of the next chunk, continuing across tiles
  // Converts chunk j of the tile (half j % 2 of the ring's current stage) into buffer `into` and
  // publishes it to both warpgroups. The stage goes back to the producer after its second half.
  // The caller has waited (wgmma wait 1) for its own MMAs of chunk j - 2, the last to read `into`
  // ((j - 2) and j + 1 are equal mod 3); the other warpgroup waited for its own before it reached the
  // barrier of chunk j - 1, which this warpgroup has passed too.
  auto convert_and_publish = [&](int j, int into) {
    if (j % 2 == 0) sm90::mbar_wait(&full[pos.stage], pos.phase);
    convert_chunk(smem + pos.stage * kStageBytes, chunks + into * kChunkBytes, j % 2);
    if (j % 2 == 1) {
      sm90::mbar_arrive(&empty[pos.stage]);
      pos.advance<STAGES>();
    }
    sm90::fence_proxy_async_smem();  // the generic-proxy writes, visible to wgmma
    sm90::named_barrier(kConvertBarrier, kConsumerThreads);
  };
  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    int mt, nt;
    tg::raster(t, tile_prefix, p.num_groups, tiles_n, mt, nt);
    const RaggedTile tile = locate_ragged_tile<BM>(tile_prefix, p.splits, p.offsets, p.num_groups, mt);
    const int64_t n0 = static_cast<int64_t>(nt) * BN;
    const int nchunks = 2 * ktiles;
    tg::Acc<OutTile, 1> acc;
    tg::zero_acc<OutTile, 1>(acc);  // ends the previous tile's accumulators' lives (see tg::consume)
    convert_and_publish(0, buf);
    for (int j = 0; j < nchunks; ++j) {
      const uint32_t at = sm90::smem_addr(chunks + buf * kChunkBytes);
      sm90::fence_registers(acc[0]);
      sm90::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < CK / 16; ++kk)
        sm90::Wgmma<__nv_bfloat16, BN>::template mma<0, 0>(
            acc[0], sm90::kmajor_sw128_desc(at + wg * tg::kAtomBytes + kk * 32),
            sm90::kmajor_sw128_desc(at + kChunkTileBytes + kk * 32), j > 0 || kk > 0);
      sm90::wgmma_commit();
      buf = buf == CBUFS - 1 ? 0 : buf + 1;
      if (j + 1 < nchunks) {
        sm90::wgmma_wait<1>();  // this warpgroup's MMAs of chunk j - 1 are done
        sm90::fence_registers(acc[0]);
        convert_and_publish(j + 1, buf);  // under the MMAs of chunk j
      }
    }
    sm90::wgmma_wait<0>();
    sm90::fence_registers(acc[0]);
    tg::finish_ragged_block<T, OutTile>(staging, acc, wg, tile, n0, &tp.c, static_cast<T*>(p.c), p.n,
                                        static_cast<const T*>(p.bias), p.bias_scale);
  }
  sm90::bulk_wait();
}

}  // namespace moegraph::kernels::mxfp8_dequant
