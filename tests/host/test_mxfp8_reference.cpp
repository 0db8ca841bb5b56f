// The MXFP8 host reference (testing/mxfp8_reference.hpp) against hand-computed values and
// exhaustive properties of the E4M3 / E8M0 formats and the block rules of docs/mxfp8.md.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "testing/data.hpp"
#include "testing/mxfp8_reference.hpp"

namespace moegraph::test {
namespace {

using namespace ::moegraph::testing;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double p2(int e) { return std::ldexp(1.0, e); }

// The OCP table from its definition, by field extraction (a second route to e4m3_decode's values).
double ocp_e4m3(int code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return kNaN;
  const double magnitude = e == 0 ? (m / 8.0) * std::pow(2.0, -6) : (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return s ? -magnitude : magnitude;
}

TEST(Mxfp8Reference, E4m3HandValues) {
  EXPECT_EQ(e4m3_decode(0x00), 0.0);
  EXPECT_FALSE(std::signbit(e4m3_decode(0x00)));
  EXPECT_EQ(e4m3_decode(0x80), 0.0);
  EXPECT_TRUE(std::signbit(e4m3_decode(0x80)));  // -0
  EXPECT_EQ(e4m3_decode(0x01), p2(-9));          // smallest subnormal
  EXPECT_EQ(e4m3_decode(0x07), 7 * p2(-9));      // largest subnormal
  EXPECT_EQ(e4m3_decode(0x08), p2(-6));          // smallest normal
  EXPECT_EQ(e4m3_decode(0x38), 1.0);
  EXPECT_EQ(e4m3_decode(0x39), 1.125);
  EXPECT_EQ(e4m3_decode(0x3f), 1.875);
  EXPECT_EQ(e4m3_decode(0x40), 2.0);
  EXPECT_EQ(e4m3_decode(0x77), 240.0);
  EXPECT_EQ(e4m3_decode(0x78), 256.0);
  EXPECT_EQ(e4m3_decode(0x7e), 448.0);  // largest normal
  EXPECT_EQ(e4m3_decode(0xfe), -448.0);
  EXPECT_EQ(e4m3_decode(0xb8), -1.0);
  EXPECT_EQ(e4m3_decode(0x81), -p2(-9));
  EXPECT_TRUE(std::isnan(e4m3_decode(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_decode(0xff)));
}

TEST(Mxfp8Reference, E4m3AllCodesMatchTheOcpTable) {
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const double want = ocp_e4m3(c), got = e4m3_decode(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      ++nans;
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      continue;
    }
    EXPECT_EQ(got, want) << "code " << c;
    EXPECT_EQ(std::signbit(got), c >= 128) << "code " << c;
  }
  EXPECT_EQ(nans, 2);
  // Positive codes increase strictly: the table has no gaps or repeats.
  for (int c = 0; c < 0x7e; ++c) EXPECT_LT(e4m3_decode(c), e4m3_decode(c + 1)) << "code " << c;
}

TEST(Mxfp8Reference, E4m3EncodeInvertsDecodeForEveryCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(e4m3_encode(e4m3_decode(static_cast<uint8_t>(c))), c) << "code " << c;
  }
}

TEST(Mxfp8Reference, E4m3RoundsToNearestTiesToEven) {
  for (int c = 0; c < 0x7e; ++c) {  // every pair of neighbouring positive codes, subnormals included
    const double lo = e4m3_decode(c), hi = e4m3_decode(c + 1), mid = (lo + hi) / 2;
    const int even = (c % 2 == 0) ? c : c + 1;  // the code's low bit is the mantissa's
    EXPECT_EQ(e4m3_encode(mid), even) << "midpoint of codes " << c << " and " << c + 1;
    EXPECT_EQ(e4m3_encode(-mid), even | 0x80) << "negative midpoint of codes " << c << " and " << c + 1;
    EXPECT_EQ(e4m3_encode(std::nextafter(mid, 0.0)), c) << "just below the midpoint of " << c;
    EXPECT_EQ(e4m3_encode(std::nextafter(mid, kInf)), c + 1) << "just above the midpoint of " << c;
    EXPECT_EQ(e4m3_encode(lo + (hi - lo) / 4), c);
    EXPECT_EQ(e4m3_encode(hi - (hi - lo) / 4), c + 1);
  }
  // By hand: 1.0625 lies between 1 (0x38) and 1.125 (0x39): tie to 0x38; 1.1875 to 0x3A (1.25).
  EXPECT_EQ(e4m3_encode(1.0625), 0x38);
  EXPECT_EQ(e4m3_encode(1.1875), 0x3a);
  // Subnormals: 2^-10 is the tie between 0 and 2^-9 -> 0; 1.5 * 2^-9 -> 2 * 2^-9 (0x02).
  EXPECT_EQ(e4m3_encode(p2(-10)), 0x00);
  EXPECT_EQ(e4m3_encode(-p2(-10)), 0x80);
  EXPECT_EQ(e4m3_encode(std::nextafter(p2(-10), 1.0)), 0x01);
  EXPECT_EQ(e4m3_encode(1.5 * p2(-9)), 0x02);
  EXPECT_EQ(e4m3_encode(2.5 * p2(-9)), 0x02);
  // The subnormal / normal boundary: 7.5 * 2^-9 is the tie between 0x07 and 0x08 (2^-6) -> 0x08.
  EXPECT_EQ(e4m3_encode(7.5 * p2(-9)), 0x08);
  // Rounding up carries into the next binade: 1.9375 (tie between 1.875 and 2) -> 2.0 (0x40).
  EXPECT_EQ(e4m3_encode(1.9375), 0x40);
}

TEST(Mxfp8Reference, E4m3SignedZeroAndTinyValues) {
  EXPECT_EQ(e4m3_encode(0.0), 0x00);
  EXPECT_EQ(e4m3_encode(-0.0), 0x80);
  EXPECT_EQ(e4m3_encode(p2(-30)), 0x00);
  EXPECT_EQ(e4m3_encode(-p2(-30)), 0x80);  // rounds to zero, keeps the sign
  EXPECT_EQ(e4m3_encode(std::numeric_limits<double>::denorm_min()), 0x00);
}

TEST(Mxfp8Reference, E4m3Saturates) {
  EXPECT_EQ(e4m3_encode(448.0), 0x7e);
  EXPECT_EQ(e4m3_encode(449.0), 0x7e);
  EXPECT_EQ(e4m3_encode(464.0), 0x7e);  // the tie toward a 480 that does not exist
  EXPECT_EQ(e4m3_encode(500.0), 0x7e);
  EXPECT_EQ(e4m3_encode(1e30), 0x7e);
  EXPECT_EQ(e4m3_encode(-1e30), 0xfe);
  EXPECT_EQ(e4m3_encode(kInf), 0x7e);
  EXPECT_EQ(e4m3_encode(-kInf), 0xfe);
  EXPECT_EQ(e4m3_encode(440.0), 0x7e);   // between 416 (0x7D) and 448, nearer 448
  EXPECT_EQ(e4m3_encode(432.0), 0x7e);   // the tie between 416 and 448 -> even mantissa 6 (0x7E)
  EXPECT_EQ(e4m3_encode(431.0), 0x7d);
  EXPECT_EQ(e4m3_encode(kNaN), 0x7f);
  EXPECT_EQ(e4m3_encode(-kNaN), 0x7f);
}

TEST(Mxfp8Reference, E8m0Values) {
  EXPECT_EQ(e8m0_decode(127), 1.0);
  EXPECT_EQ(e8m0_decode(0), p2(-127));
  EXPECT_EQ(e8m0_decode(254), p2(127));
  EXPECT_EQ(e8m0_decode(128), 2.0);
  EXPECT_TRUE(std::isnan(e8m0_decode(255)));
}

TEST(Mxfp8Reference, ScaleRuleEdges) {
  EXPECT_EQ(e8m0_scale_for(448.0), 127);  // exactly 448: s = 1
  EXPECT_EQ(e8m0_scale_for(449.0), 128);  // just above: s = 2
  EXPECT_EQ(e8m0_scale_for(std::nextafter(448.0, kInf)), 128);
  EXPECT_EQ(e8m0_scale_for(224.0), 126);  // 224 <= 448 / 2: s = 1/2
  EXPECT_EQ(e8m0_scale_for(224.5), 127);
  EXPECT_EQ(e8m0_scale_for(1.0), 119);    // 1 <= 448 * 2^-8
  EXPECT_EQ(e8m0_scale_for(1.75), 119);   // 1.75 = 448 * 2^-8 exactly
  EXPECT_EQ(e8m0_scale_for(1.76), 120);
  for (int k = -127; k <= 127; ++k) {
    EXPECT_EQ(e8m0_scale_for(448.0 * p2(k)), 127 + k) << "amax = 448 * 2^" << k;
    if (k < 127) {
      EXPECT_EQ(e8m0_scale_for(std::nextafter(448.0 * p2(k), kInf)), 128 + k) << "just above 448 * 2^" << k;
    }
  }
  // Clamps: every amax below 448 * 2^-127 is byte 0, everything past 448 * 2^127 byte 254.
  EXPECT_EQ(e8m0_scale_for(0.0), 0);
  EXPECT_EQ(e8m0_scale_for(p2(-133)), 0);  // the smallest bf16 subnormal
  EXPECT_EQ(e8m0_scale_for(p2(-126)), 0);
  EXPECT_EQ(e8m0_scale_for(448.0 * p2(200)), 254);
  // The largest bf16, (2 - 2^-7) * 2^127, needs 2^120 (byte 247); the largest fp16, 65504, 2^8.
  EXPECT_EQ(e8m0_scale_for((2.0 - p2(-7)) * p2(127)), 247);
  EXPECT_EQ(e8m0_scale_for(65504.0), 135);
  EXPECT_THROW(e8m0_scale_for(kInf), std::invalid_argument);
}

std::array<uint8_t, 32> codes_of(const std::array<double, 32>& x, uint8_t& scale) {
  std::array<uint8_t, 32> codes{};
  scale = mx_quantize_block(x, codes);
  return codes;
}

TEST(Mxfp8Reference, BlockAllZero) {
  std::array<double, 32> x{};
  x[5] = -0.0;
  uint8_t scale = 0xaa;
  const auto codes = codes_of(x, scale);
  EXPECT_EQ(scale, 0x00);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(codes[i], i == 5 ? 0x80 : 0x00) << i;
}

TEST(Mxfp8Reference, BlockWithNaNOrInfIsNaN) {
  for (double bad : {kNaN, kInf, -kInf}) {
    std::array<double, 32> x{};
    for (int i = 0; i < 32; ++i) x[i] = i * 0.5 - 3;
    x[17] = bad;
    uint8_t scale = 0;
    const auto codes = codes_of(x, scale);
    EXPECT_EQ(scale, 0xff) << bad;
    for (int i = 0; i < 32; ++i) EXPECT_EQ(codes[i], 0x7f) << bad << " element " << i;
  }
}

TEST(Mxfp8Reference, BlockScaleAndCodesByHand) {
  // amax 448: s = 1, every value stays; 3.0 = 1.5 * 2 -> exponent field 8, mantissa 4 (0x44).
  std::array<double, 32> x{};
  x[0] = 448.0;
  x[1] = -3.0;
  x[2] = 0.0078125;  // 2^-7, below 2^-6: the subnormal 4 * 2^-9 (0x04)
  uint8_t scale = 0;
  auto codes = codes_of(x, scale);
  EXPECT_EQ(scale, 127);
  EXPECT_EQ(codes[0], 0x7e);
  EXPECT_EQ(codes[1], 0xc4);
  EXPECT_EQ(codes[2], 0x04);
  // amax 449 (not a bf16, but a valid double input): s = 2, 449 / 2 = 224.5 -> 224 (0x76).
  x[0] = 449.0;
  codes = codes_of(x, scale);
  EXPECT_EQ(scale, 128);
  EXPECT_EQ(codes[0], 0x76);
  EXPECT_EQ(codes[1], 0xbc);  // -1.5
  EXPECT_EQ(codes[2], 0x02);  // 2^-8 = 2 * 2^-9
  // amax 448 * 2^20: s = 2^20.
  x[0] = 448.0 * p2(20);
  x[1] = -p2(20);
  codes = codes_of(x, scale);
  EXPECT_EQ(scale, 147);
  EXPECT_EQ(codes[0], 0x7e);
  EXPECT_EQ(codes[1], 0xb8);
  EXPECT_EQ(codes[2], 0x00);  // 2^-27: far below E4M3 at this scale
}

TEST(Mxfp8Reference, OneHugeValueAmongTinyOnes) {
  // amax 1024 = 2^10 needs s = 4 (1024 / 2 = 512 > 448): the huge value becomes 256 (0x78) and the
  // tiny ones land on E4M3 subnormals (quantum 2^-9 * 4 = 2^-7) or flush to signed zero.
  std::array<double, 32> x{};
  x[0] = 1024.0;
  x[1] = p2(-7);          // q = 2^-9          -> 0x01
  x[2] = 3 * p2(-8);      // q = 1.5 * 2^-9    -> tie, even 2 -> 0x02
  x[3] = p2(-8);          // q = 2^-10         -> tie, even 0 -> 0x00
  x[4] = -p2(-8);         //                   -> 0x80
  x[5] = 5 * p2(-9);      // q = 1.25 * 2^-9   -> 0x01
  x[6] = -p2(-20);        // q = 2^-22         -> 0x80
  x[7] = p2(-4);          // q = 2^-6          -> smallest normal 0x08
  x[8] = 0.1;             // q = 0.025 = 1.6 * 2^-6: quantum 2^-9 -> 12.8 -> 13 -> 0x0D
  uint8_t scale = 0;
  const auto codes = codes_of(x, scale);
  EXPECT_EQ(scale, 129);
  const std::array<uint8_t, 9> want{0x78, 0x01, 0x02, 0x00, 0x80, 0x01, 0x80, 0x08, 0x0d};
  for (int i = 0; i < 9; ++i) EXPECT_EQ(codes[i], want[i]) << "element " << i;
  for (int i = 9; i < 32; ++i) EXPECT_EQ(codes[i], 0x00) << "element " << i;
}

TEST(Mxfp8Reference, Bf16SubnormalBlockUsesTheClampedScale) {
  // amax 2^-130 (a bf16 subnormal) would want s = 2^-138: clamped to 2^-127 (byte 0), so
  // q = x * 2^127: 2^-130 -> 2^-3 (0x20), 2^-133 -> 2^-6 (0x08), -3 * 2^-133 -> -1.5 * 2^-5 (0x94).
  std::array<double, 32> x{};
  x[0] = p2(-130);
  x[1] = p2(-133);
  x[2] = -3 * p2(-133);
  uint8_t scale = 0xaa;
  const auto codes = codes_of(x, scale);
  EXPECT_EQ(scale, 0x00);
  EXPECT_EQ(codes[0], 0x20);
  EXPECT_EQ(codes[1], 0x08);
  EXPECT_EQ(codes[2], 0x94);
  // At the clamp: amax 448 * 2^-127 is still byte 0 (q = 448), the next bf16 above it byte 1.
  std::array<uint8_t, 32> c{};
  x[0] = 448.0 * p2(-127);
  EXPECT_EQ(mx_quantize_block(x, c), 0x00);
  EXPECT_EQ(c[0], 0x7e);
  x[0] = round_to(450.0 * p2(-127), DType::kBF16);
  EXPECT_EQ(x[0], 450.0 * p2(-127));
  EXPECT_EQ(mx_quantize_block(x, c), 0x01);
  EXPECT_EQ(c[0], 0x76);  // 450 / 2 = 225 -> 224
}

TEST(Mxfp8Reference, LayoutsAndDequantize) {
  // A [64, 160] tensor with 40 used rows: row-wise covers rows 0..39, column-wise blocks rows
  // 0..31 and a short block 32..39; the rest of both buffers keeps its fill. Column-wise data: a
  // strip of 128 columns, then one of 32, each [2 blocks][its columns][32 rows].
  const int64_t rows = 64, cols = 160, used = 40;
  std::vector<double> x(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) x[i] = round_to(std::sin(0.37 * i) * std::ldexp(1.0, i % 9 - 4), DType::kBF16);
  MxBuffer row = mx_buffer(rows, cols), col = mx_buffer(rows, cols);
  mx_quantize_rowwise(x, rows, cols, used, row);
  mx_quantize_colwise(x, rows, cols, used, col);
  std::array<uint8_t, 32> codes{};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < cols / 32; ++b) {
      const uint8_t s = r < used ? mx_quantize_block({x.data() + r * cols + 32 * b, 32}, codes) : 0xff;
      EXPECT_EQ(row.scales[r * (cols / 32) + b], s);
      for (int i = 0; i < 32; ++i) EXPECT_EQ(row.data[r * cols + 32 * b + i], r < used ? codes[i] : 0xff);
    }
  for (int64_t c = 0; c < cols; ++c) {
    // Written out: strip 0 is bytes [0, 128 * 64), block 1 of it starts at 32 * 128; strip 1 (32
    // columns) starts at 128 * 64, its block 1 at 128 * 64 + 32 * 32.
    const int64_t block0 = c < 128 ? c * 32 : 128 * 64 + (c - 128) * 32;
    const int64_t block1 = c < 128 ? 32 * 128 + c * 32 : 128 * 64 + 32 * 32 + (c - 128) * 32;
    EXPECT_EQ(mx_colwise_index(0, c, rows, cols), block0);
    EXPECT_EQ(mx_colwise_index(33, c, rows, cols), block1 + 1);
    std::array<double, 32> column{};
    for (int i = 0; i < 32; ++i) column[i] = x[i * cols + c];
    EXPECT_EQ(col.scales[c], mx_quantize_block(column, codes));  // block-major: block j at j * cols + c
    for (int i = 0; i < 32; ++i) EXPECT_EQ(col.data[block0 + i], codes[i]);
    for (int i = 0; i < 8; ++i) column[i] = x[(32 + i) * cols + c];
    EXPECT_EQ(col.scales[cols + c], mx_quantize_block({column.data(), 8}, {codes.data(), 8}));
    for (int i = 0; i < 8; ++i) EXPECT_EQ(col.data[block1 + i], codes[i]);
    for (int i = 8; i < 32; ++i) EXPECT_EQ(col.data[block1 + i], 0xff);
  }
  // Dequantized values are within half an E4M3 step of x, relative to the block's scale.
  const std::vector<double> y = mx_dequantize_rowwise(row, cols, used, DType::kFP32);
  ASSERT_EQ(y.size(), static_cast<std::size_t>(used * cols));
  for (int64_t i = 0; i < used * cols; ++i) {
    const double s = e8m0_decode(row.scales[i / 32]);
    EXPECT_LE(std::fabs(y[i] - x[i]), std::max(std::fabs(x[i]) / 16, s * p2(-10))) << i;
  }
}

TEST(Mxfp8Reference, DequantizeRoundsThroughFp32) {
  MxBuffer q = mx_buffer(1, 32);
  q.scales[0] = 127 + 20;
  q.data[0] = 0x39;  // 1.125 * 2^20
  q.data[1] = 0xff;  // NaN element
  q.data[2] = 0x80;  // -0
  q.data[3] = 0x7e;  // 448 * 2^20 = 469762048: past fp16 -> Inf
  for (int i = 4; i < 32; ++i) q.data[i] = 0x01;  // 2^-9 * 2^20 = 2048
  const auto bf = mx_dequantize_rowwise(q, 32, 1, DType::kBF16);
  EXPECT_EQ(bf[0], 1.125 * p2(20));
  EXPECT_TRUE(std::isnan(bf[1]));
  EXPECT_TRUE(bf[2] == 0.0 && std::signbit(bf[2]));
  EXPECT_EQ(bf[3], 448.0 * p2(20));
  EXPECT_EQ(bf[4], 2048.0);
  const auto h = mx_dequantize_rowwise(q, 32, 1, DType::kFP16);
  EXPECT_EQ(h[0], kInf);
  EXPECT_EQ(h[3], kInf);
  EXPECT_EQ(h[4], 2048.0);
  // A NaN scale makes the whole block NaN; the largest scale overflows fp32 to Inf.
  q.scales[0] = 0xff;
  for (double v : mx_dequantize_rowwise(q, 32, 1, DType::kFP32)) EXPECT_TRUE(std::isnan(v));
  q.scales[0] = 254;
  q.data[0] = 0x7e;  // 448 * 2^127
  q.data[2] = 0x38;  // 1 * 2^127: finite
  const auto f = mx_dequantize_rowwise(q, 32, 1, DType::kFP32);
  EXPECT_EQ(f[0], kInf);
  EXPECT_EQ(f[2], p2(127));
  // The smallest scale: 2^-9 * 2^-127 = 2^-136 is an exact fp32 subnormal, below bf16's smallest
  // subnormal 2^-133 (so bf16 rounds it to 0); 1 * 2^-127 is a bf16 subnormal; fp16 has neither.
  q.scales[0] = 0;
  q.data[4] = 0x01;
  q.data[5] = 0x38;
  const auto tiny32 = mx_dequantize_rowwise(q, 32, 1, DType::kFP32);
  const auto tiny_bf = mx_dequantize_rowwise(q, 32, 1, DType::kBF16);
  const auto tiny_h = mx_dequantize_rowwise(q, 32, 1, DType::kFP16);
  EXPECT_EQ(tiny32[4], p2(-136));
  EXPECT_EQ(tiny32[5], p2(-127));
  EXPECT_EQ(tiny_bf[4], 0.0);
  EXPECT_EQ(tiny_bf[5], p2(-127));
  EXPECT_EQ(tiny_h[4], 0.0);
  EXPECT_EQ(tiny_h[5], 0.0);
}

}  // namespace
}  // namespace moegraph::test
