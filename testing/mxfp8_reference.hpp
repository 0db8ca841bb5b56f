// The host reference of MXFP8 (OCP Microscaling: E4M3 elements, one E8M0 scale per 32) with the
// rules of docs/mxfp8.md, in plain C++ on doubles (frexp/ldexp), written apart from the device code
// (kernels/quantize/mxfp8.cu) so that the GPU tests compare two independent implementations
// bit for bit. Inputs are values already rounded to bf16/fp16 (NaN and ±Inf allowed).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moegraph/types.hpp"

namespace moegraph::testing {

inline constexpr int kMxBlockSize = 32;
inline constexpr double kE4m3MaxNormal = 448.0;

// E4M3 (bias 7, no Inf): the value of a code; NaN for 0x7F and 0xFF, -0.0 for 0x80.
double e4m3_decode(uint8_t code);
// Round to nearest, ties to even, into E4M3 including subnormals; a result of zero keeps the sign;
// |v| >= 448 (and ±Inf) saturates to ±448 (0x7E / 0xFE); NaN -> 0x7F.
uint8_t e4m3_encode(double v);
// E8M0: 2^(byte - 127); NaN for 0xFF.
double e8m0_decode(uint8_t byte);
// The row-wise scales [rows, cols / 32] of a [rows, cols] copy as the fp32 values the swap-AB GEMM
// reads (Mxfp8Rowwise::scale_floats): e8m0_decode of each, exact in fp32 (2^-127 a subnormal), in
// its stage-major order [ceil(cols / 128)][rows][4] (block j of row r at ((j / 4) * rows + r) * 4 +
// j % 4); slots past a row's blocks hold zero.
std::vector<float> e8m0_floats(std::span<const uint8_t> scales, int64_t rows, int64_t cols);
// The row-wise scales [groups, rows, cols / 32] of a weight copy in the swap-AB GEMM's tile order
// (Mxfp8Weights::scales_tiled): per group, tile of 128 rows and stage of 128 columns, 128 rows of 4
// bytes (byte j % 4 of the row's word holds block j); padding 0x7F (a scale of 1).
std::vector<uint8_t> tiled_scales(std::span<const uint8_t> scales, int64_t groups, int64_t rows, int64_t cols);
// The scale rule for a finite amax >= 0: the smallest e with amax <= 448 * 2^e, clamped into
// [-127, 127], as the byte e + 127 (amax = 0 gives byte 0).
uint8_t e8m0_scale_for(double amax);

// One block (1..32 elements; a short block is the tail of a partial column): returns the scale
// byte and writes one code per element. Any NaN or ±Inf: scale 0xFF and every code 0x7F.
uint8_t mx_quantize_block(std::span<const double> x, std::span<uint8_t> codes);

// A host copy of either MXFP8 layout of a [rows, cols] tensor (see kernels/quantize/mxfp8.hpp):
//   row-wise:    data [rows, cols], scales [rows, cols / 32]
//   column-wise: data tiled (mx_colwise_index), scales [rows / 32, cols] (block-major); the
//                weights' transposed copy from mx_quantize_weights: data [k, n] and scales
//                [k, n / 32] per expert (W_e^T row-wise)
struct MxBuffer {
  std::vector<uint8_t> data, scales;
};
// Where element (r, c) of a [rows, cols] tensor lies in its column-wise data: 128-column strips
// one after another, each [rows / 32 blocks][its columns][32 rows].
int64_t mx_colwise_index(int64_t r, int64_t c, int64_t rows, int64_t cols);
// Both arrays of a copy of a [rows, cols] tensor, every byte `fill` (0xFF: the device poison).
MxBuffer mx_buffer(int64_t rows, int64_t cols, uint8_t fill = 0xff);

// Quantizes the used rows [0, used_rows) of x [rows, cols] into `out` (made by mx_buffer(rows,
// cols)); the bytes of the other rows are left as they are. Column-wise: rows is a multiple of 32
// and the last block of a column may be short (used_rows not a multiple of 32).
void mx_quantize_rowwise(const std::vector<double>& x, int64_t rows, int64_t cols, int64_t used_rows, MxBuffer& out);
void mx_quantize_colwise(const std::vector<double>& x, int64_t rows, int64_t cols, int64_t used_rows, MxBuffer& out);
// Weights w [groups, n, k]: row-wise [groups, n, k] (blocks along k) and column-wise, each expert
// transposed, [groups, k, n] (blocks along n). Either output may be null.
void mx_quantize_weights(const std::vector<double>& w, int groups, int64_t n, int64_t k, MxBuffer* rowwise,
                         MxBuffer* colwise);

// The first used_rows rows of a row-wise copy [rows, cols]: e4m3 * 2^(scale - 127) as fp32, then
// rounded to nearest even into `out` (fp32 kept as is); NaN where the code or the scale is NaN.
// Returns used_rows * cols values.
std::vector<double> mx_dequantize_rowwise(const MxBuffer& q, int64_t cols, int64_t used_rows, DType out);
// The same for the first used_rows rows of an activations' column-wise copy [rows, cols] (tiled
// data, block-major scales), returned row-major: used_rows * cols values.
std::vector<double> mx_dequantize_colwise(const MxBuffer& q, int64_t rows, int64_t cols, int64_t used_rows, DType out);

}  // namespace moegraph::testing
