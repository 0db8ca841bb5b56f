// MXFP8 quantize / dequantize kernels (launchers and layouts in mxfp8.hpp, rules in docs/mxfp8.md).
//
// Quantize: a persistent grid walks the 32 x 128 tiles of the used rows of each batch
// (activations: one batch; weights: one batch per expert). 32 rows make one column-wise block per
// column, 128 columns four row-wise blocks per row. Each tile is read once, as 16-byte vectors
// into registers: the row-wise copy is made from registers (a lane pair per block), the
// column-wise one from a swizzled shared-memory transpose (a lane pair per block, 16 rows each).
// The next tile's vectors are loaded before the current one is converted, and the shared tile is
// double-buffered, so one barrier per tile suffices.
//
// The weights' tiles are walked in bands of kBandRowTiles = 32 row tiles (locate_tile_banded): down
// the band within one 128-column strip, then the next strip. Why: their column-wise copy [cols,
// rows] gets 32 bytes per column from each tile; a row-major walk at 7168 columns (56 column
// tiles) covers about 14 row tiles per wave of resident blocks, so 448 B per column per wave, while
// bands give ~1 KB (eight whole 128-byte lines) per column per wave at any width. Measured on an
// H100 (row-major -> bands, ms; fraction of a same-size copy): 32768 x 7168 0.574 -> 0.508 (0.56 -> 0.64), the same
// with 256 groups 0.588 -> 0.538 (0.65 -> 0.71); 16384 x 4096 0.125 -> 0.121 (0.75 -> 0.78) and
// 0.138 -> 0.135; 32768 x 2048 0.125 both (0.85); 32000 x 2048 0.126 -> 0.124; 768 x 4096 0.011
// both. A cp.async-staged kernel on the same bands was 3% faster on one 7168-column shape (0.523)
// and 6-8% slower at 2048 and 4096 columns, so it was dropped. (Those numbers are for activations
// in the same [cols, rows] layout, as they were stored then.)
// The activations' column-wise copy is tiled (mxfp8.hpp): each tile writes one contiguous 4 KB run,
// so the bands no longer help it, and their walk makes the reads of x jump between rows. Activations
// are walked row-major. Measured on an H100 with the tiled layout, bands of 1 / 4 / 32 / 128 row
// tiles, two alternating runs (ms): 32768 x 7168 0.398 / 0.408 / 0.422 / 0.426, with 256 groups
// 0.446 / 0.448 / 0.462 / 0.470; 16384 x 4096 0.112 / 0.114 / 0.115 / 0.117; 32000 x 2048 0.115 /
// 0.115 / 0.117 / 0.116. Each block now takes a contiguous share of that row-major order
// (ContiguousWalk below says why).
//
// This file must be compiled without flush-to-zero (no -ftz=true / --use_fast_math): bf16
// subnormal inputs and the 2^-127 scale are fp32 subnormals, and the rules keep them exact.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common/alignment.hpp"
#include "kernels/common/device_error.cuh"
#include "kernels/common/dtype_dispatch.cuh"
#include "kernels/common/row_lanes.cuh"
#include "kernels/common/swiglu_math.cuh"
#include "kernels/quantize/mxfp8.hpp"
#include "moegraph/error.hpp"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#error "mxfp8.cu needs sm_89 or newer: the E4M3 conversions are the hardware cvt instructions"
#endif

namespace moegraph::kernels {
namespace {

constexpr int kThreads = 256;
// Six resident blocks per SM (40 registers, 96 KB of double-buffered tiles): enough 16-byte loads
// in flight to cover HBM latency.
constexpr int kMinBlocksPerSm = 6;
// With SwiGLU applied on the way in (Input::kSwiglu) a thread holds twice the loaded bytes.
constexpr int kSwigluBlocksPerSm = 4;
// With the SwiGLU's input gradient computed on the way in (Input::kSwigluGrad) a thread loads three
// chunks (gate, up, da) and makes two tiles' elements from them: ptxas spilled 12-80 bytes at three
// blocks' cap (80 registers), none at two's (128), which keep as many bytes in flight per SM (96 a
// thread) as six blocks of the plain kernel (32 a thread).
constexpr int kSwigluGradBlocksPerSm = 2;
// Writing the activations' column-wise values (kColValues) needs more registers than the codes:
// ptxas spilled about 70 bytes at six blocks' cap (40 registers) and 16-24 at five's (48), none at
// four's (64). Measured on one H200 (32768 x 2048 and x 1536, both copies as values; fraction of a
// same-size copy): six blocks 0.63-0.64, five 0.72-0.75, four 0.82-0.85.
constexpr int kColValuesBlocksPerSm = 4;
constexpr int kTileRows = kMxBlock;               // one column-wise block per column
constexpr int kTileCols = 128;                    // four row-wise blocks per row
constexpr int kChunk = 16;                        // elements per thread: two 16-byte vectors
constexpr int kChunksPerRow = kTileCols / kChunk;  // 8
constexpr int kUnitsPerRow = kTileCols * 2 / 16;  // 16-byte units in a tile row of 16-bit elements
// Row tiles per band of the weights' walk (1024 rows); activations take ContiguousWalk. See the
// top of this file.
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
  static __device__ __forceinline__ uint32_t from_float(float v) {  // round to nearest even, as static_cast
    return __bfloat16_as_ushort(static_cast<__nv_bfloat16>(v));
  }
};
template <>
struct Format16<__half> {
  static constexpr uint32_t kNonFinite = 0x7c00u;
  static __device__ __forceinline__ float to_float(uint32_t bits) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
  static __device__ __forceinline__ uint32_t from_float(float v) { return __half_as_ushort(static_cast<__half>(v)); }
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

// Four E4M3 bytes (element i in byte i) times the scale value s (mx_scale_value) -> fp32, exact (or
// ±Inf past fp32's range; NaN for a NaN code or scale). The one decoding rule: the dequantizers and
// the quantizer's bf16 values all use it, so they agree bit for bit.
__device__ __forceinline__ void decode4(uint32_t w, float s, float* v) {
  const float2 lo = decode_e4m3x2(w & 0xffffu), hi = decode_e4m3x2(w >> 16);
  v[0] = lo.x * s;
  v[1] = lo.y * s;
  v[2] = hi.x * s;
  v[3] = hi.y * s;
}
// 16 E4M3 bytes of a block with scale `byte` -> their values in fp32 (decode4).
__device__ __forceinline__ void decode16(const uint4& q, uint32_t byte, float (&v)[16]) {
  const float s = mx_scale_value(byte);
#pragma unroll
  for (int j = 0; j < 4; ++j) decode4(word_of(q, j), s, v + 4 * j);
}

// 16 fp32 values rounded to nearest even into `Out`, stored as 16-byte vectors (dst 16-byte aligned).
// The weights' column-wise values use it (outside the step; trading halves there made ptxas spill).
template <class Out>
__device__ __forceinline__ void store16(Out* dst, const float (&v)[16]) {
  alignas(16) Out out[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) out[i] = static_cast<Out>(v[i]);
#pragma unroll
  for (int j = 0; j < static_cast<int>(sizeof(out) / 16); ++j)
    reinterpret_cast<uint4*>(dst)[j] = reinterpret_cast<const uint4*>(out)[j];
}

// The row role's bf16 values (the staged route's A), stored as whole 32-byte sectors. Lanes 2j and
// 2j + 1 hold values [0, 16) and [16, 32) of one block; they trade halves (trade_pair_bf16, which
// every lane of the warp must call), so that each store instruction writes whole sectors
// (store_pair): the pair's [0, 16) from both lanes, then [16, 32). Why: with each lane storing its
// own 16 values as two 16-byte halves, every store instruction wrote half of each sector, as the
// row-wise dequantizer's did before its stores were made whole (docs/PERF.md, "MXFP8 dequantizer:
// whole sectors per store"); on one H200 the quantizer of x (32768 x 2048, values and column-wise
// codes) wrote 212 MB to DRAM in 100 us, 2.1 TB/s.
struct PairPieces {
  uint4 first, second;  // the pair's [0, 8) or [8, 16) (lower or upper lane), then [16, 24) or [24, 32)
};
__device__ __forceinline__ PairPieces trade_pair_bf16(bool upper, const float (&v)[16]) {
  uint32_t own[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const __nv_bfloat162 two = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    own[i] = *reinterpret_cast<const uint32_t*>(&two);
  }
  // The lower lane sends values [8, 16) and keeps [0, 8); the upper lane sends its first eight
  // (the pair's [16, 24)) and keeps its last eight (the pair's [24, 32)).
  uint32_t got[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) got[i] = __shfl_xor_sync(0xffffffffu, upper ? own[i] : own[4 + i], 1);
  const uint4 kept = upper ? make_uint4(own[4], own[5], own[6], own[7]) : make_uint4(own[0], own[1], own[2], own[3]);
  const uint4 traded = make_uint4(got[0], got[1], got[2], got[3]);
  return upper ? PairPieces{traded, kept} : PairPieces{kept, traded};
}
__device__ __forceinline__ void store_pair(__nv_bfloat16* pair_first, bool upper, const PairPieces& p) {
  uint4* dst = reinterpret_cast<uint4*>(pair_first) + (upper ? 1 : 0);
  dst[0] = p.first;
  dst[2] = p.second;
}

// ---- Quantize -------------------------------------------------------------------------------

// What the quantizer reads as its input element (QuantizeArgs::x and its companions).
enum class Input {
  kPlain,       // x itself
  kSwiglu,      // silu(gate) * up of x = gate | up (launch_quantize_mxfp8_swiglu)
  kSwigluGrad,  // dgate | dup of x = gate | up and da (launch_quantize_mxfp8_swiglu_grad)
};

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
  // Optional (activations, with splits): row r of the input is row source_rows[r] of x, for the
  // rows that hold data (launch_quantize_mxfp8_gathered); an entry at or past source_bound reads as
  // zeros and is reported to `error` (when not null).
  const int32_t* source_rows = nullptr;
  int64_t source_bound = 0;
  DeviceErrorRecord* error = nullptr;
  // Activations, one batch: kSwiglu (launch_quantize_mxfp8_swiglu): x is [rows, 2 * cols], each
  // row's gate then its up, and the input element is silu(gate) * up, times row_weight[r] where
  // that is given, rounded to the 16-bit type (input_chunk). kSwigluGrad
  // (launch_quantize_mxfp8_swiglu_grad): x is [rows, cols], gate | up, da is [rows, cols / 2], and
  // the input is dgate | dup, rounded as the SwiGLU backward kernel rounds it.
  Input input = Input::kPlain;
  const float* row_weight = nullptr;
  const uint16_t* da = nullptr;
  Mxfp8Rowwise rowwise;              // [batches, rows, cols] and [batches, rows, cols / 32]
  Mxfp8Colwise colwise;              // see colwise_activations
  // The column-wise layout: the activations' (one batch; tiled data, mxfp8_colwise_offset, and
  // block-major scales [rows / 32, cols]: what the wgrad GEMM reads), or the weights' (data
  // [batches, cols, rows] and scales [batches, cols, rows / 32]: the transposed copy is W_e^T
  // row-wise for dgrad).
  bool colwise_activations = false;
};

struct Tile {
  int64_t batch, row0, col0;
  uint32_t row_tile;
};

// Tile t of the walk in bands of `band` row tiles (kBandRowTiles; the last band of a batch may be
// shorter): down the band's rows of one 128-column strip, then the next strip. The tile count fits
// 32 bits, and so does band * col_tiles: check_and_quantize bounds both. One batch saves a
// division (the weights of one expert).
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

// The activations' walk: block b takes the contiguous tiles [begin, end) of the row-major order,
// an equal share (one more for the first total % gridDim.x blocks). Consecutive tiles of a block
// are the column tiles of one row tile, so its coordinates advance without a division and a
// thread's row, and so whether the row lies in a group's gap, changes only once per row of tiles.
// Measured on an H200, Qwen3-like step at 4096 tokens (x 32768 x 2048, 128 groups): the
// grid-stride walk issued 772 instructions per warp and tile, at 2.84 instructions per cycle per
// SM (issue-bound), of which the tile's location (divisions) and the binary search over the group
// offsets took a large part; this walk runs 23% fewer instructions and 24% less time there
// (docs/PERF.md, "MXFP8 quantizer: a contiguous walk for the activations").
struct ContiguousWalk {
  uint32_t remaining, col_tile, row_tile;
  __device__ ContiguousWalk(uint32_t total, uint32_t col_tiles) {
    const uint32_t per = total / gridDim.x, extra = total % gridDim.x;
    const uint32_t t = blockIdx.x * per + min(blockIdx.x, extra);
    remaining = per + (blockIdx.x < extra ? 1 : 0);
    row_tile = t / col_tiles;
    col_tile = t - row_tile * col_tiles;
  }
  __device__ bool done() const { return remaining == 0; }
  __device__ Tile tile() const { return Tile{0, int64_t{row_tile} * kTileRows, int64_t{col_tile} * kTileCols, row_tile}; }
  __device__ void advance(uint32_t col_tiles) {
    --remaining;
    if (++col_tile == col_tiles) col_tile = 0, ++row_tile;
  }
};

// Whether row r holds data: below the used rows and, with splits, not in a group's gap.
__device__ __forceinline__ bool row_has_data(const QuantizeArgs& a, int64_t used, int64_t r) {
  if (r >= used) return false;
  if (a.splits == nullptr) return true;
  int lo = 0, hi = a.groups - 1;  // the largest group e with offsets[e] <= r holds row r
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (a.offsets[mid] <= r) lo = mid; else hi = mid - 1;
  }
  const int64_t span = a.offsets[lo + 1] - a.offsets[lo], split = a.splits[lo];
  return r - a.offsets[lo] < (split < 0 ? 0 : split > span ? span : split);
}

// The row of x that row r reads, or a negative row (read as zeros) where r holds no data
// (row_has_data): r itself, or with a gather its source row. A source row past x is reported and
// read as zeros, never outside x.
__device__ __forceinline__ int64_t source_row(const QuantizeArgs& a, int64_t used, int64_t r) {
  if (!row_has_data(a, used, r)) return -1;
  if (a.source_rows == nullptr) return r;
  const int64_t s = __ldg(a.source_rows + r);
  if (s < a.source_bound) return s;
  if (a.error != nullptr) raise_device_error(a.error, kDeviceErrorSourceRow, static_cast<int>(r), s, a.source_bound);
  return -1;
}

// source_row for the last row asked about, remembered (the contiguous walk asks about one row for a
// whole row of tiles). Rows asked about, tile padding included, are below capacity_rows + 32 <
// 2^31 (quantize_activations checks it), so they and their source rows fit 32 bits, and no row is
// 0xffffffff, the empty cache's row.
struct RowSource {
  uint32_t row = 0xffffffffu;
  int32_t source = -1;
  __device__ int64_t operator()(const QuantizeArgs& a, int64_t used, int64_t r) {
    if (static_cast<uint32_t>(r) != row) row = static_cast<uint32_t>(r), source = static_cast<int32_t>(source_row(a, used, r));
    return source;
  }
};

// A thread's 16 elements [col, col + 16) of a tile row as loaded: two 16-byte vectors; with
// kSwiglu their gates and ups (four), with kSwigluGrad their gates, ups and da (six; a tile of the
// up half loads no ups), which input_chunk turns into the 16 elements once they have arrived.
// `data`: whether the row holds data (its source row, source_row, is not -1).
template <Input kInput>
struct Loaded {
  static constexpr int kVectors = kInput == Input::kPlain ? 2 : kInput == Input::kSwiglu ? 4 : 6;
  uint4 v[kVectors];
  bool data;
};

// Reads row `src` of x (source_row) into l; zeros where it is -1 or past the columns (nothing is
// read there).
template <Input kInput>
__device__ __forceinline__ void load_chunk(const QuantizeArgs& a, const Tile& t, int64_t src, int col,
                                           Loaded<kInput>& l) {
  const int64_t c = t.col0 + col;
  l.data = src >= 0;
  if (src >= 0 && c < a.cols) {
    if constexpr (kInput == Input::kSwigluGrad) {
      // The walk's tiles are the gate half's (c < cols / 2); column c of gate, up and da makes
      // element c of dgate and element cols / 2 + c of dup (swiglu_grad_chunks).
      const int64_t half = a.cols / 2;
      const uint4* gate = reinterpret_cast<const uint4*>(a.x + src * a.cols + c);
      const uint4* da = reinterpret_cast<const uint4*>(a.da + src * half + c);
      l.v[0] = __ldg(gate);
      l.v[1] = __ldg(gate + 1);
      l.v[2] = __ldg(gate + half / 8);
      l.v[3] = __ldg(gate + half / 8 + 1);
      l.v[4] = __ldg(da);
      l.v[5] = __ldg(da + 1);
    } else {
      constexpr bool kSwiglu = kInput == Input::kSwiglu;
      const int64_t row_length = kSwiglu ? 2 * a.cols : a.cols;  // with kSwiglu: gate | up
      const uint4* src_ptr = reinterpret_cast<const uint4*>(a.x + (t.batch * a.rows + src) * row_length + c);
      l.v[0] = __ldg(src_ptr);
      l.v[1] = __ldg(src_ptr + 1);
      if constexpr (kSwiglu) {
        const uint4* up = src_ptr + a.cols / 8;
        l.v[2] = __ldg(up);
        l.v[3] = __ldg(up + 1);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < Loaded<kInput>::kVectors; ++i) l.v[i] = make_uint4(0u, 0u, 0u, 0u);
  }
}

// The 16 input elements of a loaded chunk of grouped row `row`: as loaded, or (kSwiglu) silu(gate)
// * up, times the row's weight where there is one, rounded to T exactly as the SwiGLU kernels round
// what they store (swiglu_value), so that the quantized copy has the bits of quantizing their
// output. A row without data stays zeros and its weight is not read.
template <class T, Input kInput>
__device__ __forceinline__ void input_chunk(const QuantizeArgs& a, const Loaded<kInput>& l, int64_t row,
                                            uint4 (&v)[2]) {
  static_assert(kInput != Input::kSwigluGrad, "two chunks from one load: swiglu_grad_chunks");
  if constexpr (kInput == Input::kPlain) {
    v[0] = l.v[0];
    v[1] = l.v[1];
  } else {
    const bool weighted = a.row_weight != nullptr && l.data;
    const float w = weighted ? a.row_weight[row] : 1.0f;
    uint32_t out[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t gate = word_of(l.v[i / 4], i % 4), up = word_of(l.v[2 + i / 4], i % 4);
      float lo = swiglu_value(Format16<T>::to_float(gate & 0xffffu), Format16<T>::to_float(up & 0xffffu));
      float hi = swiglu_value(Format16<T>::to_float(gate >> 16), Format16<T>::to_float(up >> 16));
      if (weighted) lo *= w, hi *= w;
      out[i] = Format16<T>::from_float(lo) | (Format16<T>::from_float(hi) << 16);
    }
    v[0] = make_uint4(out[0], out[1], out[2], out[3]);
    v[1] = make_uint4(out[4], out[5], out[6], out[7]);
  }
}

// kSwigluGrad: the 16 elements of dgate and the 16 of dup that one loaded chunk of gate, up and da
// makes, rounded to T exactly as the SwiGLU backward kernel rounds what it stores (swiglu_math.cuh),
// so the quantized copies have the bits of quantizing its output. Rows without data stay zeros.
template <class T>
__device__ __forceinline__ void swiglu_grad_chunks(const Loaded<Input::kSwigluGrad>& l, uint4 (&dgate)[2],
                                                   uint4 (&dup)[2]) {
  uint32_t g[8], u[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t gate = word_of(l.v[i / 4], i % 4), up = word_of(l.v[2 + i / 4], i % 4);
    const uint32_t da = word_of(l.v[4 + i / 4], i % 4);
    const float g_lo = Format16<T>::to_float(gate & 0xffffu), g_hi = Format16<T>::to_float(gate >> 16);
    const float u_lo = Format16<T>::to_float(up & 0xffffu), u_hi = Format16<T>::to_float(up >> 16);
    const float d_lo = Format16<T>::to_float(da & 0xffffu), d_hi = Format16<T>::to_float(da >> 16);
    g[i] = Format16<T>::from_float(swiglu_grad_gate(g_lo, u_lo, d_lo)) |
           (Format16<T>::from_float(swiglu_grad_gate(g_hi, u_hi, d_hi)) << 16);
    u[i] = Format16<T>::from_float(swiglu_grad_up(g_lo, d_lo)) | (Format16<T>::from_float(swiglu_grad_up(g_hi, d_hi)) << 16);
  }
  dgate[0] = make_uint4(g[0], g[1], g[2], g[3]);
  dgate[1] = make_uint4(g[4], g[5], g[6], g[7]);
  dup[0] = make_uint4(u[0], u[1], u[2], u[3]);
  dup[1] = make_uint4(u[4], u[5], u[6], u[7]);
}

// Shared tile (kTileRows, kTileCols) of 16-bit elements as 16-byte units. Flipping bit 0 of the
// upper eight units spreads each eight-lane phase of the row role's 16-byte stores (units 2k, or
// 2k + 1, of one row) over all banks; flipping bit 1 for rows 16..31 puts the column role's reads
// (16 columns of rows i and 16 + i per warp) on four distinct bank groups.
__device__ __forceinline__ int swizzled_unit(int row, int unit) {
  return row * kUnitsPerRow + (unit ^ ((unit >> 3) & 1) ^ (((row >> 4) & 1) << 1));
}

// The element index of row 16 * half of tile column `col`. Rows 16 * half + i follow at i *
// kTileCols: the swizzle sees a row only through bit 4, which is `half` for all sixteen. Why it
// is computed once: the kernel runs at its register cap, and ptxas recomputed the sixteen
// swizzled addresses on every tile (about 90 of the 595 instructions a warp issued per tile).
__device__ __forceinline__ int column_half_base(int col, int half) {
  return swizzled_unit(16 * half, col / 8) * 8 + col % 8;
}

// Byte offset of rows [t.row0 + 16 * half, + 16) of column t.col0 + col in the activations'
// column-wise data: mxfp8_colwise_offset, given that a tile's columns are one strip (its col0 is
// the strip's start) and its rows one 32-row block, in unsigned arithmetic (no signed divisions).
static_assert(kTileCols == kMxColwiseStrip && kTileRows == kMxBlock, "a tile is one block of one strip");
__device__ __forceinline__ uint64_t colwise_activation_offset(const QuantizeArgs& a, const Tile& t, int col, int half) {
  const uint64_t col0 = static_cast<uint64_t>(t.col0), width = min(static_cast<uint64_t>(a.cols) - col0, uint64_t{kTileCols});
  return col0 * static_cast<uint64_t>(a.rows) + uint64_t{t.row_tile} * (kMxBlock * width) +
         static_cast<uint32_t>(col * kMxBlock + half * 16);
}

// Row role: this thread's 16 elements and its neighbour lane's (thread ^ 1) form one block.
template <class T>
__device__ __forceinline__ void quantize_row_chunk(const QuantizeArgs& a, const Tile& t, int64_t used, int row,
                                                   int col, const uint4 (&v)[2]) {
  const uint32_t w[8] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w};
  uint32_t m = abs_bits_max16(w);
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));
  const int64_t r = t.row0 + row, c = t.col0 + col;
  // Both lanes of a pair share r, and c is a multiple of 32 for the lower one while cols is too:
  // a pair stores or returns together, though a warp's four rows may not.
  const bool stores = r < used && c < a.cols;
  const uint32_t byte = block_scale_byte<T>(m);
  const int64_t at = (t.batch * a.rows + r) * a.cols + c;
  const uint4 q = encode16<T>(w, byte);
  if (a.rowwise.data != nullptr && stores) {  // data: uniform over the grid
    *reinterpret_cast<uint4*>(a.rowwise.data + at) = q;
    if ((threadIdx.x & 1) == 0) a.rowwise.scales[at / kMxBlock] = static_cast<uint8_t>(byte);
    if (a.rowwise.scale_floats != nullptr && (threadIdx.x & 1) != 0)  // the pair's other lane
      a.rowwise.scale_floats[mxfp8_scale_float_index(t.batch * a.rows + r, c / kMxBlock, a.batches * a.rows)] =
          mx_scale_value(byte);
  }
  if (a.rowwise.values != nullptr) {  // uniform over the grid; the whole warp trades halves
    float values[16];
    decode16(q, byte, values);
    const bool upper = (threadIdx.x & 1) != 0;
    const PairPieces pieces = trade_pair_bf16(upper, values);
    __nv_bfloat16* pair_first = reinterpret_cast<__nv_bfloat16*>(a.rowwise.values) + (at - (upper ? kChunk : 0));
    if (stores) store_pair(pair_first, upper, pieces);
  }
}

// The activations' column-wise values (Mxfp8Colwise::values), row-major [rows, cols] bf16: what
// launch_dequantize_mxfp8_colwise makes of the codes. The warp holds columns [16w, 16w + 16) of the
// tile, rows 0..31: each lane writes its 16 values over the input elements it read from the shared
// tile (no other warp reads them in this tile), then the warp stores the 32 x 16 block as whole
// 32-byte sectors: lane pair (2q, 2q + 1) writes one row's two 16-byte units; the first store covers
// rows 0..7 and 16..23, the second 8..15 and 24..31, so each eight-lane phase of the shared reads
// meets four bank groups (rows below and above 16 are swizzled apart), not two.
// Why: the staged wgrad reads dy as bf16 rows; written here, they save its pass over the codes
// (read 1 + 1/32 bytes, write 2 per element) and the codes themselves.
__device__ __forceinline__ void store_colwise_values(const QuantizeArgs& a, const Tile& t, int64_t used, uint4* tile,
                                                     uint16_t* first, const uint4& q, uint32_t byte) {
  const float s = mx_scale_value(byte);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float v[4];
    decode4(word_of(q, j), s, v);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      first[(4 * j + i) * kTileCols] = __bfloat16_as_ushort(__float2bfloat16_rn(v[i]));  // nearest even
  }
  __syncwarp();
  const int lane = threadIdx.x & 31, unit = threadIdx.x / 32 * 2 + (lane & 1), q_row = lane >> 1;
  const int64_t c = t.col0 + unit * 8;  // the warp's columns are all inside cols or all past it
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int row = (q_row & 1) * 16 + (q_row >> 1) + 8 * k;
    const int64_t r = t.row0 + row;
    const uint4 piece = tile[swizzled_unit(row, unit)];
    if (r < used && c < a.cols)
      *reinterpret_cast<uint4*>(reinterpret_cast<__nv_bfloat16*>(a.colwise.values) + r * a.cols + c) = piece;
  }
}

// Column role: rows [16 * half, 16 * half + 16) of tile column `col`; lane ^ 16 holds the other half.
// `first` is the tile's element at column_half_base(col, half) in `tile`. kValues: the activations'
// bf16 values are written instead of the codes (a template flag: the runtime branch beside the
// codes' stores made ptxas spill about 100 bytes at the 40-register cap).
template <class T, bool kValues>
__device__ __forceinline__ void quantize_column_half(const QuantizeArgs& a, const Tile& t, int64_t used, uint4* tile,
                                                     uint16_t* first, int col, int half) {
  uint32_t w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = first[2 * i * kTileCols] | (uint32_t{first[(2 * i + 1) * kTileCols]} << 16);
  uint32_t m = abs_bits_max16(w);
  m = max(m, __shfl_xor_sync(0xffffffffu, m, 16));
  const int64_t c = t.col0 + col;
  if (c >= a.cols) return;  // the whole warp: cols is a multiple of 16 and a warp's columns are 16-aligned
  const uint32_t byte = block_scale_byte<T>(m);
  const uint4 q = encode16<T>(w, byte);
  const int64_t r0 = t.row0 + half * 16;
  if constexpr (kValues) {
    store_colwise_values(a, t, used, tile, first, q, byte);
    return;
  }
  // Activations: the tile's 32 x 128 codes are one contiguous run (its strip's block t.row_tile).
  uint8_t* dst = a.colwise.data + (a.colwise_activations ? colwise_activation_offset(a, t, col, half)
                                                         : (t.batch * a.cols + c) * a.rows + r0);
  if (r0 + 16 <= used) {
    *reinterpret_cast<uint4*>(dst) = q;
    if (a.colwise.values != nullptr) {  // the weights' layout only (checked): dst's element index
      float values[16];
      decode16(q, byte, values);
      store16(reinterpret_cast<__nv_bfloat16*>(a.colwise.values) + (dst - a.colwise.data), values);
    }
  } else {  // the last block of an offsets[G] that is not a multiple of 32: rows below it only
#pragma unroll
    for (int i = 0; i < 16; ++i)
      if (r0 + i < used) dst[i] = static_cast<uint8_t>(word_of(q, i / 4) >> (8 * (i % 4)));
  }
  const int64_t blocks = a.rows / kMxBlock;
  const int64_t at = a.colwise_activations ? (t.batch * blocks + t.row_tile) * a.cols + c
                                          : (t.batch * a.cols + c) * blocks + t.row_tile;
  if (half == 0) a.colwise.scales[at] = static_cast<uint8_t>(byte);
}

// The walk of the weights (batches of experts): tile t, t + gridDim.x, ... in bands of `band` row
// tiles (locate_tile_banded), so the blocks resident together write neighbouring rows of each
// column of the transposed copy.
struct BandedWalk {
  uint32_t t, total;
  __device__ bool done() const { return t >= total; }
  __device__ void advance(uint32_t) { t += gridDim.x; }
};

// kContiguous: the activations' walk (ContiguousWalk, one batch); else the weights' (BandedWalk,
// `band` = kBandRowTiles). `band` is an argument, not a template constant: folding a constant in
// makes ptxas spill 4 bytes in the bf16 row-wise kernel. kInput other than kPlain (with
// kContiguous): the input is made from x as it is read (Input), with fewer blocks per SM for the
// loads' registers.
template <Input kInput, bool kColValues>
constexpr int quantize_blocks_per_sm() {
  if constexpr (kInput == Input::kSwigluGrad) return kSwigluGradBlocksPerSm;
  if constexpr (kInput == Input::kSwiglu) return kSwigluBlocksPerSm;
  return kColValues ? kColValuesBlocksPerSm : kMinBlocksPerSm;
}
template <class T, bool kRow, bool kCol, bool kContiguous, Input kInput, bool kColValues>
__global__ void __launch_bounds__(kThreads, quantize_blocks_per_sm<kInput, kColValues>())
    quantize_mxfp8_kernel(const QuantizeArgs a, const uint32_t band) {
  // Column role's transpose, double-buffered: (kTileRows, kTileCols) elements, swizzled units.
  __shared__ uint4 shared_tiles[kCol ? 2 : 1][kCol ? kTileRows * kUnitsPerRow : 1];
  const int64_t used = a.used_rows == nullptr ? a.rows : min(max(*a.used_rows, int64_t{0}), a.rows);
  const uint32_t row_tiles = static_cast<uint32_t>((used + kTileRows - 1) / kTileRows);
  // kSwigluGrad walks the gate half's tiles: each one's load also makes the up half's tile
  // (swiglu_grad_chunks), so the sigmoid of a gate and the loads of gate and da serve both.
  constexpr bool kPaired = kInput == Input::kSwigluGrad;
  const uint32_t col_tiles = static_cast<uint32_t>((a.cols + kTileCols - 1) / kTileCols) / (kPaired ? 2 : 1);
  const uint32_t total = row_tiles * col_tiles * static_cast<uint32_t>(a.batches);
  using Walk = std::conditional_t<kContiguous, ContiguousWalk, BandedWalk>;
  Walk walk = [&]() -> Walk {
    if constexpr (kContiguous) return ContiguousWalk(total, col_tiles);
    else return BandedWalk{blockIdx.x, total};
  }();
  if (walk.done()) return;  // uniform over the block
  const auto tile_of = [&](const Walk& w) {
    if constexpr (kContiguous) return w.tile();
    else return locate_tile_banded(w.t, row_tiles, col_tiles, band, a.batches);
  };

  const int lane = threadIdx.x & 31;
  const int chunk_row = threadIdx.x / kChunksPerRow, chunk_col = threadIdx.x % kChunksPerRow * kChunk;
  const int col = threadIdx.x / 32 * 16 + (lane & 15), half = lane >> 4;  // column role
  // The row role's two 16-byte units and the column role's first element in a shared tile.
  const int row_unit0 = swizzled_unit(chunk_row, chunk_col / 8), row_unit1 = swizzled_unit(chunk_row, chunk_col / 8 + 1);
  const int col_first = column_half_base(col, half);

  RowSource source;  // the contiguous walk's; the banded one asks each time
  const auto source_of = [&](const Tile& t) {
    if constexpr (kContiguous) return source(a, used, t.row0 + chunk_row);
    else return source_row(a, used, t.row0 + chunk_row);
  };
  Tile tile = tile_of(walk);
  Loaded<kInput> loaded;
  load_chunk(a, tile, source_of(tile), chunk_col, loaded);
  int buf = 0;
  while (!walk.done()) {
    // The next tile's loads go out first and stay in flight while this tile is converted.
    walk.advance(col_tiles);
    Tile next_tile = tile;
    Loaded<kInput> next = {};
    if (!walk.done()) {
      next_tile = tile_of(walk);
      load_chunk(a, next_tile, source_of(next_tile), chunk_col, next);
    }
    const auto quantize_tile = [&](const Tile& t, const uint4 (&v)[2]) {
      if constexpr (kCol) {
        shared_tiles[buf][row_unit0] = v[0];
        shared_tiles[buf][row_unit1] = v[1];
      }
      if constexpr (kRow) quantize_row_chunk<T>(a, t, used, chunk_row, chunk_col, v);
      if constexpr (kCol) {
        // One barrier per tile: a thread writes buffer `buf` again two tiles later, after every
        // thread has passed the next tile's barrier, so after every read of this tile.
        __syncthreads();
        uint16_t* const first = reinterpret_cast<uint16_t*>(shared_tiles[buf]) + col_first;
        quantize_column_half<T, kColValues>(a, t, used, shared_tiles[buf], first, col, half);
        buf ^= 1;
      }
    };
    if constexpr (kPaired) {
      uint4 dgate[2], dup[2];
      swiglu_grad_chunks<T>(loaded, dgate, dup);
      quantize_tile(tile, dgate);
      Tile up = tile;
      up.col0 += a.cols / 2;
      quantize_tile(up, dup);
    } else {
      uint4 v[2];
      input_chunk<T, kInput>(a, loaded, tile.row0 + chunk_row, v);
      quantize_tile(tile, v);
    }
    tile = next_tile;
    loaded = next;
  }
}

template <class T, bool kRow, bool kCol, bool kContiguous, Input kInput = Input::kPlain, bool kColValues = false>
void launch_quantize(const QuantizeArgs& a, cudaStream_t stream) {
  const auto kernel = quantize_mxfp8_kernel<T, kRow, kCol, kContiguous, kInput, kColValues>;
  const int blocks_per_sm = resident_blocks_per_sm(kernel, kThreads);
  const int64_t col_tiles = (a.cols + kTileCols - 1) / kTileCols / (kInput == Input::kSwigluGrad ? 2 : 1);
  const int64_t max_tiles = a.batches * ((a.rows + kTileRows - 1) / kTileRows) * col_tiles;  // walked tiles
  kernel<<<grid_blocks(max_tiles, blocks_per_sm), kThreads, 0, stream>>>(a, kBandRowTiles);
  MG_LAUNCH_CHECK();
}

// Activations (one batch) take the contiguous walk, weights the banded one. The activations'
// column-wise values (instead of codes) have their own kernels, without kSwiglu (checked).
template <class T, bool kRow, bool kCol, Input kInput>
void launch_quantize_activations(const QuantizeArgs& a, cudaStream_t stream) {
  if constexpr (kCol && kInput != Input::kSwiglu) {
    if (a.colwise.values != nullptr) return launch_quantize<T, kRow, kCol, true, kInput, true>(a, stream);
  }
  launch_quantize<T, kRow, kCol, true, kInput>(a, stream);
}
template <class T, bool kRow, bool kCol>
void launch_quantize_walk(const QuantizeArgs& a, cudaStream_t stream) {
  if (a.input == Input::kSwiglu) {
    launch_quantize_activations<T, kRow, kCol, Input::kSwiglu>(a, stream);  // activations (checked)
  } else if (a.input == Input::kSwigluGrad) {
    launch_quantize_activations<T, kRow, kCol, Input::kSwigluGrad>(a, stream);
  } else if (a.colwise_activations && a.batches == 1) {
    launch_quantize_activations<T, kRow, kCol, Input::kPlain>(a, stream);
  } else {
    launch_quantize<T, kRow, kCol, false>(a, stream);
  }
}

template <class T>
void launch_quantize_layouts(const QuantizeArgs& a, cudaStream_t stream) {
  const bool row = a.rowwise.data != nullptr || a.rowwise.values != nullptr;
  const bool col = a.colwise.data != nullptr || a.colwise.values != nullptr;
  if (row && col) launch_quantize_walk<T, true, true>(a, stream);
  else if (row) launch_quantize_walk<T, true, false>(a, stream);
  else launch_quantize_walk<T, false, true>(a, stream);
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
    const bool codes = rowwise->data != nullptr || rowwise->scales != nullptr;
    MG_CHECK(codes || rowwise->values != nullptr, who,
             ": the row-wise output needs its codes (data and scales), its bf16 values, or both (all null)");
    MG_CHECK(!codes || (rowwise->data != nullptr && aligned16(rowwise->data) && rowwise->scales != nullptr), who,
             ": the row-wise codes need a 16-byte aligned data pointer and a scales pointer");
    MG_CHECK(rowwise->values == nullptr || aligned16(rowwise->values), who,
             ": the row-wise bf16 values need a 16-byte aligned pointer");
    MG_CHECK(rowwise->scale_floats == nullptr || (codes && aligned16(rowwise->scale_floats)), who,
             ": the row-wise scales as floats are written beside the codes, to a 16-byte aligned pointer");
    a.rowwise = *rowwise;
  }
  if (colwise != nullptr) {
    MG_CHECK(a.rows % kMxBlock == 0, who, ": column-wise blocks need ", rows_name, " to be a multiple of 32, got ",
             a.rows);
    MG_CHECK(a.cols % 16 == 0, who, ": the row length must be a multiple of 16, got ", a.cols);
    // The activations' column-wise copy is its codes or its bf16 values (not both, and not under
    // kSwiglu: see launch_quantize_walk); the weights' always carries codes, values beside them.
    const bool codes = colwise->data != nullptr || colwise->scales != nullptr;
    if (a.colwise_activations)
      MG_CHECK(codes != (colwise->values != nullptr) && !(a.input == Input::kSwiglu && !codes), who,
               ": the column-wise output is either its codes (data and scales) or its bf16 values (values), ",
               "not both and not neither; the SwiGLU quantizer writes codes only");
    else
      MG_CHECK(codes, who, ": the weights' column-wise copy needs its codes (data and scales); bf16 values are only "
               "written beside them");
    MG_CHECK(!codes || (colwise->data != nullptr && aligned16(colwise->data) && colwise->scales != nullptr), who,
             ": the column-wise codes need a 16-byte aligned data pointer and a scales pointer");
    MG_CHECK(colwise->values == nullptr || aligned16(colwise->values), who,
             ": the column-wise bf16 values need a 16-byte aligned pointer");
    a.colwise = *colwise;
  }
  with_16bit_type(in, who, [&](auto t) { launch_quantize_layouts<decltype(t)>(a, stream); });
}

// ---- Dequantize (row-wise) --------------------------------------------------------------------

// Grid-stride over runs of kDequantRun elements of the used rows, a warp each. Lane l's k-th
// 16-byte store holds the elements [k * 32 * E + l * E, + E) of its run (E = 16 / sizeof(Out): 8
// or 4), so each store instruction of a warp writes 512 contiguous bytes, and each load 32 * E
// contiguous codes. Why: with 16 consecutive elements a thread, stored as two 16-byte halves, every
// store instruction wrote half of each 32-byte sector; on one H200 (Nsight Compute, bf16 out) the
// L2 took 2.9 write sectors per DRAM byte's sector and the kernel stalled on the load-store queue
// (lg throttle) at 0.54 of the DRAM peak (docs/PERF.md, "MXFP8 dequantizer: whole sectors per store").
// The flat element index is row * cols + col and cols is a multiple of 32, so element e has scale
// e / 32, and a piece (E elements, E dividing 32) lies in one block and is whole or past the end.
constexpr int64_t kDequantRun = 32 * kChunk;
template <class Out>
__global__ void __launch_bounds__(kThreads) dequantize_mxfp8_rowwise_kernel(const uint8_t* __restrict__ data,
                                                                           const uint8_t* __restrict__ scales,
                                                                           Out* __restrict__ y, int64_t rows,
                                                                           int64_t cols, const int64_t* used_rows) {
  constexpr int E = 16 / sizeof(Out);
  static_assert(E == 4 || E == 8, "16-bit or fp32 values");
  using Codes = std::conditional_t<E == 8, uint2, uint32_t>;
  const int64_t used = used_rows != nullptr ? min(max(*used_rows, int64_t{0}), rows) : rows;
  const int64_t total = used * cols;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t run = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; run * kDequantRun < total;
       run += warps) {
#pragma unroll
    for (int k = 0; k < kChunk / E; ++k) {
      const int64_t e = run * kDequantRun + (k * 32 + lane) * E;
      if (e >= total) break;
      const Codes q = __ldg(reinterpret_cast<const Codes*>(data + e));
      const float s = mx_scale_value(__ldg(scales + e / kMxBlock));
      float v[E];
      if constexpr (E == 8) {
        decode4(q.x, s, v);
        decode4(q.y, s, v + 4);
      } else {
        decode4(q, s, v);
      }
      alignas(16) Out out[E];
#pragma unroll
      for (int i = 0; i < E; ++i) out[i] = static_cast<Out>(v[i]);
      *reinterpret_cast<uint4*>(y + e) = *reinterpret_cast<const uint4*>(out);
    }
  }
}

template <class Out>
void launch_dequantize(const uint8_t* data, const uint8_t* scales, void* y, int64_t rows, int64_t cols,
                       const int64_t* used_rows, cudaStream_t stream) {
  const int blocks_per_sm = resident_blocks_per_sm(dequantize_mxfp8_rowwise_kernel<Out>, kThreads);
  constexpr int64_t kRunsPerBlock = kThreads / 32;
  const int64_t max_blocks = ((rows * cols + kDequantRun - 1) / kDequantRun + kRunsPerBlock - 1) / kRunsPerBlock;
  dequantize_mxfp8_rowwise_kernel<Out><<<grid_blocks(max_blocks, blocks_per_sm), kThreads, 0, stream>>>(
      data, scales, static_cast<Out*>(y), rows, cols, used_rows);
  MG_LAUNCH_CHECK();
}

// ---- Dequantize (column-wise, back to row-major) ----------------------------------------------

// Tiles of 64 rows x 64 columns of y [rows, cols], grid-stride. Loads: thread t takes column t / 4
// of the tile and 16 consecutive rows (one 16-byte vector of the tiled codes, half a block);
// the values go through a shared tile to be stored as whole rows of y.
constexpr int kColwiseTile = 64;
template <class Out>
__global__ void __launch_bounds__(kThreads) dequantize_mxfp8_colwise_kernel(const uint8_t* __restrict__ data,
                                                                           const uint8_t* __restrict__ scales,
                                                                           Out* __restrict__ y, int64_t rows,
                                                                           int64_t cols, const int64_t* used_rows) {
  constexpr int kPad = 16 / sizeof(Out);  // rows of the shared tile stay 16-byte aligned
  __shared__ __align__(16) Out tile[kColwiseTile][kColwiseTile + kPad];
  const int64_t used = min(max(*used_rows, int64_t{0}), rows);
  const int64_t row_tiles = (used + kColwiseTile - 1) / kColwiseTile;
  const int64_t col_tiles = (cols + kColwiseTile - 1) / kColwiseTile;
  const int lc = threadIdx.x / 4, lr = threadIdx.x % 4 * 16;
  for (int64_t t = blockIdx.x; t < row_tiles * col_tiles; t += gridDim.x) {
    const int64_t r0 = t / col_tiles * kColwiseTile, c0 = t % col_tiles * kColwiseTile;
    // rows (a multiple of 32) bounds the load; rows past `used` are converted but never stored.
    if (c0 + lc < cols && r0 + lr < rows) {
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(data + mxfp8_colwise_offset(r0 + lr, c0 + lc, rows, cols)));
      const float s = mx_scale_value(__ldg(scales + (r0 + lr) / kMxBlock * cols + c0 + lc));
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float v[4];
        decode4(word_of(q, j), s, v);
#pragma unroll
        for (int i = 0; i < 4; ++i) tile[lr + 4 * j + i][lc] = static_cast<Out>(v[i]);  // rounded to nearest even
      }
    }
    __syncthreads();
    // Stores: 16-byte pieces of tile rows; cols is a multiple of 16, so a piece is whole or absent.
    constexpr int kPerPiece = 16 / sizeof(Out), kPiecesPerRow = kColwiseTile / kPerPiece;
    for (int i = threadIdx.x; i < kColwiseTile * kPiecesPerRow; i += kThreads) {
      const int r = i / kPiecesPerRow, c = i % kPiecesPerRow * kPerPiece;
      if (r0 + r < used && c0 + c < cols)
        *reinterpret_cast<uint4*>(y + (r0 + r) * cols + c0 + c) = *reinterpret_cast<const uint4*>(&tile[r][c]);
    }
    __syncthreads();
  }
}

template <class Out>
void launch_dequantize_colwise(const uint8_t* data, const uint8_t* scales, void* y, int64_t rows, int64_t cols,
                               const int64_t* used_rows, cudaStream_t stream) {
  const int blocks_per_sm = resident_blocks_per_sm(dequantize_mxfp8_colwise_kernel<Out>, kThreads);
  const int64_t tiles = (rows + kColwiseTile - 1) / kColwiseTile * ((cols + kColwiseTile - 1) / kColwiseTile);
  dequantize_mxfp8_colwise_kernel<Out><<<grid_blocks(tiles, blocks_per_sm), kThreads, 0, stream>>>(
      data, scales, static_cast<Out*>(y), rows, cols, used_rows);
  MG_LAUNCH_CHECK();
}

// The activations' launchers: one batch of capacity_rows, optionally gathered, or made as it is
// read (`input`, with row_weight for kSwiglu and da for kSwigluGrad: QuantizeArgs).
void quantize_activations(const char* who, DType in, const void* x, const RowGather& gather, int64_t capacity_rows,
                          int64_t cols, const int64_t* offsets, const int32_t* splits, int groups,
                          const Mxfp8Rowwise* rowwise, const Mxfp8Colwise* colwise, cudaStream_t stream,
                          Input input = Input::kPlain, const float* row_weight = nullptr, const void* da = nullptr) {
  MG_CHECK(cols % kMxBlock == 0, who, ": cols must be a multiple of 32, got ", cols);
  MG_CHECK(offsets != nullptr && groups >= 0, who, ": needs the device offsets [groups + 1], groups = ", groups);
  // Without the splits a gap row would be made from whatever the inputs hold there.
  MG_CHECK(input == Input::kPlain || splits != nullptr, who, ": needs the device splits");
  MG_CHECK(capacity_rows < (int64_t{1} << 31) - kTileRows, who,
           ": capacity_rows must be below 2^31 - 32 (the walk keeps a row, tile padding included, in 31 bits), got ",
           capacity_rows);
  QuantizeArgs a;
  a.x = static_cast<const uint16_t*>(x);
  a.rows = capacity_rows;
  a.cols = cols;
  a.used_rows = offsets + groups;
  a.offsets = offsets;
  a.splits = splits;
  a.groups = groups;
  a.source_rows = gather.rows;
  a.source_bound = gather.bound;
  a.error = gather.error;
  a.input = input;
  a.row_weight = row_weight;
  a.da = static_cast<const uint16_t*>(da);
  a.colwise_activations = true;
  check_and_quantize(who, "capacity_rows", in, a, rowwise, colwise, stream);
}
}  // namespace

void launch_quantize_mxfp8(DType in, const void* x, int64_t capacity_rows, int64_t cols, const int64_t* offsets,
                           const int32_t* splits, int groups, const Mxfp8Rowwise* rowwise,
                           const Mxfp8Colwise* colwise, cudaStream_t stream) {
  quantize_activations("launch_quantize_mxfp8", in, x, {}, capacity_rows, cols, offsets, splits, groups, rowwise,
                       colwise, stream);
}

void launch_quantize_mxfp8_gathered(DType in, const void* x, const RowGather& gather, int64_t capacity_rows,
                                    int64_t cols, const int64_t* offsets, const int32_t* splits, int groups,
                                    const Mxfp8Rowwise* rowwise, const Mxfp8Colwise* colwise, cudaStream_t stream) {
  constexpr const char* kWho = "launch_quantize_mxfp8_gathered";
  // Without the splits a gap row would be read through its map entry, which no producer defines.
  MG_CHECK(gather.rows != nullptr && splits != nullptr, kWho, ": needs the device source rows and splits");
  // Source rows fit 32 bits (RowSource remembers one as an int32).
  MG_CHECK(gather.bound >= 1 && gather.bound < (int64_t{1} << 31), kWho, ": the rows of x must be in [1, 2^31), got ",
           gather.bound);
  quantize_activations(kWho, in, x, gather, capacity_rows, cols, offsets, splits, groups, rowwise, colwise, stream);
}

void launch_quantize_mxfp8_swiglu(DType in, const void* gate_up, const float* row_weight, int64_t capacity_rows,
                                  int64_t cols, const int64_t* offsets, const int32_t* splits, int groups,
                                  const Mxfp8Rowwise* rowwise, const Mxfp8Colwise* colwise, cudaStream_t stream) {
  // Rows of 2 * cols: offsets stay below 2^44 (check_and_quantize bounds the tiles, 32 x 128 each,
  // below 2^31), far inside int64.
  quantize_activations("launch_quantize_mxfp8_swiglu", in, gate_up, {}, capacity_rows, cols, offsets, splits, groups,
                       rowwise, colwise, stream, Input::kSwiglu, row_weight);
}

void launch_quantize_mxfp8_swiglu_grad(DType in, const void* gate_up, const void* da, int64_t capacity_rows,
                                       int64_t cols, const int64_t* offsets, const int32_t* splits, int groups,
                                       const Mxfp8Rowwise* rowwise, const Mxfp8Colwise* colwise,
                                       cudaStream_t stream) {
  constexpr const char* kWho = "launch_quantize_mxfp8_swiglu_grad";
  // Each 128-column tile must lie in one half: the gate's gradient or the up's.
  MG_CHECK(cols > 0 && cols % (2 * kTileCols) == 0, kWho, ": cols (2 * ffn) must be a positive multiple of ",
           2 * kTileCols, ", got ", cols);
  MG_CHECK(da != nullptr && aligned16(da), kWho, ": da must be a 16-byte aligned device pointer");
  quantize_activations(kWho, in, gate_up, {}, capacity_rows, cols, offsets, splits, groups, rowwise, colwise, stream,
                       Input::kSwigluGrad, nullptr, da);
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
  MG_CHECK(rowwise == nullptr || rowwise->data != nullptr, kWho,
           ": the weights' row-wise copy needs its codes (data and scales); bf16 values are only written beside them");
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

void launch_dequantize_mxfp8_weights(const uint8_t* data, const uint8_t* scales, void* y, int64_t rows, int64_t cols,
                                     cudaStream_t stream) {
  constexpr const char* kWho = "launch_dequantize_mxfp8_weights";
  MG_CHECK(rows >= 0 && cols > 0 && cols % kMxBlock == 0, kWho,
           ": needs rows >= 0 and cols a positive multiple of 32, got ", rows, " x ", cols);
  MG_CHECK(data != nullptr && aligned16(data) && scales != nullptr && y != nullptr && aligned16(y), kWho,
           ": data and y must be 16-byte aligned device pointers, scales non-null");
  if (rows > 0) launch_dequantize<__nv_bfloat16>(data, scales, y, rows, cols, nullptr, stream);
}

void launch_dequantize_mxfp8_colwise(const uint8_t* data, const uint8_t* scales, DType out, void* y,
                                     int64_t capacity_rows, int64_t cols, const int64_t* offsets, int groups,
                                     cudaStream_t stream) {
  constexpr const char* kWho = "launch_dequantize_mxfp8_colwise";
  MG_CHECK(capacity_rows >= 0 && capacity_rows % kMxBlock == 0 && cols > 0 && cols % 16 == 0, kWho,
           ": needs capacity_rows a multiple of 32 and cols a positive multiple of 16, got ", capacity_rows, " x ",
           cols);
  MG_CHECK(offsets != nullptr && groups >= 0, kWho, ": needs the device offsets [groups + 1], groups = ", groups);
  MG_CHECK(data != nullptr && aligned16(data) && scales != nullptr && y != nullptr && aligned16(y), kWho,
           ": data and y must be 16-byte aligned device pointers, scales non-null");
  if (capacity_rows == 0) return;
  const int64_t* used_rows = offsets + groups;
  switch (out) {
    case DType::kBF16:
      launch_dequantize_colwise<__nv_bfloat16>(data, scales, y, capacity_rows, cols, used_rows, stream);
      break;
    case DType::kFP16: launch_dequantize_colwise<__half>(data, scales, y, capacity_rows, cols, used_rows, stream); break;
    case DType::kFP32: launch_dequantize_colwise<float>(data, scales, y, capacity_rows, cols, used_rows, stream); break;
  }
}

}  // namespace moegraph::kernels
