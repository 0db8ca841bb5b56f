#include "testing/mxfp8_reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "testing/data.hpp"

namespace moegraph::testing {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("mxfp8 reference: ") + what);
}

// Nearest integer to a non-negative q, ties to the even one (independent of the FPU rounding mode).
double round_half_even(double q) {
  const double down = std::floor(q), rest = q - down;
  if (rest > 0.5 || (rest == 0.5 && std::fmod(down, 2.0) != 0.0)) return down + 1.0;
  return down;
}

// Row-wise blocks of `rows` rows of length `cols` starting at x, codes and scales alike.
void quantize_rows(const double* x, int64_t rows, int64_t cols, uint8_t* data, uint8_t* scales) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < cols / kMxBlockSize; ++b) {
      const int64_t at = r * cols + b * kMxBlockSize;
      scales[r * (cols / kMxBlockSize) + b] =
          mx_quantize_block({x + at, kMxBlockSize}, {data + at, kMxBlockSize});
    }
}

// Column-wise blocks of rows [0, used_rows) of x [rows, cols] into data [cols, rows] and scales
// block-major [rows / 32, cols] (activations) or [cols, rows / 32] (the weights' transposed copy).
void quantize_columns(const double* x, int64_t rows, int64_t cols, int64_t used_rows, uint8_t* data,
                      uint8_t* scales, bool block_major) {
  double column[kMxBlockSize];
  uint8_t codes[kMxBlockSize];
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r0 = 0; r0 < used_rows; r0 += kMxBlockSize) {
      const int64_t n = std::min<int64_t>(kMxBlockSize, used_rows - r0);
      for (int64_t i = 0; i < n; ++i) column[i] = x[(r0 + i) * cols + c];
      const int64_t j = r0 / kMxBlockSize;
      scales[block_major ? j * cols + c : c * (rows / kMxBlockSize) + j] =
          mx_quantize_block({column, static_cast<std::size_t>(n)}, {codes, static_cast<std::size_t>(n)});
      for (int64_t i = 0; i < n; ++i)
        data[block_major ? mx_colwise_index(r0 + i, c, rows, cols) : c * rows + r0 + i] = codes[i];
    }
}

}  // namespace

int64_t mx_colwise_index(int64_t r, int64_t c, int64_t rows, int64_t cols) {
  constexpr int64_t kStrip = 128;
  const int64_t first = c / kStrip * kStrip, width = std::min(kStrip, cols - first);
  return first * rows + (r / kMxBlockSize * width + (c - first)) * kMxBlockSize + r % kMxBlockSize;
}

double e4m3_decode(uint8_t code) {
  const int magnitude = code & 0x7f;
  if (magnitude == 0x7f) return kNaN;
  const int exponent = magnitude >> 3, mantissa = magnitude & 7;
  // Subnormal: m * 2^-9; normal: (1 + m/8) * 2^(e - 7) = (8 + m) * 2^(e - 10).
  const double v = exponent == 0 ? std::ldexp(mantissa, -9) : std::ldexp(8 + mantissa, exponent - 10);
  return (code & 0x80) != 0 ? -v : v;
}

uint8_t e4m3_encode(double v) {
  if (std::isnan(v)) return 0x7f;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0x00;
  const double a = std::fabs(v);
  if (a >= kE4m3MaxNormal) return sign | 0x7e;  // also everything that would round past 448
  if (a == 0.0) return sign;
  int exp2 = 0;
  std::frexp(a, &exp2);                   // a in [2^(exp2 - 1), 2^exp2)
  const int p = std::max(exp2 - 1, -6);   // the binade; below 2^-6 the subnormal spacing applies
  // Eight codes per binade: spacing 2^(p - 3) (2^-9 for subnormals). n in [0, 16] steps of it.
  const double n = round_half_even(std::ldexp(a, 3 - p));
  // Code of n * 2^(p - 3): exponent field p + 7, mantissa n - 8 (n = 16 carries into the next
  // binade; for p = -6 the code is n itself, which covers the subnormals).
  const int code = std::min(8 * (p + 7) + static_cast<int>(n) - 8, 0x7e);
  return static_cast<uint8_t>(sign | code);
}

double e8m0_decode(uint8_t byte) { return byte == 0xff ? kNaN : std::ldexp(1.0, byte - 127); }

std::vector<float> e8m0_floats(std::span<const uint8_t> scales, int64_t rows, int64_t cols) {
  const int64_t blocks = cols / kMxBlockSize, stages = (cols + 127) / 128;
  require(rows >= 0 && cols % kMxBlockSize == 0 && static_cast<int64_t>(scales.size()) == rows * blocks,
          "e8m0_floats: scales must be [rows, cols / 32]");
  std::vector<float> floats(static_cast<std::size_t>(stages * rows * 4), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < blocks; ++j)
      floats[static_cast<std::size_t>(((j / 4) * rows + r) * 4 + j % 4)] =
          static_cast<float>(e8m0_decode(scales[static_cast<std::size_t>(r * blocks + j)]));
  return floats;
}

std::vector<uint8_t> tiled_scales(std::span<const uint8_t> scales, int64_t groups, int64_t rows, int64_t cols) {
  const int64_t blocks = cols / kMxBlockSize, row_tiles = (rows + 127) / 128, stages = (cols + 127) / 128;
  require(groups >= 1 && rows >= 1 && cols % kMxBlockSize == 0 &&
              static_cast<int64_t>(scales.size()) == groups * rows * blocks,
          "tiled_scales: scales must be [groups, rows, cols / 32]");
  std::vector<uint8_t> tiled(static_cast<std::size_t>(groups * row_tiles * stages * 512), 0x7f);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < blocks; ++j)
        tiled[static_cast<std::size_t>(((g * row_tiles + r / 128) * stages + j / 4) * 512 + (r % 128) * 4 + j % 4)] =
            scales[static_cast<std::size_t>((g * rows + r) * blocks + j)];
  return tiled;
}

uint8_t e8m0_scale_for(double amax) {
  require(std::isfinite(amax) && amax >= 0.0, "the scale of a block needs a finite amax >= 0");
  if (amax == 0.0) return 0;
  int exp2 = 0;
  std::frexp(amax, &exp2);  // amax >= 2^(exp2 - 1) > 448 * 2^(exp2 - 10): start below the answer
  int e = exp2 - 10;
  while (std::ldexp(kE4m3MaxNormal, e) < amax) ++e;
  return static_cast<uint8_t>(std::clamp(e, -127, 127) + 127);
}

uint8_t mx_quantize_block(std::span<const double> x, std::span<uint8_t> codes) {
  require(!x.empty() && x.size() <= kMxBlockSize && codes.size() == x.size(), "a block holds 1..32 elements");
  double amax = 0.0;
  for (double v : x) {
    if (!std::isfinite(v)) {
      std::fill(codes.begin(), codes.end(), uint8_t{0x7f});
      return 0xff;
    }
    amax = std::max(amax, std::fabs(v));
  }
  const uint8_t scale = e8m0_scale_for(amax);
  for (std::size_t i = 0; i < x.size(); ++i) codes[i] = e4m3_encode(std::ldexp(x[i], 127 - scale));
  return scale;
}

MxBuffer mx_buffer(int64_t rows, int64_t cols, uint8_t fill) {
  require(rows >= 0 && cols >= 0 && rows * cols % kMxBlockSize == 0, "a buffer holds whole blocks");
  return MxBuffer{std::vector<uint8_t>(rows * cols, fill), std::vector<uint8_t>(rows * cols / kMxBlockSize, fill)};
}

void mx_quantize_rowwise(const std::vector<double>& x, int64_t rows, int64_t cols, int64_t used_rows, MxBuffer& out) {
  require(cols % kMxBlockSize == 0 && used_rows >= 0 && used_rows <= rows, "row-wise: cols % 32, used_rows <= rows");
  require(static_cast<int64_t>(x.size()) == rows * cols && static_cast<int64_t>(out.data.size()) == rows * cols,
          "row-wise: sizes");
  quantize_rows(x.data(), used_rows, cols, out.data.data(), out.scales.data());
}

void mx_quantize_colwise(const std::vector<double>& x, int64_t rows, int64_t cols, int64_t used_rows, MxBuffer& out) {
  require(rows % kMxBlockSize == 0 && used_rows >= 0 && used_rows <= rows, "column-wise: rows % 32, used_rows <= rows");
  require(static_cast<int64_t>(x.size()) == rows * cols && static_cast<int64_t>(out.data.size()) == rows * cols,
          "column-wise: sizes");
  quantize_columns(x.data(), rows, cols, used_rows, out.data.data(), out.scales.data(), /*block_major=*/true);
}

void mx_quantize_weights(const std::vector<double>& w, int groups, int64_t n, int64_t k, MxBuffer* rowwise,
                         MxBuffer* colwise) {
  const int64_t per_expert = n * k;
  require(static_cast<int64_t>(w.size()) == groups * per_expert, "weights: sizes");
  for (int g = 0; g < groups; ++g) {
    const double* expert = w.data() + g * per_expert;
    if (rowwise != nullptr) {
      require(k % kMxBlockSize == 0, "weights row-wise: k % 32");
      quantize_rows(expert, n, k, rowwise->data.data() + g * per_expert,
                    rowwise->scales.data() + g * per_expert / kMxBlockSize);
    }
    if (colwise != nullptr) {
      require(n % kMxBlockSize == 0, "weights column-wise: n % 32");
      quantize_columns(expert, n, k, n, colwise->data.data() + g * per_expert,
                       colwise->scales.data() + g * per_expert / kMxBlockSize, /*block_major=*/false);
    }
  }
}

namespace {
// One element's value: e4m3 * 2^(scale - 127) as fp32, then rounded into `out`.
double dequantized(uint8_t code, uint8_t scale, DType out) {
  const double fp32_overflow = std::ldexp(1.0, 128);  // products have 4 significant bits: >= 2^128 is Inf
  const double exact = e4m3_decode(code) * e8m0_decode(scale);  // NaN propagates
  const double fp32 = std::fabs(exact) >= fp32_overflow ? std::copysign(HUGE_VAL, exact)
                                                        : static_cast<double>(static_cast<float>(exact));
  return out == DType::kFP32 ? fp32 : round_to(fp32, out);
}
}  // namespace

std::vector<double> mx_dequantize_rowwise(const MxBuffer& q, int64_t cols, int64_t used_rows, DType out) {
  require(cols % kMxBlockSize == 0 && static_cast<int64_t>(q.data.size()) >= used_rows * cols, "dequantize: sizes");
  std::vector<double> y(used_rows * cols);
  for (int64_t i = 0; i < used_rows * cols; ++i) y[i] = dequantized(q.data[i], q.scales[i / kMxBlockSize], out);
  return y;
}

std::vector<double> mx_dequantize_colwise(const MxBuffer& q, int64_t rows, int64_t cols, int64_t used_rows, DType out) {
  require(rows % kMxBlockSize == 0 && used_rows >= 0 && used_rows <= rows &&
              static_cast<int64_t>(q.data.size()) == rows * cols,
          "dequantize column-wise: sizes");
  std::vector<double> y(used_rows * cols);
  for (int64_t r = 0; r < used_rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      y[r * cols + c] =
          dequantized(q.data[mx_colwise_index(r, c, rows, cols)], q.scales[r / kMxBlockSize * cols + c], out);
  return y;
}

}  // namespace moegraph::testing
