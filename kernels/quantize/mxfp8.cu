// MXFP8 quantize / dequantize kernels (launchers and layouts in mxfp8.hpp, rules in docs/mxfp8.md).
//
// Quantize: a persistent grid walks the 32 x 128 tiles of the used rows of each batch
// (activations: one batch; weights: one batch per expert). 32 rows make one column-wise block per
// column, 128 columns four row-wise blocks per row; each tile is read once. Two kernels, picked by
// quantize_variant() (a temporary A/B switch, mxfp8.hpp):
//   - register prefetch (variant 0, the original): row-major walk; each thread loads its 16
//     elements as two 16-byte vectors into registers, the next tile's before the current one is
//     converted. The row-wise copy is made from registers (a lane pair per block), the column-wise
//     one from a swizzled, double-buffered shared-memory transpose (a lane pair per block, 16 rows
//     each), one barrier per tile.
//   - staged (variants 1 and 2): the tile lands in shared memory by cp.async, kStages tiles per
//     block, so three tiles (24 KB) per block stay in flight without holding registers; both roles
//     read the same swizzled tile. Variant 2 walks the tiles in bands of row tiles (locate_tile_banded).
// Why the staged kernel, hypothesis by hypothesis (measured on an H100: 1686-2312 GB/s, 0.54-0.73
// of the copy bandwidth, the 7168-column shapes worst):
//   1. The group look-up (a dependent binary search in global memory, only with splits) no longer
//      sits between a tile's consumption and the next tile's loads: it runs when a tile three steps
//      ahead is issued, and with a column-wise copy once per tile (every group starts on a multiple
//      of 32, so a tile lies in one group) at one address for the whole block. Row-wise alone keeps
//      the per-row search: row_align 1 groups may start inside a tile. Probably a small term: the
//      shapes with more groups (longer searches) were not the slower ones.
//   2. Bytes in flight: 24 KB per block instead of 8 KB (and no registers for them), 144 KB per SM
//      at six blocks, more than the copy kernel of tools/bench keeps (128 KB) at 2.8 TB/s.
//   3. Write locality (variant 2): the column-wise copy [cols, rows] takes 32 bytes per column per
//      tile at a stride of `rows`. A row-major walk over 56 column tiles (7168 columns) covers about
//      14 row tiles per wave of 792 resident blocks, so each column gets 448 B per wave, spread over
//      7168 columns (DRAM pages); at 4096 and 2048 columns it is 792 B and 1584 B, the same order as
//      the measured bandwidths. Bands of 32 row tiles give 1 KB (eight whole 128-byte lines) per
//      column per wave at any width while the input and the row-wise copy keep 6.4 KB and 3.2 KB
//      runs per row, and a 128-byte line of the column-wise copy gets its four sectors from four
//      consecutive tiles, which run at the same time on neighbouring blocks. Variant 1 (the staged
//      kernel on the row-major walk) tells this apart from hypotheses 1, 2 and 4.
//   4. Scale stores: the four row-wise scale bytes of a tile row, and four column-wise ones, go out
//      as one 32-bit store (when the layout keeps them 4-byte aligned), not one byte per lane pair.
//
// This file must be compiled without flush-to-zero (no -ftz=true / --use_fast_math): bf16
// subnormal inputs and the 2^-127 scale are fp32 subnormals, and the rules keep them exact.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "kernels/common/cp_async.cuh"
#include "kernels/common/dtype_dispatch.cuh"
#include "kernels/common/row_lanes.cuh"
#include "kernels/quantize/mxfp8.hpp"
#include "moegraph/error.hpp"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#error "mxfp8.cu needs sm_89 or newer: the E4M3 conversions are the hardware cvt instructions"
#endif

namespace moegraph::kernels {
namespace {

constexpr int kThreads = 256;
// Six resident blocks per SM (40 registers; 96 KB of double-buffered tiles, staged: 192 KB of
// stages): enough 16-byte loads in flight to cover HBM latency.
constexpr int kMinBlocksPerSm = 6;
constexpr int kTileRows = kMxBlock;               // one column-wise block per column
constexpr int kTileCols = 128;                    // four row-wise blocks per row
constexpr int kChunk = 16;                        // elements per thread: two 16-byte vectors
constexpr int kChunksPerRow = kTileCols / kChunk;  // 8
constexpr int kUnitsPerRow = kTileCols * 2 / 16;  // 16-byte units in a tile row of 16-bit elements
// Staged kernel: tiles of shared memory per block (8 KB each); kStages - 1 are in flight while one
// is converted. 6 blocks x 32 KB = 192 KB of the 228 KB per SM (the driver sizes the carveout).
constexpr int kStages = 4;
// Variant 2: row tiles per band (1024 rows); see hypothesis 3 above.
constexpr uint32_t kBandRowTiles = 32;
static_assert(kTileRows * kChunksPerRow == kThreads, "row role: one 16-element chunk per thread");
static_assert(kTileCols * 2 == kThreads, "column role: one half column (16 rows) per thread");
static_assert(2 * kChunk == kMxBlock, "a lane pair holds one block in either role");

// ---- The format rules, shared by every kernel ---------------------------------------------------

// 16-bit inputs as raw bits: |bits| (sign cleared) orders finite magnitudes, and
// |bits| >= kNonFinite is ±Inf or NaN.
template <class T>
struct Format16;
template <>
struct Format16<__nv_bfloat16> {
  static constexpr uint32_t kNonFinite = 0x7f80u;
  static __device__ __forceinline__ float to_float(uint32_t bits) { return __uint_as_float(bits << 16); }
};
template <>
struct Format16<__half> {
  static constexpr uint32_t kNonFinite = 0x7c00u;
  static __device__ __forceinline__ float to_float(uint32_t bits) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
};

// E8M0 byte of a block with finite amax: the smallest e with amax <= 448 * 2^e, clamped into
// [-127, 127], plus 127. With amax = 1.f * 2^p that is p - 8 when 1.f <= 1.75 (448 = 1.75 * 2^8),
// else p - 7. An amax below 2^-126 (zero, or an fp32 subnormal) needs e <= -134: byte 0.
__device__ __forceinline__ uint32_t mx_scale_byte(float amax) {
  const uint32_t bits = __float_as_uint(amax);
  const int biased = static_cast<int>(bits >> 23);
  if (biased == 0) return 0;
  const int e = biased - 127 - 8 + ((bits & 0x7fffffu) > 0x600000u ? 1 : 0);
  return static_cast<uint32_t>(min(max(e, -127), 127) + 127);
}

// 2^(127 - byte) for a byte in [0, 254]: multiplying by it divides by the scale exactly (as long
// as the quotient stays an fp32 normal; smaller quotients encode to ±0 either way).
__device__ __forceinline__ float mx_inverse_scale(uint32_t byte) {
  return byte == 254 ? __uint_as_float(0x00400000u) : __uint_as_float((254u - byte) << 23);
}

// 2^(byte - 127); NaN for 0xFF. 2^-127 is an fp32 subnormal.
__device__ __forceinline__ float mx_scale_value(uint32_t byte) {
  if (byte == kE8m0NaN) return __uint_as_float(0x7fffffffu);
  return byte == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(byte << 23);
}

// Two fp32 values -> two E4M3 bytes, `lo` in the low byte: round to nearest even (subnormals
// kept; a value that rounds to zero keeps its sign), magnitudes past 448 saturate to ±448,
// NaN -> 0x7F. One hardware conversion: cvt.rn.satfinite.e4m3x2.f32.
__device__ __forceinline__ uint32_t encode_e4m3x2(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

// Two E4M3 bytes (the low one in .x) -> fp32, exactly (E4M3 is a subset of fp16); NaN codes give NaN.
__device__ __forceinline__ float2 decode_e4m3x2(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
  return __half22float2(__half2(h));
}

// |bits| maximum of 16 elements held as 8 words (element 2i in the low half of word i).
__device__ __forceinline__ uint32_t abs_bits_max16(const uint32_t (&w)[8]) {
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = __vmaxu2(m, w[i] & 0x7fff7fffu);
  return max(m & 0xffffu, m >> 16);
}

// The scale byte of a block from the |bits| maximum of its elements: NaN when any is ±Inf or NaN.
template <class T>
__device__ __forceinline__ uint32_t block_scale_byte(uint32_t abs_bits_max) {
  if (abs_bits_max >= Format16<T>::kNonFinite) return kE8m0NaN;
  return mx_scale_byte(Format16<T>::to_float(abs_bits_max));
}

// 16 elements of a block with scale `byte` -> 16 E4M3 bytes (element i in byte i).
template <class T>
__device__ __forceinline__ uint4 encode16(const uint32_t (&w)[8], uint32_t byte) {
  constexpr uint32_t kNaN4 = kE4m3NaN * 0x01010101u;
  if (byte == kE8m0NaN) return make_uint4(kNaN4, kNaN4, kNaN4, kNaN4);
  const float inv = mx_inverse_scale(byte);
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t a = w[2 * i], b = w[2 * i + 1];
    const uint32_t lo = encode_e4m3x2(Format16<T>::to_float(a & 0xffffu) * inv, Format16<T>::to_float(a >> 16) * inv);
    const uint32_t hi = encode_e4m3x2(Format16<T>::to_float(b & 0xffffu) * inv, Format16<T>::to_float(b >> 16) * inv);
    out[i] = lo | (hi << 16);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// ---- Quantize -------------------------------------------------------------------------------

struct QuantizeArgs {
  const uint16_t* x = nullptr;       // [batches, rows, cols] bf16 or fp16 bits
  int64_t rows = 0, cols = 0;        // rows: the capacity (stride of batches and of column-wise data)
  int batches = 1;
  const int64_t* used_rows = nullptr;  // device: rows [0, *used_rows) of each batch; null: all rows
  // Optional: rows of group e past offsets[e] + splits[e] (alignment gaps) read as zero, whatever
  // the input holds there, as every grouped kernel treats them.
  const int64_t* offsets = nullptr;
  const int32_t* splits = nullptr;
  int groups = 0;
  Mxfp8Rowwise rowwise;              // [batches, rows, cols] and [batches, rows, cols / 32]
  Mxfp8Colwise colwise;              // [batches, cols, rows] and scales, see block_major_scales
  // Column-wise scales: block-major [batches, rows / 32, cols] (activations: what the wgrad GEMM
  // reads), or [batches, cols, rows / 32] (weights: the transposed copy is W_e^T row-wise for dgrad).
  bool block_major_scales = false;
  // Staged kernel: four scale bytes per 32-bit store. Row-wise: cols % 128 == 0 (whole tiles, and
  // rows of cols / 32 scales keep a tile's four 4-byte aligned) and a 4-byte aligned scales pointer;
  // column-wise: block-major scales (four consecutive columns) and a 4-byte aligned pointer.
  bool pack_row_scales = false, pack_col_scales = false;
};

struct Tile {
  int64_t batch, row0, col0;
  uint32_t row_tile;
};

// Tile t of the row-major walk (the launcher checks that the tile count fits 32 bits).
__device__ __forceinline__ Tile locate_tile(uint32_t t, uint32_t row_tiles, uint32_t col_tiles) {
  const uint32_t per_batch = row_tiles * col_tiles;
  const uint32_t batch = t / per_batch, rem = t - batch * per_batch;
  const uint32_t row_tile = rem / col_tiles, col_tile = rem - row_tile * col_tiles;
  return Tile{batch, int64_t{row_tile} * kTileRows, int64_t{col_tile} * kTileCols, row_tile};
}

// Tile t of a walk in bands of `band` row tiles (the last band of a batch may be shorter): down the
// band's rows of one 128-column strip, then the next strip. band 1 is the row-major walk.
// band * col_tiles fits 32 bits: check_and_quantize bounds the column tiles. One batch (the
// activations) saves a division.
__device__ __forceinline__ Tile locate_tile_banded(uint32_t t, uint32_t row_tiles, uint32_t col_tiles, uint32_t band,
                                                   int batches) {
  const uint32_t per_batch = row_tiles * col_tiles;
  const uint32_t batch = batches == 1 ? 0 : t / per_batch;
  uint32_t rem = t - batch * per_batch;
  const uint32_t per_band = band * col_tiles;
  const uint32_t band_index = rem / per_band;
  rem -= band_index * per_band;
  const uint32_t first_row_tile = band_index * band, height = min(band, row_tiles - first_row_tile);
  const uint32_t col_tile = rem / height, row_tile = first_row_tile + (rem - col_tile * height);
  return Tile{batch, int64_t{row_tile} * kTileRows, int64_t{col_tile} * kTileCols, row_tile};
}

// Whether row r (below the used rows) holds data given the splits: rows of group e past
// offsets[e] + splits[e] are alignment gaps. The group is the one that holds row `probe` (the
// largest e with offsets[e] <= probe): r itself, or any row of r's group.
__device__ __forceinline__ bool inside_split(const QuantizeArgs& a, int64_t probe, int64_t r) {
  int lo = 0, hi = a.groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (a.offsets[mid] <= probe) lo = mid; else hi = mid - 1;
  }
  const int64_t span = a.offsets[lo + 1] - a.offsets[lo], split = a.splits[lo];
  return r - a.offsets[lo] < (split < 0 ? 0 : split > span ? span : split);
}

// The 16 elements [col, col + 16) of tile row `row` as two 16-byte vectors; zeros past the used
// rows or the columns (nothing is read there).
__device__ __forceinline__ void load_chunk(const QuantizeArgs& a, const Tile& t, int64_t used, int row, int col,
                                           uint4 (&v)[2]) {
  const int64_t r = t.row0 + row, c = t.col0 + col;
  bool data = r < used && c < a.cols;
  if (data && a.splits != nullptr) data = inside_split(a, r, r);
  if (data) {
    const uint4* src = reinterpret_cast<const uint4*>(a.x + (t.batch * a.rows + r) * a.cols + c);
    v[0] = __ldg(src);
    v[1] = __ldg(src + 1);
  } else {
    v[0] = v[1] = make_uint4(0u, 0u, 0u, 0u);
  }
}

// Shared tile (kTileRows, kTileCols) of 16-bit elements as 16-byte units. Flipping bit 0 of the
// upper eight units spreads each eight-lane phase of the row role's 16-byte stores (units 2k, or
// 2k + 1, of one row) over all banks; flipping bit 1 for rows 16..31 puts the column role's reads
// (16 columns of rows i and 16 + i per warp) on four distinct bank groups.
__device__ __forceinline__ int swizzled_unit(int row, int unit) {
  return row * kUnitsPerRow + (unit ^ ((unit >> 3) & 1) ^ (((row >> 4) & 1) << 1));
}

// Row role: this thread's 16 elements and its neighbour lane's (thread ^ 1) form one block.
// kPackScales (staged kernel): where a.pack_row_scales allows, the eight lanes of a tile row
// gather their four scale bytes and the first one stores them as one word.
template <class T, bool kPackScales>
__device__ __forceinline__ void quantize_row_chunk(const QuantizeArgs& a, const Tile& t, int64_t used, int row,
                                                   int col, const uint4 (&v)[2]) {
  const uint32_t w[8] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w};
  uint32_t m = abs_bits_max16(w);
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
  const int64_t r = t.row0 + row, c = t.col0 + col;
  const bool packed = kPackScales && a.pack_row_scales;  // uniform: the shuffles below are legal
  uint32_t byte = 0, word = 0;
  if (packed) {  // block (lane / 2) % 4 of the row puts its byte in byte (lane / 2) % 4
    byte = block_scale_byte<T>(m);
    word = byte << (8 * ((threadIdx.x >> 1) & 3));
    word |= __shfl_xor_sync(0xffffffffu, word, 2);
    word |= __shfl_xor_sync(0xffffffffu, word, 4);
  }
  if (r >= used || c >= a.cols) return;
  if (!packed) byte = block_scale_byte<T>(m);
  const int64_t at = (t.batch * a.rows + r) * a.cols + c;
  *reinterpret_cast<uint4*>(a.rowwise.data + at) = encode16<T>(w, byte);
  if (packed) {
    if ((threadIdx.x & 7) == 0) *reinterpret_cast<uint32_t*>(a.rowwise.scales + at / kMxBlock) = word;
  } else if ((threadIdx.x & 1) == 0) {
    a.rowwise.scales[at / kMxBlock] = static_cast<uint8_t>(byte);
  }
}

// Column role: rows [16 * half, 16 * half + 16) of tile column `col`; lane ^ 16 holds the other half.
// kPackScales (staged kernel): where a.pack_col_scales allows, four consecutive columns (lanes)
// gather their scale bytes and the first one stores them as one word.
template <class T, bool kPackScales>
__device__ __forceinline__ void quantize_column_half(const QuantizeArgs& a, const Tile& t, int64_t used,
                                                     const uint4* tile, int col, int half) {
  const uint16_t* elems = reinterpret_cast<const uint16_t*>(tile);
  uint32_t w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = half * 16 + 2 * i;
    const uint32_t even = elems[swizzled_unit(r, col / 8) * 8 + col % 8];
    const uint32_t odd = elems[swizzled_unit(r + 1, col / 8) * 8 + col % 8];
    w[i] = even | (odd << 16);
  }
  uint32_t m = abs_bits_max16(w);
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 16));
  const int64_t c = t.col0 + col;
  const bool packed = kPackScales && a.pack_col_scales;  // uniform: the shuffles below are legal
  uint32_t byte = 0, word = 0;
  if (packed) {  // column col % 4 puts its byte in byte col % 4 (col % 4 == lane % 4)
    byte = block_scale_byte<T>(m);
    word = byte << (8 * (col & 3));
    word |= __shfl_xor_sync(0xffffffffu, word, 1);
    word |= __shfl_xor_sync(0xffffffffu, word, 2);
  }
  // cols % 16 == 0 here, so four columns starting at a multiple of 4 are all inside or all past it.
  if (c >= a.cols) return;
  if (!packed) byte = block_scale_byte<T>(m);
  const uint4 q = encode16<T>(w, byte);
  const int64_t r0 = t.row0 + half * 16;
  uint8_t* dst = a.colwise.data + (t.batch * a.cols + c) * a.rows + r0;
  if (r0 + 16 <= used) {
    *reinterpret_cast<uint4*>(dst) = q;
  } else {  // the last block of an offsets[G] that is not a multiple of 32: rows below it only
#pragma unroll
    for (int i = 0; i < 16; ++i)
      if (r0 + i < used) dst[i] = static_cast<uint8_t>(word_of(q, i / 4) >> (8 * (i % 4)));
  }
  const int64_t blocks = a.rows / kMxBlock;
  const int64_t at = a.block_major_scales ? (t.batch * blocks + t.row_tile) * a.cols + c
                                          : (t.batch * a.cols + c) * blocks + t.row_tile;
  if (packed) {
    if (half == 0 && (col & 3) == 0) *reinterpret_cast<uint32_t*>(a.colwise.scales + at) = word;
  } else if (half == 0) {
    a.colwise.scales[at] = static_cast<uint8_t>(byte);
  }
}

template <class T, bool kRow, bool kCol>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) quantize_mxfp8_kernel(const QuantizeArgs a,
                                                                                   const uint32_t band) {
  // Column role's transpose, double-buffered: (kTileRows, kTileCols) elements, swizzled units.
  __shared__ uint4 shared_tiles[kCol ? 2 : 1][kCol ? kTileRows * kUnitsPerRow : 1];
  const int64_t used = a.used_rows == nullptr ? a.rows : min(max(*a.used_rows, int64_t{0}), a.rows);
  const uint32_t row_tiles = static_cast<uint32_t>((used + kTileRows - 1) / kTileRows);
  const uint32_t col_tiles = static_cast<uint32_t>((a.cols + kTileCols - 1) / kTileCols);
  const uint32_t total = row_tiles * col_tiles * static_cast<uint32_t>(a.batches);
  if (blockIdx.x >= total) return;  // uniform over the block

  const int lane = threadIdx.x & 31;
  const int chunk_row = threadIdx.x / kChunksPerRow, chunk_col = threadIdx.x % kChunksPerRow * kChunk;
  const int col = threadIdx.x / 32 * 16 + (lane & 15), half = lane >> 4;  // column role

  Tile tile = locate_tile_banded(blockIdx.x, row_tiles, col_tiles, band, a.batches);
  uint4 v[2];
  load_chunk(a, tile, used, chunk_row, chunk_col, v);
  int buf = 0;
  for (uint32_t t = blockIdx.x; t < total; t += gridDim.x) {
    // The next tile's loads go out first and stay in flight while this tile is converted.
    const uint32_t next = t + gridDim.x;
    Tile next_tile = tile;
    uint4 next_v[2] = {};
    if (next < total) {
      next_tile = locate_tile_banded(next, row_tiles, col_tiles, band, a.batches);
      load_chunk(a, next_tile, used, chunk_row, chunk_col, next_v);
    }
    if constexpr (kCol) {
      shared_tiles[buf][swizzled_unit(chunk_row, chunk_col / 8)] = v[0];
      shared_tiles[buf][swizzled_unit(chunk_row, chunk_col / 8 + 1)] = v[1];
    }
    if constexpr (kRow) quantize_row_chunk<T, false>(a, tile, used, chunk_row, chunk_col, v);
    if constexpr (kCol) {
      // One barrier per tile: a thread writes buffer `buf` again two tiles later, after every
      // thread has passed the next tile's barrier, so after every read of this tile.
      __syncthreads();
      quantize_column_half<T, false>(a, tile, used, shared_tiles[buf], col, half);
      buf ^= 1;
    }
    tile = next_tile;
    v[0] = next_v[0];
    v[1] = next_v[1];
  }
}

// Staged: cp.async copies of tile `t` into `stage` (kTileRows, kTileCols), swizzled as the roles
// read it. This thread copies units `unit` and `unit + 8` of tile row `row`, so each warp instruction
// moves four whole 128-byte lines (four rows, 128 contiguous bytes each); rows past the used ones,
// alignment-gap rows and columns past the end are zero-filled (nothing is read there).
// kTileInOneGroup: the tile lies in one group (column-wise copies need 32-aligned group starts),
// so the group look-up probes the tile's first row, the same address for the whole block.
template <bool kTileInOneGroup>
__device__ __forceinline__ void issue_tile(const QuantizeArgs& a, const Tile& t, int64_t used, uint4* stage, int row,
                                           int unit) {
  const int64_t r = t.row0 + row;
  bool data = r < used;
  if (data && a.splits != nullptr) data = inside_split(a, kTileInOneGroup ? t.row0 : r, r);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int u = unit + 8 * k;
    const int64_t c = t.col0 + u * 8;
    const bool copy = data && c < a.cols;  // cols % 16 == 0: a unit is wholly inside or past the end
    const uint16_t* src = copy ? a.x + (t.batch * a.rows + r) * a.cols + c : a.x;
    cp_async_16(stage + swizzled_unit(row, u), src, copy);
  }
}

template <class T, bool kRow, bool kCol>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    quantize_mxfp8_staged_kernel(const QuantizeArgs a, const uint32_t band) {
  __shared__ uint4 stages[kStages][kTileRows * kUnitsPerRow];  // (kTileRows, kTileCols) each, swizzled units
  // Where each stage's tile lies: located once, when its copies are issued (the walk's two or
  // three integer divisions are a noticeable share of a tile's instructions).
  __shared__ Tile stage_tiles[kStages];
  const int64_t used = a.used_rows == nullptr ? a.rows : min(max(*a.used_rows, int64_t{0}), a.rows);
  const uint32_t row_tiles = static_cast<uint32_t>((used + kTileRows - 1) / kTileRows);
  const uint32_t col_tiles = static_cast<uint32_t>((a.cols + kTileCols - 1) / kTileCols);
  const uint32_t total = row_tiles * col_tiles * static_cast<uint32_t>(a.batches);
  if (blockIdx.x >= total) return;  // uniform over the block

  const int lane = threadIdx.x & 31;
  const int chunk_row = threadIdx.x / kChunksPerRow, chunk_col = threadIdx.x % kChunksPerRow * kChunk;
  const int copy_unit = threadIdx.x % kChunksPerRow;  // the copy's row is chunk_row
  const int col = threadIdx.x / 32 * 16 + (lane & 15), half = lane >> 4;  // column role

  // One commit per tile, an empty group past the end, so that "tile t has landed" is always
  // "at most kStages - 2 groups pending". t < total + kStages * gridDim.x < 2^32.
  const auto issue = [&](uint32_t t, int stage) {
    if (t < total) {
      const Tile tile = locate_tile_banded(t, row_tiles, col_tiles, band, a.batches);
      if (threadIdx.x == 0) stage_tiles[stage] = tile;
      issue_tile<kCol>(a, tile, used, stages[stage], chunk_row, copy_unit);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(blockIdx.x + s * gridDim.x, s);

  int stage = 0;
  for (uint32_t t = blockIdx.x; t < total; t += gridDim.x) {
    cp_async_wait<kStages - 2>();  // this thread's copies of tile t have landed
    // Everyone's have (and stage_tiles[stage] is visible), and every thread is done with tile
    // t - gridDim.x, whose stage (and stage_tiles entry) the copies of tile
    // t + (kStages - 1) * gridDim.x take next: one barrier per tile.
    __syncthreads();
    issue(t + (kStages - 1) * gridDim.x, stage == 0 ? kStages - 1 : stage - 1);
    const Tile tile = stage_tiles[stage];
    const uint4* shared_tile = stages[stage];
    if constexpr (kRow) {
      const uint4 v[2] = {shared_tile[swizzled_unit(chunk_row, chunk_col / 8)],
                          shared_tile[swizzled_unit(chunk_row, chunk_col / 8 + 1)]};
      quantize_row_chunk<T, true>(a, tile, used, chunk_row, chunk_col, v);
    }
    if constexpr (kCol) quantize_column_half<T, true>(a, tile, used, shared_tile, col, half);
    stage = stage == kStages - 1 ? 0 : stage + 1;
  }
}

template <class T, bool kRow, bool kCol>
void launch_quantize(const QuantizeArgs& a, int variant, cudaStream_t stream) {
  const int64_t max_tiles = a.batches * ((a.rows + kTileRows - 1) / kTileRows) * ((a.cols + kTileCols - 1) / kTileCols);
  if (variant == kQuantizeRegisterPrefetch || variant == kQuantizeRegisterBands) {
    const int blocks_per_sm = resident_blocks_per_sm(quantize_mxfp8_kernel<T, kRow, kCol>, kThreads);
    const uint32_t band = variant == kQuantizeRegisterBands ? kBandRowTiles : 1;
    quantize_mxfp8_kernel<T, kRow, kCol><<<grid_blocks(max_tiles, blocks_per_sm), kThreads, 0, stream>>>(a, band);
  } else {
    const int blocks_per_sm = resident_blocks_per_sm(quantize_mxfp8_staged_kernel<T, kRow, kCol>, kThreads);
    const uint32_t band = variant == kQuantizeStagedBands ? kBandRowTiles : 1;
    quantize_mxfp8_staged_kernel<T, kRow, kCol><<<grid_blocks(max_tiles, blocks_per_sm), kThreads, 0, stream>>>(a, band);
  }
  MG_LAUNCH_CHECK();
}

template <class T>
void launch_quantize_layouts(const QuantizeArgs& a, int variant, cudaStream_t stream) {
  const bool row = a.rowwise.data != nullptr, col = a.colwise.data != nullptr;
  if (row && col) launch_quantize<T, true, true>(a, variant, stream);
  else if (row) launch_quantize<T, true, false>(a, variant, stream);
  else launch_quantize<T, false, true>(a, variant, stream);
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }
bool aligned4(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 4 == 0; }

// The temporary A/B switch (mxfp8.hpp): a forced variant, else the environment's, read once.
std::atomic<int> forced_variant{-1};

int variant_from_environment() {
  const char* env = std::getenv("MOEGRAPH_QUANTIZE_VARIANT");
  if (env == nullptr || *env == '\0') return kQuantizeStagedBands;
  const std::string v = env;
  MG_CHECK(v == "0" || v == "1" || v == "2" || v == "3", "MOEGRAPH_QUANTIZE_VARIANT must be 0 to 3, got '", v, "'");
  return v[0] - '0';
}

// Checks shared by the activation and weight quantizers (`rows_name`: what a.rows is called),
// then the launch.
void check_and_quantize(const char* who, const char* rows_name, DType in, QuantizeArgs a, const Mxfp8Rowwise* rowwise,
                        const Mxfp8Colwise* colwise, cudaStream_t stream) {
  MG_CHECK(rowwise != nullptr || colwise != nullptr, who, ": needs a row-wise or a column-wise output (both null)");
  MG_CHECK(a.x != nullptr && aligned16(a.x), who, ": the input must be a 16-byte aligned device pointer");
  MG_CHECK(a.rows >= 0 && a.cols > 0 && a.batches >= 1, who, ": bad shape ", a.batches, " x ", a.rows, " x ", a.cols);
  const int64_t max_tiles = a.batches * ((a.rows + kTileRows - 1) / kTileRows) * ((a.cols + kTileCols - 1) / kTileCols);
  MG_CHECK(max_tiles < (int64_t{1} << 31), who, ": ", max_tiles, " tiles of 32 x 128 are more than 2^31");
  MG_CHECK((a.cols + kTileCols - 1) / kTileCols * kBandRowTiles < (int64_t{1} << 32), who, ": ", a.cols,
           " columns are too many for the banded walk's 32-bit tile arithmetic");
  if (rowwise != nullptr) {
    MG_CHECK(a.cols % kMxBlock == 0, who, ": row-wise blocks need the row length to be a multiple of 32, got ", a.cols);
    MG_CHECK(rowwise->data != nullptr && aligned16(rowwise->data) && rowwise->scales != nullptr, who,
             ": the row-wise output needs a 16-byte aligned data pointer and a scales pointer");
    a.rowwise = *rowwise;
    a.pack_row_scales = a.cols % kTileCols == 0 && aligned4(rowwise->scales);
  }
  if (colwise != nullptr) {
    MG_CHECK(a.rows % kMxBlock == 0, who, ": column-wise blocks need ", rows_name, " to be a multiple of 32, got ",
             a.rows);
    MG_CHECK(a.cols % 16 == 0, who, ": the row length must be a multiple of 16, got ", a.cols);
    MG_CHECK(colwise->data != nullptr && aligned16(colwise->data) && colwise->scales != nullptr, who,
             ": the column-wise output needs a 16-byte aligned data pointer and a scales pointer");
    a.colwise = *colwise;
    a.pack_col_scales = a.block_major_scales && aligned4(colwise->scales);
  }
  const int variant = quantize_variant();
  with_16bit_type(in, who, [&](auto t) { launch_quantize_layouts<decltype(t)>(a, variant, stream); });
}

// ---- Dequantize (row-wise) --------------------------------------------------------------------

template <class Out>
__device__ __forceinline__ void store16(Out* dst, const float (&v)[16]) {
  alignas(16) Out out[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) out[i] = static_cast<Out>(v[i]);  // round to nearest even
#pragma unroll
  for (int j = 0; j < static_cast<int>(sizeof(out) / 16); ++j)
    reinterpret_cast<uint4*>(dst)[j] = reinterpret_cast<const uint4*>(out)[j];
}

// Grid-stride over the 16-element chunks of the used rows (two chunks per block). The flat
// element index is row * cols + col and cols is a multiple of 32, so chunk i has scale i / 2.
template <class Out>
__global__ void __launch_bounds__(kThreads) dequantize_mxfp8_rowwise_kernel(const uint8_t* __restrict__ data,
                                                                           const uint8_t* __restrict__ scales,
                                                                           Out* __restrict__ y, int64_t rows,
                                                                           int64_t cols, const int64_t* used_rows) {
  const int64_t used = min(max(*used_rows, int64_t{0}), rows);
  const int64_t chunks = used * cols / kChunk;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(data) + i);
    const float s = mx_scale_value(__ldg(scales + i / 2));
    float v[16];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t w = word_of(q, j);
      const float2 lo = decode_e4m3x2(w & 0xffffu), hi = decode_e4m3x2(w >> 16);
      v[4 * j] = lo.x * s;  // exact in fp32 (or ±Inf past its range)
      v[4 * j + 1] = lo.y * s;
      v[4 * j + 2] = hi.x * s;
      v[4 * j + 3] = hi.y * s;
    }
    store16(y + i * kChunk, v);
  }
}

template <class Out>
void launch_dequantize(const uint8_t* data, const uint8_t* scales, void* y, int64_t rows, int64_t cols,
                       const int64_t* used_rows, cudaStream_t stream) {
  const int blocks_per_sm = resident_blocks_per_sm(dequantize_mxfp8_rowwise_kernel<Out>, kThreads);
  const int64_t max_blocks = (rows * cols / kChunk + kThreads - 1) / kThreads;
  dequantize_mxfp8_rowwise_kernel<Out><<<grid_blocks(max_blocks, blocks_per_sm), kThreads, 0, stream>>>(
      data, scales, static_cast<Out*>(y), rows, cols, used_rows);
  MG_LAUNCH_CHECK();
}

}  // namespace

int quantize_variant() {
  const int forced = forced_variant.load(std::memory_order_relaxed);
  if (forced >= 0) return forced;
  static const int from_environment = variant_from_environment();
  return from_environment;
}

int set_quantize_variant_for_testing(int variant) {
  MG_CHECK(variant >= -1 && variant < kQuantizeVariants, "set_quantize_variant_for_testing: the variant must be -1 .. ",
           kQuantizeVariants - 1, ", got ", variant);
  return forced_variant.exchange(variant, std::memory_order_relaxed);
}

const char* quantize_variant_name(int variant) {
  switch (variant) {
    case kQuantizeRegisterPrefetch: return "register prefetch";
    case kQuantizeStagedRowMajor: return "staged row-major";
    case kQuantizeStagedBands: return "staged bands";
    case kQuantizeRegisterBands: return "register bands";
  }
  return "unknown";
}

void launch_quantize_mxfp8(DType in, const void* x, int64_t capacity_rows, int64_t cols, const int64_t* offsets,
                           const int32_t* splits, int groups, const Mxfp8Rowwise* rowwise,
                           const Mxfp8Colwise* colwise, cudaStream_t stream) {
  constexpr const char* kWho = "launch_quantize_mxfp8";
  MG_CHECK(cols % kMxBlock == 0, kWho, ": cols must be a multiple of 32, got ", cols);
  MG_CHECK(offsets != nullptr && groups >= 0, kWho, ": needs the device offsets [groups + 1], groups = ", groups);
  QuantizeArgs a;
  a.x = static_cast<const uint16_t*>(x);
  a.rows = capacity_rows;
  a.cols = cols;
  a.used_rows = offsets + groups;
  a.offsets = offsets;
  a.splits = splits;
  a.groups = groups;
  a.block_major_scales = true;
  check_and_quantize(kWho, "capacity_rows", in, a, rowwise, colwise, stream);
}

void launch_quantize_mxfp8_weights(DType in, const void* w, int groups, int64_t n, int64_t k,
                                   const Mxfp8Rowwise* rowwise, const Mxfp8Colwise* colwise, cudaStream_t stream) {
  constexpr const char* kWho = "launch_quantize_mxfp8_weights";
  MG_CHECK(groups >= 1 && n >= 1, kWho, ": needs groups >= 1 and n >= 1, got ", groups, " and ", n);
  MG_CHECK(k % 16 == 0, kWho, ": k must be a multiple of 16, got ", k);
  QuantizeArgs a;
  a.x = static_cast<const uint16_t*>(w);
  a.rows = n;
  a.cols = k;
  a.batches = groups;
  check_and_quantize(kWho, "n", in, a, rowwise, colwise, stream);
}

void launch_dequantize_mxfp8_rowwise(const uint8_t* data, const uint8_t* scales, DType out, void* y,
                                     int64_t capacity_rows, int64_t cols, const int64_t* offsets, int groups,
                                     cudaStream_t stream) {
  constexpr const char* kWho = "launch_dequantize_mxfp8_rowwise";
  MG_CHECK(capacity_rows >= 0 && cols > 0 && cols % kMxBlock == 0, kWho,
           ": needs capacity_rows >= 0 and cols a positive multiple of 32, got ", capacity_rows, " x ", cols);
  MG_CHECK(offsets != nullptr && groups >= 0, kWho, ": needs the device offsets [groups + 1], groups = ", groups);
  MG_CHECK(data != nullptr && aligned16(data) && scales != nullptr && y != nullptr && aligned16(y), kWho,
           ": data and y must be 16-byte aligned device pointers, scales non-null");
  const int64_t* used_rows = offsets + groups;
  switch (out) {
    case DType::kBF16: launch_dequantize<__nv_bfloat16>(data, scales, y, capacity_rows, cols, used_rows, stream); break;
    case DType::kFP16: launch_dequantize<__half>(data, scales, y, capacity_rows, cols, used_rows, stream); break;
    case DType::kFP32: launch_dequantize<float>(data, scales, y, capacity_rows, cols, used_rows, stream); break;
  }
}

}  // namespace moegraph::kernels
