// Shared by the MXFP8 quantizer GPU tests (test_mxfp8_quantize.cpp and
// test_mxfp8_quantize_shapes.cpp): poisoned device copies of the two layouts, byte-exact
// comparison, random data with several magnitudes per block, edge-case blocks, grouped inputs, one
// activation quantization run, and its check against the host reference (testing/mxfp8_reference.hpp).
#pragma once

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kernels/quantize/mxfp8.hpp"
#include "testing/device_array.hpp"
#include "testing/mxfp8_reference.hpp"
#include "tests/common/expect.hpp"

namespace moegraph::test {

using kernels::Mxfp8Colwise;
using kernels::Mxfp8Rowwise;

inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A device copy of one MXFP8 layout of a [rows, cols] tensor, poisoned (0xFF, which is also what
// the reference's mx_buffer holds), so bytes a kernel must leave alone can be checked.
struct DeviceMx {
  DeviceArray<uint8_t> data, scales;
  DeviceMx(int64_t rows, int64_t cols) : data(rows * cols), scales(rows * cols / 32) { poison(); }
  void poison() {
    data.poison();
    scales.poison();
  }
  Mxfp8Rowwise rowwise() const { return {data.get(), scales.get()}; }
  Mxfp8Colwise colwise() const { return {data.get(), scales.get()}; }
  MxBuffer download() const { return {data.download(), scales.download()}; }
};

inline ::testing::AssertionResult same_bytes(const std::string& what, const std::vector<uint8_t>& got,
                                             const std::vector<uint8_t>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": " << got.size() << " bytes, want " << want.size();
  std::size_t mismatches = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i] && mismatches++ == 0) first = i;
  if (mismatches == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << mismatches << " of " << got.size()
                                       << " bytes differ; first at index " << first << ": got 0x" << std::hex
                                       << int{got[first]} << ", want 0x" << int{want[first]};
}

inline ::testing::AssertionResult same_mx(const std::string& what, const MxBuffer& got, const MxBuffer& want) {
  ::testing::AssertionResult data = same_bytes(what + " data", got.data, want.data);
  if (!data) return data;
  return same_bytes(what + " scales", got.scales, want.scales);
}

inline std::vector<uint16_t> bits_of(const std::vector<double>& v, DType t) {
  std::vector<uint16_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = to_bits(v[i], t);
  return out;
}

// Values with several magnitudes in every block, along rows and along columns: each 32 x 32 tile
// gets a base binade, each element a random sign, mantissa and a place 0..14 binades below it
// (1 in 64 is ±0); rounded to `t`. bf16 bases reach 2^±60 and the subnormals, fp16 bases its
// whole range including subnormals.
inline std::vector<double> mixed_values(std::mt19937_64& rng, int64_t rows, int64_t cols, DType t) {
  static constexpr int kBf16Bases[] = {0, 7, -9, 60, -60, -120, -128, 100, -30, 3};
  static constexpr int kFp16Bases[] = {0, 5, -8, 12, -14, -18, 2, -3};
  const std::span<const int> bases = t == DType::kBF16 ? std::span<const int>(kBf16Bases) : std::span<const int>(kFp16Bases);
  std::uniform_int_distribution<int> pick(0, static_cast<int>(bases.size()) - 1), below(0, 14), zero(0, 63);
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  const int64_t tiles_per_row = (cols + 31) / 32;
  std::vector<int> tile_base(((rows + 31) / 32) * tiles_per_row);
  for (int& b : tile_base) b = bases[pick(rng)];
  std::vector<double> x(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const double sign = (rng() & 1) != 0 ? -1.0 : 1.0;
      const int base = tile_base[(r / 32) * tiles_per_row + c / 32];
      const double v = zero(rng) == 0 ? 0.0 : std::ldexp(mantissa(rng), base - below(rng));
      x[r * cols + c] = round_to(sign * v, t);
    }
  return x;
}

enum class Edge { kZero, kHugeAmongTiny, kSubnormal, kMax448, kAbove448, kNaN, kPosInf, kNegInf };
inline constexpr Edge kEdges[] = {Edge::kZero,     Edge::kHugeAmongTiny, Edge::kSubnormal, Edge::kMax448,
                                  Edge::kAbove448, Edge::kNaN,           Edge::kPosInf,    Edge::kNegInf};

// The 32 values of an edge-case block, already in `t`.
inline std::array<double, 32> edge_block(Edge e, DType t, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::array<double, 32> v{};
  for (double& x : v) x = u(rng);
  const bool bf16 = t == DType::kBF16;
  switch (e) {
    case Edge::kZero:
      v.fill(0.0);
      v[3] = v[30] = -0.0;
      break;
    case Edge::kHugeAmongTiny:  // s = 16: the tiny ones land on E4M3 subnormals or flush to ±0
      for (int i = 0; i < 32; ++i) v[i] = u(rng) * std::ldexp(1.0, -2 - i % 12);
      v[11] = -6144.0;
      break;
    case Edge::kSubnormal: {  // every element a subnormal of `t` (m * its smallest subnormal)
      std::uniform_int_distribution<int> m(1, bf16 ? 127 : 1023);
      for (double& x : v) x = ((rng() & 1) != 0 ? -1 : 1) * m(rng) * std::ldexp(1.0, bf16 ? -133 : -24);
      break;
    }
    case Edge::kMax448:
      for (double& x : v) x *= 448.0;
      v[0] = 448.0;
      v[7] = -448.0;
      break;
    case Edge::kAbove448:  // the next value of `t` above 448: s = 2
      for (double& x : v) x *= 448.0;
      v[5] = bf16 ? 450.0 : 448.25;
      v[9] = -v[5];
      break;
    case Edge::kNaN: v[13] = kNaN; break;
    case Edge::kPosInf: v[20] = kInf; break;
    case Edge::kNegInf: v[0] = -kInf; break;
  }
  for (double& x : v) x = round_to(x, t);
  return v;
}

// Every edge case once as a row-wise block (a row segment) and once as a column-wise block (a
// column segment), spread over different tiles of rows [0, rows) (a multiple of 32).
inline void plant_edges(std::vector<double>& x, int64_t rows, int64_t cols, DType t, std::mt19937_64& rng) {
  int k = 0;
  for (Edge e : kEdges) {
    const std::array<double, 32> row_block = edge_block(e, t, rng), col_block = edge_block(e, t, rng);
    const int64_t r = (k * 37 + 5) % rows, b = (k * 3) % (cols / 32);
    for (int i = 0; i < 32; ++i) x[r * cols + b * 32 + i] = row_block[i];
    const int64_t c = (k * 53 + 7) % cols, j = (k + 1) % (rows / 32);
    for (int i = 0; i < 32; ++i) x[(j * 32 + i) * cols + c] = col_block[i];
    ++k;
  }
}

// A grouped input: mixed values on the data rows, zeros on the alignment gap rows (as
// GroupedLinear writes them), NaN on the padding rows past offsets[G] (never to be read).
inline std::vector<double> grouped_values(std::mt19937_64& rng, const GroupLayout& l, int64_t cols, DType t) {
  std::vector<double> x = mixed_values(rng, l.capacity_rows, cols, t);
  const std::vector<bool> data = data_rows(l);
  for (int64_t r = 0; r < l.capacity_rows; ++r) {
    if (data[r]) continue;
    const double fill = r < l.offsets.back() ? 0.0 : kNaN;
    std::fill(x.begin() + r * cols, x.begin() + (r + 1) * cols, fill);
  }
  return x;
}

// The alignment gap rows below offsets[G] of a grouped input, made zeros in `x` (what the device
// must read there: plant_edges may have written into them) and returned as a copy holding NaN there
// instead (the garbage a quantizer given the splits must not read).
inline std::vector<double> nan_gap_rows(std::vector<double>& x, const GroupLayout& l, int64_t cols) {
  const std::vector<bool> data = data_rows(l);
  std::vector<double> garbage = x;
  for (int64_t r = 0; r < l.offsets.back(); ++r)
    if (!data[r]) {
      std::fill(x.begin() + r * cols, x.begin() + (r + 1) * cols, 0.0);
      std::fill(garbage.begin() + r * cols, garbage.begin() + (r + 1) * cols, kNaN);
    }
  return garbage;
}

enum class Layouts { kRow, kCol, kBoth };
inline bool has_row(Layouts l) { return l != Layouts::kCol; }
inline bool has_col(Layouts l) { return l != Layouts::kRow; }

// Device input, offsets and outputs of one activation quantization.
struct QuantizeRun {
  DType dtype;
  int64_t rows, cols;
  DeviceArray<uint16_t> x;
  DeviceArray<int64_t> offsets;
  DeviceMx row, col;
  DeviceArray<int32_t> splits;  // empty: none passed (then the gap rows of x must be zero)

  QuantizeRun(DType t, int64_t rows_, int64_t cols_, const std::vector<double>& values,
              const std::vector<int64_t>& host_offsets)
      : dtype(t), rows(rows_), cols(cols_), x(rows_ * cols_), offsets(host_offsets.size()), row(rows_, cols_),
        col(rows_, cols_) {
    x.upload(bits_of(values, t));
    offsets.upload(host_offsets);
  }
  int groups() const { return static_cast<int>(offsets.size()) - 1; }
  // Passes `host_splits` from now on: gap rows read as zero whatever x holds there.
  void set_splits(const std::vector<int32_t>& host_splits) {
    splits = DeviceArray<int32_t>(host_splits.size());
    splits.upload(host_splits);
  }
  void launch(Layouts which, cudaStream_t stream = nullptr) {
    const Mxfp8Rowwise r = row.rowwise();
    const Mxfp8Colwise c = col.colwise();
    kernels::launch_quantize_mxfp8(dtype, x.get(), rows, cols, offsets.get(), splits.size() > 0 ? splits.get() : nullptr,
                                   groups(), has_row(which) ? &r : nullptr, has_col(which) ? &c : nullptr, stream);
  }
};

inline MxBuffer reference_rowwise(const std::vector<double>& x, int64_t rows, int64_t cols, int64_t used) {
  MxBuffer b = mx_buffer(rows, cols);
  mx_quantize_rowwise(x, rows, cols, used, b);
  return b;
}
inline MxBuffer reference_colwise(const std::vector<double>& x, int64_t rows, int64_t cols, int64_t used) {
  MxBuffer b = mx_buffer(rows, cols);
  mx_quantize_colwise(x, rows, cols, used, b);
  return b;
}

// Runs `which` and checks both device buffers: the requested ones against the reference, the
// other one still entirely poisoned.
inline void expect_quantized(QuantizeRun& run, Layouts which, const std::vector<double>& x, int64_t used,
                             const std::string& where) {
  run.row.poison();
  run.col.poison();
  run.launch(which);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  const MxBuffer untouched = mx_buffer(run.rows, run.cols);
  EXPECT_TRUE(same_mx(where + " row-wise", run.row.download(),
                      has_row(which) ? reference_rowwise(x, run.rows, run.cols, used) : untouched));
  EXPECT_TRUE(same_mx(where + " column-wise", run.col.download(),
                      has_col(which) ? reference_colwise(x, run.rows, run.cols, used) : untouched));
}

}  // namespace moegraph::test
