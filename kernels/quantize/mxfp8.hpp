// MXFP8 (OCP Microscaling) quantization of grouped bf16/fp16 buffers and grouped weights
// (host-callable launchers; no device code in this header). The rules — scale choice, rounding,
// NaN/Inf blocks — are in docs/mxfp8.md; testing/mxfp8_reference.hpp is their host reference,
// and the kernels match it bit for bit.
//
// Every launcher is an enqueue path: it never synchronizes, allocates or reads device memory on
// the host, and its grid depends on host sizes only, so it may be captured into a CUDA graph once
// and replayed for any device offsets.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "moegraph/types.hpp"

namespace moegraph::kernels {

constexpr int kMxBlock = 32;            // elements sharing one E8M0 scale
constexpr uint8_t kE8m0NaN = 0xff;      // the scale byte of a block holding NaN or ±Inf
constexpr uint8_t kE4m3NaN = 0x7f;      // every element byte of such a block

// Device pointers of a row-wise copy of a [rows, cols] tensor: blocks of 32 along a row.
//   data   [rows, cols]      E4M3, element (r, c) at r * cols + c           (16-byte aligned)
//   scales [rows, cols / 32] E8M0, block of columns [32j, 32j + 32) of row r at r * (cols / 32) + j
//   values (optional) [rows, cols] bf16: each element's MXFP8 value rounded to bf16, exactly what
//          launch_dequantize_mxfp8_rowwise(..., kBF16, ...) makes of the codes (16-byte aligned).
//          Why: the staged GEMM route (mxfp8_staged.cpp) reads only A's bf16 values; written in the
//          quantizer's pass, they save reading the codes back (3 bytes per element). With values,
//          data and scales may both be null: the codes are then not written.
//   scale_floats (optional, with the codes) fp32, each scale as the GEMMs promote with it,
//          2^(scale - 127) (2^-127 a subnormal, NaN for 0xFF), 16-byte aligned, stage-major:
//          [ceil(cols / 128)][rows][4], block j of row r at mxfp8_scale_float_index(r, j, rows)
//          (4 * rows * ceil(cols / 128) floats; slots past a row's blocks are not written). Why: the
//          swap-AB GEMM (groups of few rows) reads A's scales as floats, since decoding a byte there
//          is repeated by the 64 threads that share each row; and in this order the floats of one
//          GEMM stage (128 columns) of 32 consecutive rows are one contiguous 512-byte copy.
struct Mxfp8Rowwise {
  uint8_t* data = nullptr;
  uint8_t* scales = nullptr;
  uint16_t* values = nullptr;
  float* scale_floats = nullptr;
};

// The swap-AB GEMM's stage (128 reduction elements, 4 scale blocks) and weight tile (128 rows): its
// scale layouts follow them (its kernel asserts that they agree).
constexpr int64_t kMxStageCols = 128;
constexpr int64_t kMxStageBlocks = kMxStageCols / 32;
constexpr int64_t kMxTileRows = 128;
// Index of block j of row r in a row-wise copy's scale_floats (rows: the copy's rows).
constexpr int64_t mxfp8_scale_float_index(int64_t r, int64_t j, int64_t rows) {
  return (j / kMxStageBlocks * rows + r) * kMxStageBlocks + j % kMxStageBlocks;
}

// Device pointers of a column-wise copy of a [rows, cols] tensor: blocks of 32 consecutive rows
// (this is what the weight-gradient GEMM reads), the data tiled so that each 32-row block of a
// 128-column strip is one contiguous run (the quantizer writes whole runs, not 32 bytes per column
// scattered `rows` bytes apart, which held its write stream to about 0.7 of a copy):
//   data   [cols / 128 strips][rows / 32 blocks][w columns][32 rows]  E4M3 (16-byte aligned), w = 128
//          except in a last, narrower strip; element (r, c) at mxfp8_colwise_offset(r, c, rows, cols)
//   scales [rows / 32, cols] E8M0, block of rows [32j, 32j + 32) of column c at j * cols + c
//          (block-major: a GEMM stage's scales are contiguous wherever a 32-aligned group starts).
//          The weights' transposed copy (launch_quantize_mxfp8_weights) differs: see there.
//   values (optional) bf16, each element's MXFP8 value rounded to bf16 (Mxfp8Rowwise::values):
//          activations: [rows, cols] row-major, exactly what launch_dequantize_mxfp8_colwise(...,
//          kBF16, ...) makes of the codes (16-byte aligned). Why: the staged wgrad reads only dy's
//          bf16 values; written in the quantizer's pass, they save its pass over the codes. An
//          activation's copy is its codes or its values: with values, data and scales are null.
//          The weights' transposed copy: [groups, k, n], written beside the codes (required there).
struct Mxfp8Colwise {
  uint8_t* data = nullptr;
  uint8_t* scales = nullptr;
  uint16_t* values = nullptr;
};

constexpr int64_t kMxColwiseStrip = 128;  // columns of a strip of the column-wise data
// Bytes of one 32-row block of the strip holding column c (32 per column of the strip).
constexpr int64_t mxfp8_colwise_block_bytes(int64_t c, int64_t cols) {
  const int64_t strip0 = c / kMxColwiseStrip * kMxColwiseStrip;
  return kMxBlock * (cols - strip0 < kMxColwiseStrip ? cols - strip0 : kMxColwiseStrip);
}
// Byte offset of element (r, c) in the column-wise data of a [rows, cols] tensor (rows a multiple of
// 32): the strip's start, the 32-row block's start within it, then 32 bytes per column.
constexpr int64_t mxfp8_colwise_offset(int64_t r, int64_t c, int64_t rows, int64_t cols) {
  const int64_t strip0 = c / kMxColwiseStrip * kMxColwiseStrip;
  return strip0 * rows + r / kMxBlock * mxfp8_colwise_block_bytes(c, cols) + (c - strip0) * kMxBlock + r % kMxBlock;
}

// Bytes of the two arrays of either copy of a [rows, cols] tensor (rows * cols a multiple of 32).
constexpr int64_t mxfp8_data_bytes(int64_t rows, int64_t cols) { return rows * cols; }
constexpr int64_t mxfp8_scale_bytes(int64_t rows, int64_t cols) { return rows * cols / kMxBlock; }

// Quantizes the used rows [0, offsets[groups]) of the grouped buffer x [capacity_rows, cols]
// (bf16 or fp16) into a row-wise copy, a column-wise copy, or both from one read of x (pass null
// for a copy that is not wanted; at least one is required). Bytes of rows at or past
// offsets[groups] are left untouched in both copies.
//   - cols is a multiple of 32; x and every data pointer are 16-byte aligned.
//   - column-wise: capacity_rows is a multiple of 32 and every group starts on a multiple of 32
//     (offsets from launch_group_offsets with row_align 32, gap rows zero), so each 32-row block
//     lies inside one group. Only capacity_rows is checked: group starts are device data. If
//     offsets[groups] itself is not a multiple of 32, the last block of each column holds the rows
//     below it only (the absent rows count as zeros; their bytes are not written).
//   - row-wise alone works for any offsets (row_align 1 included).
//   - capacity_rows is below 2^31 - 32 (the walk remembers a row, tile padding included, in 31 bits).
// Launch: persistent grid of 256-thread blocks over 32 x 128 tiles, each block a contiguous share of
// them in row-major order (mxfp8.cu says why the weights' walk differs).
// `splits` (optional, device [groups]): rows of a group past its split (alignment gaps) are
// quantized as zeros whatever x holds there, as the grouped GEMMs treat them.
void launch_quantize_mxfp8(DType in, const void* x, int64_t capacity_rows, int64_t cols,
                           const int64_t* offsets, const int32_t* splits, int groups,
                           const Mxfp8Rowwise* rowwise, const Mxfp8Colwise* colwise, cudaStream_t stream);

// Where the grouped input's rows come from: row r is row rows[r] of x ([bound, cols]).
struct RowGather {
  const int32_t* rows = nullptr;       // device, [capacity_rows]
  int64_t bound = 0;                   // x's rows, 1..2^31 - 1
  DeviceErrorRecord* error = nullptr;  // where an entry at or past `bound` is reported (null: not)
};

// launch_quantize_mxfp8 with the input rows gathered (gather.rows) for the rows that hold data,
// those below offsets[groups] and each group's split (splits required; the other rows read as zeros
// and their map entries are never read). E.g. x the tokens and the map a dispatch's token_of_row:
// the quantizer reads each token where it is (several times, from L2, for top-k routing) and the
// permuted copy is never made. Bit-identical to launch_quantize_mxfp8 of the gathered buffer. A
// data row's entry must be a row of x: a negative one reads as zeros, one at or past the bound
// reads as zeros and raises kDeviceErrorSourceRow (group: the row, value: the entry).
void launch_quantize_mxfp8_gathered(DType in, const void* x, const RowGather& gather, int64_t capacity_rows,
                                    int64_t cols, const int64_t* offsets, const int32_t* splits, int groups,
                                    const Mxfp8Rowwise* rowwise, const Mxfp8Colwise* colwise, cudaStream_t stream);

// launch_quantize_mxfp8 of a = silu(gate) * up (times row_weight[r] when not null), where gate_up
// is [capacity_rows, 2 * cols], each row's gate then its up (e.g. FC1's output): the quantizer
// applies SwiGLU as it reads, rounding a to `in` exactly as launch_swiglu_forward (and its weighted
// form) does, so the copies are bit-identical to quantizing their output, which is never written.
// splits are required: rows without data read as zeros (their gate, up and weight are not read).
void launch_quantize_mxfp8_swiglu(DType in, const void* gate_up, const float* row_weight, int64_t capacity_rows,
                                  int64_t cols, const int64_t* offsets, const int32_t* splits, int groups,
                                  const Mxfp8Rowwise* rowwise, const Mxfp8Colwise* colwise, cudaStream_t stream);

// launch_quantize_mxfp8 of the SwiGLU's input gradient, for a = silu(gate) * up where gate_up is
// [capacity_rows, cols], each row's gate (cols / 2 columns) then its up (e.g. FC1's output), and da
// [capacity_rows, cols / 2] is a's gradient: the input is dgate | dup, computed as the quantizer reads
// and rounded to `in` exactly as launch_swiglu_backward computes and rounds it, so the copies are
// bit-identical to quantizing its output, which is never written (3 reads of 2 bytes per element of
// a instead of 3 reads and 2 writes by the SwiGLU backward, then 2 reads by the quantizer).
// cols is a multiple of 256 (each 32 x 128 tile lies in one half); splits are required (rows
// without data read as zeros; their gate, up and da are not read); da is 16-byte aligned.
void launch_quantize_mxfp8_swiglu_grad(DType in, const void* gate_up, const void* da, int64_t capacity_rows,
                                       int64_t cols, const int64_t* offsets, const int32_t* splits, int groups,
                                       const Mxfp8Rowwise* rowwise, const Mxfp8Colwise* colwise,
                                       cudaStream_t stream);

// Quantizes grouped weights w [groups, n, k] (bf16 or fp16), all rows of every expert:
//   rowwise: blocks along K (what fprop reads):  data [groups, n, k], scales [groups, n, k / 32]
//   colwise: blocks along N, each expert stored transposed (what dgrad reads, W_e^T):
//            data [groups, k, n], scales [groups, k, n / 32];
//            element (e, n', k') at (e * k + k') * n + n', block j at (e * k + k') * (n / 32) + j
// That is, W_e^T row-wise: not the activations' tiled column-wise layout (this one is a serving format).
// k is a multiple of 16 (of 32 for rowwise); n is a multiple of 32 for colwise; pointers as above.
// Either copy may also carry its bf16 values (Mxfp8Rowwise::values, Mxfp8Colwise::values: what
// dequantized_weights keeps), written from the codes in the same pass; here the codes are required.
// Launch as above, expert after expert, each expert's [n, k] tiles walked in bands of 32 row tiles
// (down a band within one 128-column strip, then the next strip: mxfp8.cu says why).
void launch_quantize_mxfp8_weights(DType in, const void* w, int groups, int64_t n, int64_t k,
                                   const Mxfp8Rowwise* rowwise, const Mxfp8Colwise* colwise,
                                   cudaStream_t stream);

// The scales of a row-wise weight copy [groups, rows, cols] (scales [groups, rows, cols / 32]) in
// the swap-AB GEMM's tile order (Mxfp8RaggedGemmParams::b_scales_tiled): for each group, each tile
// of 128 rows (the last one padded) and each stage of 128 columns, 128 words of 4 bytes, row after
// row, a row's word holding its 4 scale bytes of the stage in order:
//   byte (g, r, j) at ((g * ceil(rows / 128) + r / 128) * ceil(cols / 128) + j / 4) * 512 + (r % 128) * 4 + j % 4
// Padding (rows past `rows`, blocks past cols / 32) is zero. So one stage of one tile is one
// contiguous 512-byte copy, where the row-wise order puts its 128 words cols / 32 bytes apart.
// rows >= 1, cols a positive multiple of 32; both pointers 16-byte aligned; groups >= 1.
// Unchecked: the caller bounds the sizes first (the public mxfp8_tiled_scale_bytes does).
constexpr int64_t mxfp8_tiled_scale_bytes(int64_t groups, int64_t rows, int64_t cols) {
  return groups * ((rows + kMxTileRows - 1) / kMxTileRows) * ((cols + kMxStageCols - 1) / kMxStageCols) *
         (kMxTileRows * kMxStageBlocks);
}
void launch_tile_mxfp8_scales(const uint8_t* scales, uint8_t* tiled, int groups, int64_t rows, int64_t cols,
                              cudaStream_t stream);

// y[r, c] = e4m3(data[r, c]) * 2^(scale - 127) in fp32, then rounded to nearest even into `out`
// (bf16, fp16, or fp32 as is), for the used rows [0, offsets[groups]) of a row-wise copy; a NaN
// scale (0xFF) or element (0x7F, 0xFF) gives NaN. Rows past offsets[groups] of y are untouched.
// cols is a multiple of 32; data and y are 16-byte aligned.
void launch_dequantize_mxfp8_rowwise(const uint8_t* data, const uint8_t* scales, DType out, void* y,
                                     int64_t capacity_rows, int64_t cols, const int64_t* offsets, int groups,
                                     cudaStream_t stream);

// The same for every row of a row-wise copy [rows, cols] into bf16 (the weights' copies, all
// experts: rows = G * N along K, or G * K along N for the transposed copy).
void launch_dequantize_mxfp8_weights(const uint8_t* data, const uint8_t* scales, void* y, int64_t rows, int64_t cols,
                                     cudaStream_t stream);

// A column-wise copy (tiled codes, block-major scales [capacity_rows / 32, cols]; Mxfp8Colwise)
// back to a row-major y [capacity_rows, cols] in `out`, for the used rows [0, offsets[groups]);
// the rest of y is untouched. capacity_rows is a multiple of 32, cols of 16; data and y 16-byte
// aligned. Values as launch_dequantize_mxfp8_rowwise.
void launch_dequantize_mxfp8_colwise(const uint8_t* data, const uint8_t* scales, DType out, void* y,
                                     int64_t capacity_rows, int64_t cols, const int64_t* offsets, int groups,
                                     cudaStream_t stream);

}  // namespace moegraph::kernels
