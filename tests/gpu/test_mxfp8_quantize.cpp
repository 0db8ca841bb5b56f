// The MXFP8 kernels (kernels/quantize/mxfp8.hpp) bit for bit against the host reference
// (testing/mxfp8_reference.hpp): random bf16/fp16 data with several magnitudes in every block
// (block scales from 2^-60 to 2^60, subnormals), edge-case blocks (zero, one huge among tiny,
// subnormals, ±448, just above 448, NaN, ±Inf), row-wise / column-wise / both from one read,
// grouped layouts with empty groups and padding rows whose poisoned bytes must stay, grouped
// weights, dequantization of every code at many scales, and a graph captured once under
// cudaStreamCaptureModeGlobal and replayed with new device splits and data.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kernels/elementwise/elementwise.hpp"
#include "kernels/quantize/mxfp8.hpp"
#include "kernels/routing/moe_routing.hpp"
#include "kernels/routing/offsets.hpp"
#include "testing/device_array.hpp"
#include "testing/graph.hpp"
#include "testing/mxfp8_reference.hpp"
#include "tests/common/expect.hpp"
#include "tests/gpu/mxfp8_quantize_harness.hpp"

namespace moegraph::test {
namespace {

// ---- Quantize: random and edge-case blocks -----------------------------------------------------

struct LayoutCase {
  DType dtype;
  Layouts layouts;
};

class Mxfp8Blocks : public ::testing::TestWithParam<LayoutCase> {};

// One group over all rows; 416 columns leave a partial 96-column tile at the end of each row.
TEST_P(Mxfp8Blocks, RandomAndEdgeBlocksMatchReference) {
  const auto [dtype, layouts] = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_blocks_", dtype_name(dtype), "_", int(layouts))));
  const int64_t rows = 256, cols = 416;
  std::vector<double> x = mixed_values(rng, rows, cols, dtype);
  plant_edges(x, rows, cols, dtype, rng);
  QuantizeRun run(dtype, rows, cols, x, {0, rows});
  expect_quantized(run, layouts, x, rows, "single group");
}

std::string layout_case_name(const ::testing::TestParamInfo<LayoutCase>& info) {
  static const char* const names[] = {"row", "col", "both"};
  return detail::concat(dtype_name(info.param.dtype), "_", names[static_cast<int>(info.param.layouts)]);
}

INSTANTIATE_TEST_SUITE_P(Layouts, Mxfp8Blocks,
                         ::testing::Values(LayoutCase{DType::kBF16, Layouts::kRow}, LayoutCase{DType::kBF16, Layouts::kCol},
                                           LayoutCase{DType::kBF16, Layouts::kBoth}, LayoutCase{DType::kFP16, Layouts::kRow},
                                           LayoutCase{DType::kFP16, Layouts::kCol}, LayoutCase{DType::kFP16, Layouts::kBoth}),
                         layout_case_name);

// ---- Quantize: grouped layouts -----------------------------------------------------------------

class Mxfp8Grouped : public ::testing::TestWithParam<DType> {};

// Groups of 40, 0, 70, 0, 1, 33, 0 rows aligned to 32 in 352 rows: used rows end at 256, so the
// last 96 rows are padding (NaN in x) whose bytes must keep the poison. Both copies from one read
// equal the separate runs and the reference.
TEST_P(Mxfp8Grouped, EmptyGroupsGapsAndPaddingBothEqualSeparateRuns) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_grouped_", dtype_name(dtype))));
  const GroupLayout l = make_layout({40, 0, 70, 0, 1, 33, 0}, 32, 352);
  ASSERT_EQ(l.offsets.back(), 256);
  const int64_t cols = 288;
  const std::vector<double> x = grouped_values(rng, l, cols, dtype);
  QuantizeRun run(dtype, l.capacity_rows, cols, x, l.offsets);
  expect_quantized(run, Layouts::kBoth, x, 256, "grouped, both");
  const MxBuffer both_row = run.row.download(), both_col = run.col.download();
  expect_quantized(run, Layouts::kRow, x, 256, "grouped, row-wise alone");
  EXPECT_TRUE(same_mx("row-wise: both vs alone", both_row, run.row.download()));
  expect_quantized(run, Layouts::kCol, x, 256, "grouped, column-wise alone");
  EXPECT_TRUE(same_mx("column-wise: both vs alone", both_col, run.col.download()));
}

// With the splits given, the alignment-gap rows read as zero whatever x holds there (here NaN):
// the result equals the quantization of the same input with zero gaps.
TEST_P(Mxfp8Grouped, GapRowsReadAsZeroWithSplits) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_gaps_", dtype_name(dtype))));
  const std::vector<int32_t> splits{40, 0, 70, 0, 1, 33, 0};
  const GroupLayout l = make_layout(splits, 32, 352);
  const int64_t cols = 160;
  std::vector<double> x = grouped_values(rng, l, cols, dtype);  // zero gaps: the expectation
  const std::vector<double> garbage = nan_gap_rows(x, l, cols);
  QuantizeRun run(dtype, l.capacity_rows, cols, garbage, l.offsets);
  DeviceArray<int32_t> d_splits(splits.size());
  d_splits.upload(splits);
  run.row.poison();
  run.col.poison();
  const Mxfp8Rowwise r = run.row.rowwise();
  const Mxfp8Colwise c = run.col.colwise();
  kernels::launch_quantize_mxfp8(dtype, run.x.get(), run.rows, cols, run.offsets.get(), d_splits.get(), run.groups(),
                                 &r, &c, nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  const int64_t used = l.offsets.back();
  EXPECT_TRUE(same_mx("row-wise, NaN gaps masked", run.row.download(), reference_rowwise(x, run.rows, cols, used)));
  EXPECT_TRUE(same_mx("column-wise, NaN gaps masked", run.col.download(), reference_colwise(x, run.rows, cols, used)));
}

constexpr uint16_t kValuePoison = 0x5555;  // finite, unlike 0xFFFF (a bf16 NaN)

// bf16 values of a [rows, cols] buffer: the first used * cols equal `want` bit for bit (NaN where it
// is NaN, and some are: the edge blocks), at least a quarter non-zero, the rest still kValuePoison.
void expect_bf16_values(const std::string& where, const std::vector<uint16_t>& got, const std::vector<double>& want,
                        int64_t used, int64_t cols) {
  std::size_t wrong = 0, nan = 0, nonzero = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    bool ok;
    if (static_cast<int64_t>(i) >= used * cols) {
      ok = got[i] == kValuePoison;
    } else if (std::isnan(want[i])) {
      ok = std::isnan(from_bits(got[i], DType::kBF16));
      ++nan;
    } else {
      ok = got[i] == to_bits(want[i], DType::kBF16);
      nonzero += want[i] != 0.0;
    }
    if (!ok && wrong++ == 0) first = i;
  }
  EXPECT_EQ(wrong, 0u) << where << ": first at row " << first / cols << ", column " << first % cols << ": got 0x"
                       << std::hex << got[first];
  EXPECT_GT(nan, 0u) << where << ": the edge blocks should give NaN values";
  EXPECT_GT(nonzero, static_cast<std::size_t>(used * cols / 4)) << where;
}

// The row-wise bf16 values (Mxfp8Rowwise::values, what the staged GEMM route reads) are the host
// rule's values of the row-wise codes, bit for bit (NaN blocks: NaN), with or without the codes
// and the column-wise copy beside them in the same pass; rows past offsets[G] keep the poison. The
// input has edge blocks (NaN, ±Inf, subnormals, ±448) and NaN garbage in the gap rows, read as zero
// with the splits.
TEST_P(Mxfp8Grouped, RowwiseValuesAreTheCodesDequantized) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_rowwise_values_", dtype_name(dtype))));
  const std::vector<int32_t> splits{40, 0, 70, 0, 1, 33, 0};
  const GroupLayout l = make_layout(splits, 32, 352);
  const int64_t cols = 416, used = l.offsets.back();
  std::vector<double> x = grouped_values(rng, l, cols, dtype);
  plant_edges(x, used, cols, dtype, rng);
  const std::vector<double> garbage = nan_gap_rows(x, l, cols);
  QuantizeRun run(dtype, l.capacity_rows, cols, garbage, l.offsets);
  run.set_splits(splits);
  const MxBuffer codes = reference_rowwise(x, run.rows, cols, used);
  const std::vector<double> want = mx_dequantize_rowwise(codes, cols, used, DType::kBF16);
  DeviceArray<uint16_t> values(run.rows * cols);

  auto check = [&](const std::string& where) { expect_bf16_values(where, values.download(), want, used, cols); };
  auto launch = [&](bool with_codes, bool with_colwise) {
    values.upload(std::vector<uint16_t>(run.rows * cols, kValuePoison));
    run.row.poison(), run.col.poison();
    Mxfp8Rowwise r = with_codes ? run.row.rowwise() : Mxfp8Rowwise{};
    r.values = values.get();
    const Mxfp8Colwise c = run.col.colwise();
    kernels::launch_quantize_mxfp8(dtype, run.x.get(), run.rows, cols, run.offsets.get(), run.splits.get(),
                                   run.groups(), &r, with_colwise ? &c : nullptr, nullptr);
    MG_CUDA_CHECK(cudaDeviceSynchronize());
  };

  launch(true, true);
  check("values, codes and column-wise copy");
  EXPECT_TRUE(same_mx("row-wise codes beside the values", run.row.download(), codes));
  EXPECT_TRUE(same_mx("column-wise beside the values", run.col.download(), reference_colwise(x, run.rows, cols, used)));
  launch(false, true);
  check("values and column-wise copy");
  EXPECT_TRUE(same_mx("codes not asked for", run.row.download(), mx_buffer(run.rows, cols)));
  launch(false, false);
  check("values alone");
  EXPECT_TRUE(same_mx("column-wise not asked for", run.col.download(), mx_buffer(run.rows, cols)));

}

// The row-wise scales as floats (Mxfp8Rowwise::scale_floats, what the swap-AB GEMM reads of A) are
// the scale bytes decoded, 2^(byte - 127), bit for bit (2^-127 a subnormal, NaN for a NaN block), in
// the stage-major order (the host reference lays it out on its own), written beside the codes in the
// same pass with or without the column-wise copy; entries of rows past offsets[G], and the slots past
// a row's blocks in its last, partial stage (416 columns: 3 stages and a quarter), keep their poison.
// Asking for them without the codes is refused.
TEST_P(Mxfp8Grouped, RowwiseScaleFloatsAreTheScalesDecoded) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_scale_floats_", dtype_name(dtype))));
  const std::vector<int32_t> splits{40, 0, 70, 0, 1, 33, 0};
  const GroupLayout l = make_layout(splits, 32, 352);
  const int64_t cols = 416, used = l.offsets.back(), blocks = cols / 32;
  std::vector<double> x = grouped_values(rng, l, cols, dtype);
  plant_edges(x, used, cols, dtype, rng);
  // A block of zeros and one tiny value (exact in the input type): a small scale byte.
  x[3 * cols + 64] = std::ldexp(1.0, dtype == DType::kBF16 ? -100 : -20);
  for (int64_t c = 65; c < 96; ++c) x[3 * cols + c] = 0.0;
  const std::vector<double> garbage = nan_gap_rows(x, l, cols);
  QuantizeRun run(dtype, l.capacity_rows, cols, garbage, l.offsets);
  run.set_splits(splits);
  const MxBuffer codes = reference_rowwise(x, run.rows, cols, used);
  const std::vector<float> want = e8m0_floats(codes.scales, run.rows, cols);
  const int64_t slots = (cols + 127) / 128 * run.rows * 4;
  ASSERT_EQ(static_cast<int64_t>(want.size()), slots);
  constexpr uint32_t kPoison = 0x5555aaaau;
  DeviceArray<float> floats(slots);
  for (const bool with_colwise : {true, false}) {
    const std::string where = with_colwise ? "beside the column-wise copy: " : "row-wise alone: ";
    std::vector<float> poison(slots);
    for (float& f : poison) f = std::bit_cast<float>(kPoison);
    floats.upload(poison);
    run.row.poison(), run.col.poison();
    Mxfp8Rowwise r = run.row.rowwise();
    r.scale_floats = floats.get();
    const Mxfp8Colwise c = run.col.colwise();
    kernels::launch_quantize_mxfp8(dtype, run.x.get(), run.rows, cols, run.offsets.get(), run.splits.get(),
                                   run.groups(), &r, with_colwise ? &c : nullptr, nullptr);
    MG_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(same_mx(where + "row-wise codes", run.row.download(), codes));
    const std::vector<float> got = floats.download();
    std::size_t wrong = 0, nan = 0, distinct_bytes = 0;
    std::vector<bool> seen(256, false);
    for (int64_t i = 0; i < slots; ++i) {
      const int64_t stage = i / (run.rows * 4), r = i / 4 % run.rows, j = stage * 4 + i % 4;
      const uint32_t bits = std::bit_cast<uint32_t>(got[i]);
      bool ok;
      if (r >= used || j >= blocks) {
        ok = bits == kPoison;
      } else {
        const uint8_t byte = codes.scales[r * blocks + j];
        distinct_bytes += !seen[byte], seen[byte] = true;
        if (byte == 0xff) ok = std::isnan(got[i]), ++nan;
        else ok = bits == std::bit_cast<uint32_t>(want[i]);
      }
      if (!ok && wrong++ < 4)
        ADD_FAILURE() << where << "block " << j << " of row " << r << ": got 0x" << std::hex << bits;
    }
    EXPECT_EQ(wrong, 0u) << where;
    EXPECT_GT(nan, 0u) << where << "the edge blocks should give NaN scales";
    EXPECT_GT(distinct_bytes, 8u) << where << "the scales should span several bytes";
  }
  Mxfp8Rowwise no_codes;  // the floats alone
  no_codes.scale_floats = floats.get();
  EXPECT_THROW(kernels::launch_quantize_mxfp8(dtype, run.x.get(), run.rows, cols, run.offsets.get(),
                                              run.splits.get(), run.groups(), &no_codes, nullptr, nullptr),
               Error);
}

// The column-wise bf16 values (Mxfp8Colwise::values, what the staged wgrad reads of dy) are the
// host rule's values of the column-wise codes, row-major, bit for bit (NaN blocks: NaN), alone or
// beside the row-wise codes or values from the same read; rows past offsets[G] keep the poison.
// Two layouts: gap rows holding NaN garbage (read as zero with the splits), empty groups, edge
// blocks; and a last group ending at row 117, inside a 32-row block (its rows below only).
// Asking for the column-wise codes and values together, or for values from the SwiGLU quantizer,
// is refused before anything is enqueued.
TEST_P(Mxfp8Grouped, ColwiseValuesAreTheCodesDequantized) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_colwise_values_", dtype_name(dtype))));
  const GroupLayout aligned_end = make_layout({40, 0, 70, 0, 1, 33, 0}, 32, 352);
  const GroupLayout short_end{{50, 53}, {0, 64, 117}, 160};
  for (const GroupLayout& l : {aligned_end, short_end}) {
    const int64_t cols = 416, used = l.offsets.back();
    const std::string where = detail::concat("used rows ", used, ": ");
    std::vector<double> x = grouped_values(rng, l, cols, dtype);
    plant_edges(x, used / 32 * 32, cols, dtype, rng);
    const std::vector<double> garbage = nan_gap_rows(x, l, cols);
    QuantizeRun run(dtype, l.capacity_rows, cols, garbage, l.offsets);
    run.set_splits(l.splits);
    const std::vector<double> want =
        mx_dequantize_colwise(reference_colwise(x, run.rows, cols, used), run.rows, cols, used, DType::kBF16);
    const MxBuffer row_codes = reference_rowwise(x, run.rows, cols, used);
    const std::vector<double> want_row = mx_dequantize_rowwise(row_codes, cols, used, DType::kBF16);
    DeviceArray<uint16_t> col_values(run.rows * cols), row_values(run.rows * cols);
    auto check = [&](const std::string& what, const std::vector<uint16_t>& got, const std::vector<double>& expect) {
      expect_bf16_values(where + what, got, expect, used, cols);
    };
    // rows: 0 none, 1 codes, 2 values.
    auto launch = [&](int rows) {
      col_values.upload(std::vector<uint16_t>(run.rows * cols, kValuePoison));
      row_values.upload(std::vector<uint16_t>(run.rows * cols, kValuePoison));
      run.row.poison(), run.col.poison();
      Mxfp8Rowwise r = rows == 1 ? run.row.rowwise() : Mxfp8Rowwise{};
      if (rows == 2) r.values = row_values.get();
      Mxfp8Colwise c;
      c.values = col_values.get();
      kernels::launch_quantize_mxfp8(dtype, run.x.get(), run.rows, cols, run.offsets.get(), run.splits.get(),
                                     run.groups(), rows > 0 ? &r : nullptr, &c, nullptr);
      MG_CUDA_CHECK(cudaDeviceSynchronize());
    };

    launch(0);
    check("column-wise values alone", col_values.download(), want);
    EXPECT_TRUE(same_mx(where + "column-wise codes not asked for", run.col.download(), mx_buffer(run.rows, cols)));
    launch(1);
    check("column-wise values beside the row-wise codes", col_values.download(), want);
    EXPECT_TRUE(same_mx(where + "row-wise codes beside the column-wise values", run.row.download(), row_codes));
    launch(2);
    check("column-wise values beside the row-wise values", col_values.download(), want);
    check("row-wise values beside the column-wise values", row_values.download(), want_row);

    // The device dequantizer of the codes gives the same bits.
    if (&l == &aligned_end) {
      DeviceArray<uint16_t> from_codes(run.rows * cols);
      from_codes.upload(std::vector<uint16_t>(run.rows * cols, kValuePoison));
      run.launch(Layouts::kCol);
      kernels::launch_dequantize_mxfp8_colwise(run.col.data.get(), run.col.scales.get(), DType::kBF16,
                                               from_codes.get(), run.rows, cols, run.offsets.get(), run.groups(),
                                               nullptr);
      MG_CUDA_CHECK(cudaDeviceSynchronize());
      launch(0);
      EXPECT_EQ(col_values.download(), from_codes.download())
          << where << "the quantizer's values and the dequantizer's";
    }

    Mxfp8Colwise both = run.col.colwise();
    both.values = col_values.get();
    EXPECT_THROW(kernels::launch_quantize_mxfp8(dtype, run.x.get(), run.rows, cols, run.offsets.get(),
                                                run.splits.get(), run.groups(), nullptr, &both, nullptr),
                 Error);
    Mxfp8Colwise values_only;
    values_only.values = col_values.get();
    DeviceArray<uint16_t> gate_up(run.rows * 2 * cols);
    EXPECT_THROW(kernels::launch_quantize_mxfp8_swiglu(dtype, gate_up.get(), nullptr, run.rows, cols, run.offsets.get(),
                                                       run.splits.get(), run.groups(), nullptr, &values_only, nullptr),
                 Error);
  }
}

// launch_quantize_mxfp8_swiglu (FC2's quantizer reading FC1's gate | up) writes the bytes of
// quantizing the SwiGLU kernels' output, unweighted and weighted, in bf16 and fp16: both copies, the
// padding rows' poison kept. gate | up holds random values everywhere (gap rows and padding
// included) and the gap rows' weights are NaN: none may be read.
TEST_P(Mxfp8Grouped, SwigluQuantizerEqualsQuantizingTheSwigluOutput) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_swiglu_quantizer_", dtype_name(dtype))));
  const std::vector<int32_t> splits{40, 0, 70, 0, 1, 33, 0};
  const GroupLayout l = make_layout(splits, 32, 352);
  const int64_t cols = 160, rows = l.capacity_rows;
  DeviceArray<uint16_t> gate_up(rows * 2 * cols), h(rows * cols);
  gate_up.upload(to_device_bits(random_values(rng, rows * 2 * cols, 3.0, dtype), dtype));
  DeviceArray<float> d_weights(rows);
  d_weights.upload(data_row_weights(rng, l));
  DeviceArray<int64_t> offsets(l.offsets.size());
  offsets.upload(l.offsets);
  DeviceArray<int32_t> d_splits(splits.size());
  d_splits.upload(splits);
  const int groups = static_cast<int>(splits.size());
  for (bool weighted : {false, true}) {
    const std::string where = weighted ? "weighted" : "unweighted";
    h.poison();
    if (weighted)
      kernels::launch_swiglu_weighted_forward(dtype, gate_up.get(), d_weights.get(), h.get(), cols, offsets.get(),
                                              groups, nullptr);
    else
      kernels::launch_swiglu_forward(dtype, gate_up.get(), h.get(), cols, offsets.get(), groups, 64, nullptr);
    DeviceMx want_row(rows, cols), want_col(rows, cols), got_row(rows, cols), got_col(rows, cols);
    const Mxfp8Rowwise wr = want_row.rowwise(), gr = got_row.rowwise();
    const Mxfp8Colwise wc = want_col.colwise(), gc = got_col.colwise();
    kernels::launch_quantize_mxfp8(dtype, h.get(), rows, cols, offsets.get(), d_splits.get(), groups, &wr, &wc,
                                   nullptr);
    kernels::launch_quantize_mxfp8_swiglu(dtype, gate_up.get(), weighted ? d_weights.get() : nullptr, rows, cols,
                                          offsets.get(), d_splits.get(), groups, &gr, &gc, nullptr);
    MG_CUDA_CHECK(cudaDeviceSynchronize());
    const MxBuffer want = want_row.download();
    EXPECT_TRUE(same_mx(where + " row-wise", got_row.download(), want));
    EXPECT_TRUE(same_mx(where + " column-wise", got_col.download(), want_col.download()));
    const auto codes = static_cast<std::size_t>(std::count_if(
        want.data.begin(), want.data.begin() + l.offsets.back() * cols, [](uint8_t b) { return b != 0; }));
    EXPECT_GT(codes, static_cast<std::size_t>(l.offsets.back() * cols / 2)) << where << ": non-zero codes";
  }
}

// The quantizer that computes the SwiGLU's backward as it reads (FC1's output gradient) equals
// quantizing the SwiGLU backward kernel's output bit for bit, in bf16 and fp16, with each output
// set: codes both ways, bf16 values both ways, row-wise codes alone, column-wise values alone; rows
// past the used ones keep their poison. Gap rows of gate | up and da hold NaN, which a read would
// carry into a block. Three layouts: 32-aligned groups (cols 512: two 128-column tiles in each
// half), used rows ending inside a 32-row block (cols 256), and 16000 rows of 1024 columns, so that
// every block of the persistent grid walks several pairs of tiles (its prefetch and both shared
// buffers in use).
TEST_P(Mxfp8Grouped, SwigluGradQuantizerEqualsQuantizingTheSwigluBackward) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_swiglu_grad_quantizer_", dtype_name(dtype))));
  const GroupLayout aligned_end = make_layout({40, 0, 70, 0, 1, 33, 0}, 32, 352);
  const GroupLayout short_end{{50, 53}, {0, 64, 117}, 160};
  const GroupLayout many_tiles = make_layout({9000, 0, 7000}, 32, 16384);
  for (const GroupLayout& l : {aligned_end, short_end, many_tiles}) {
    const int64_t cols = &l == &aligned_end ? 512 : &l == &short_end ? 256 : 1024;
    const int64_t ffn = cols / 2, rows = l.capacity_rows;
    const int64_t used = l.offsets.back();
    const std::string where = detail::concat("used rows ", used, ", cols ", cols, ": ");
    std::vector<double> gate_up = random_values(rng, rows * cols, 3.0, dtype);
    std::vector<double> da = random_values(rng, rows * ffn, 1.0, dtype);
    const std::vector<bool> data = data_rows(l);
    for (int64_t r = 0; r < rows; ++r)
      if (r >= used || !data[r]) {
        std::fill(gate_up.begin() + r * cols, gate_up.begin() + (r + 1) * cols, kNaN);
        std::fill(da.begin() + r * ffn, da.begin() + (r + 1) * ffn, kNaN);
      }
    DeviceArray<uint16_t> d_gate_up(rows * cols), d_da(rows * ffn), dh(rows * cols);
    d_gate_up.upload(to_device_bits(gate_up, dtype));
    d_da.upload(to_device_bits(da, dtype));
    DeviceArray<int64_t> offsets(l.offsets.size());
    offsets.upload(l.offsets);
    DeviceArray<int32_t> splits(l.splits.size());
    splits.upload(l.splits);
    const int groups = static_cast<int>(l.splits.size());
    dh.poison();
    kernels::launch_swiglu_backward(dtype, d_gate_up.get(), d_da.get(), dh.get(), ffn, offsets.get(), groups, 64,
                                    nullptr);

    // sets: 0 codes both ways, 1 values both ways, 2 row-wise codes alone, 3 column-wise values alone.
    for (int set = 0; set < 4; ++set) {
      DeviceMx want_row(rows, cols), want_col(rows, cols), got_row(rows, cols), got_col(rows, cols);
      DeviceArray<uint16_t> want_rv(rows * cols), want_cv(rows * cols), got_rv(rows * cols), got_cv(rows * cols);
      for (auto* values : {&want_rv, &want_cv, &got_rv, &got_cv})
        values->upload(std::vector<uint16_t>(rows * cols, kValuePoison));
      const bool row = set != 3, col = set != 2, as_values = set == 1 || set == 3;
      const auto outputs = [&](DeviceMx& r, DeviceMx& c, DeviceArray<uint16_t>& rv, DeviceArray<uint16_t>& cv) {
        Mxfp8Rowwise rw = as_values ? Mxfp8Rowwise{nullptr, nullptr, rv.get()} : r.rowwise();
        Mxfp8Colwise cw = as_values ? Mxfp8Colwise{nullptr, nullptr, cv.get()} : c.colwise();
        return std::make_pair(rw, cw);
      };
      const auto [wr, wc] = outputs(want_row, want_col, want_rv, want_cv);
      const auto [gr, gc] = outputs(got_row, got_col, got_rv, got_cv);
      kernels::launch_quantize_mxfp8(dtype, dh.get(), rows, cols, offsets.get(), splits.get(), groups,
                                     row ? &wr : nullptr, col ? &wc : nullptr, nullptr);
      kernels::launch_quantize_mxfp8_swiglu_grad(dtype, d_gate_up.get(), d_da.get(), rows, cols, offsets.get(),
                                                 splits.get(), groups, row ? &gr : nullptr, col ? &gc : nullptr,
                                                 nullptr);
      MG_CUDA_CHECK(cudaDeviceSynchronize());
      const std::string what = where + detail::concat("set ", set);
      EXPECT_TRUE(same_mx(what + " row-wise codes", got_row.download(), want_row.download()));
      EXPECT_TRUE(same_mx(what + " column-wise codes", got_col.download(), want_col.download()));
      EXPECT_TRUE(got_rv.download() == want_rv.download()) << what << ": row-wise values differ";
      EXPECT_TRUE(got_cv.download() == want_cv.download()) << what << ": column-wise values differ";
      if (set == 0) {  // the check can fail: the codes are mostly non-zero
        const MxBuffer codes = want_row.download();
        const auto nonzero = std::count_if(codes.data.begin(), codes.data.begin() + used * cols,
                                           [](uint8_t b) { return b != 0; });
        EXPECT_GT(nonzero, used * cols / 2) << what;
      }
      if (set == 1) {
        const std::vector<uint16_t> v = want_cv.download();
        EXPECT_GT(std::count_if(v.begin(), v.begin() + used * cols, [](uint16_t b) { return b != kValuePoison && b != 0; }),
                  used * cols / 2)
            << what << ": column-wise values written";
      }
    }
  }
  // Refusals: a half row that is not a whole number of tiles, no splits.
  DeviceArray<uint16_t> x(64 * 384), da(64 * 192);
  DeviceArray<int64_t> offsets(2);
  DeviceArray<int32_t> splits(1);
  DeviceMx out(64, 384);
  const Mxfp8Rowwise rw = out.rowwise();
  EXPECT_THROW(kernels::launch_quantize_mxfp8_swiglu_grad(dtype, x.get(), da.get(), 64, 384, offsets.get(),
                                                          splits.get(), 1, &rw, nullptr, nullptr),
               Error);
  EXPECT_THROW(kernels::launch_quantize_mxfp8_swiglu_grad(dtype, x.get(), da.get(), 64, 256, offsets.get(), nullptr,
                                                          1, &rw, nullptr, nullptr),
               Error);
}

// Row-wise needs no alignment: groups of 5, 0, 37, 11, 0 rows (row_align 1) end at row 53 of 100,
// in the middle of a 32-row tile. Column-wise with one group of 53 rows: the last block of each
// column is short (rows 32..52) and rows 53..63 of it keep the poison.
TEST_P(Mxfp8Grouped, UnalignedUsedRowsEndInsideATile) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_unaligned_", dtype_name(dtype))));
  const GroupLayout l = make_layout({5, 0, 37, 11, 0}, 1, 100);
  ASSERT_EQ(l.offsets.back(), 53);
  const int64_t cols = 160;
  const std::vector<double> x = grouped_values(rng, l, cols, dtype);
  QuantizeRun run(dtype, l.capacity_rows, cols, x, l.offsets);
  expect_quantized(run, Layouts::kRow, x, 53, "row_align 1, row-wise");

  std::vector<double> y = mixed_values(rng, 96, cols, dtype);
  std::fill(y.begin() + 53 * cols, y.end(), kNaN);  // padding
  QuantizeRun single(dtype, 96, cols, y, {0, 53});
  expect_quantized(single, Layouts::kBoth, y, 53, "one group of 53 rows, both");
  expect_quantized(single, Layouts::kCol, y, 53, "one group of 53 rows, column-wise");
}

// No used rows at all (every group empty): nothing is written.
TEST_P(Mxfp8Grouped, NoUsedRowsWritesNothing) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_empty_", dtype_name(dtype))));
  const std::vector<double> x = mixed_values(rng, 64, 64, dtype);
  QuantizeRun run(dtype, 64, 64, x, {0, 0, 0});
  expect_quantized(run, Layouts::kBoth, x, 0, "all groups empty");
}

// More tiles than the persistent grid holds, so every block walks several tiles (the prefetch
// and both shared buffers are used), with a partial column tile at the end of each row.
TEST_P(Mxfp8Grouped, ManyTilesPerBlock) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_many_tiles_", dtype_name(dtype))));
  const int64_t rows = 8192, cols = 1120;  // 256 x 9 tiles of 32 x 128
  std::vector<double> x = mixed_values(rng, rows, cols, dtype);
  plant_edges(x, rows, cols, dtype, rng);
  QuantizeRun run(dtype, rows, cols, x, {0, 4000, rows - 32});
  expect_quantized(run, Layouts::kBoth, x, rows - 32, "8160 rows, both");
}

// Gathered rows (launch_quantize_mxfp8_gathered): row r of the grouped input is token map[r] of a
// smaller source, tokens repeating as top-k routing repeats them. Both copies, and each alone,
// equal the reference's quantization of the gathered buffer bit for bit; bytes past the used rows
// keep the poison. The map entries of gap and padding rows name a NaN row that no data row uses:
// reading one would put NaN where the reference has zeros. The second layout has more tiles than
// the grid holds: blocks walk several tiles, across rows of tiles (the remembered source row).
TEST_P(Mxfp8Grouped, GatheredRowsEqualTheGatheredBuffer) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_gathered_", dtype_name(dtype))));
  struct Shape {
    std::vector<int32_t> splits;
    int64_t capacity, cols, tokens;
  };
  const Shape shapes[] = {{{40, 0, 70, 0, 1, 33, 0}, 352, 288, 37},
                          {{1500, 0, 2100, 33, 900, 2, 1600}, 6400, 1120, 1024}};
  for (const Shape& sh : shapes) {
    const GroupLayout l = make_layout(sh.splits, 32, sh.capacity);
    const int64_t cols = sh.cols, used = l.offsets.back();
    std::vector<double> tokens = mixed_values(rng, sh.tokens + 1, cols, dtype);
    plant_edges(tokens, sh.tokens, cols, dtype, rng);
    std::fill(tokens.begin() + sh.tokens * cols, tokens.end(), kNaN);  // row `tokens`: never to be read
    std::vector<int32_t> map(sh.capacity, static_cast<int32_t>(sh.tokens));
    std::vector<double> gathered(sh.capacity * cols, 0.0);
    const std::vector<bool> data = data_rows(l);
    std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(sh.tokens) - 1);
    for (int64_t r = 0; r < sh.capacity; ++r) {
      if (!data[r]) continue;
      map[r] = token(rng);
      std::copy_n(tokens.begin() + map[r] * cols, cols, gathered.begin() + r * cols);
    }
    DeviceArray<uint16_t> d_tokens(tokens.size());
    d_tokens.upload(bits_of(tokens, dtype));
    DeviceArray<int32_t> d_map(map.size()), d_splits(sh.splits.size());
    d_map.upload(map);
    d_splits.upload(sh.splits);
    DeviceArray<int64_t> offsets(l.offsets.size());
    offsets.upload(l.offsets);
    DeviceMx row(sh.capacity, cols), col(sh.capacity, cols);
    const MxBuffer want_row = reference_rowwise(gathered, sh.capacity, cols, used);
    const MxBuffer want_col = reference_colwise(gathered, sh.capacity, cols, used);
    const MxBuffer untouched = mx_buffer(sh.capacity, cols);
    const int groups = static_cast<int>(sh.splits.size());
    for (Layouts which : {Layouts::kBoth, Layouts::kRow, Layouts::kCol}) {
      const std::string where = detail::concat(sh.capacity, " x ", cols, ", layouts ", int(which));
      row.poison(), col.poison();
      const Mxfp8Rowwise r = row.rowwise();
      const Mxfp8Colwise c = col.colwise();
      kernels::launch_quantize_mxfp8_gathered(dtype, d_tokens.get(), {d_map.get(), sh.tokens + 1}, sh.capacity, cols,
                                              offsets.get(), d_splits.get(), groups, has_row(which) ? &r : nullptr,
                                              has_col(which) ? &c : nullptr, nullptr);
      MG_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(same_mx(where + " row-wise", row.download(), has_row(which) ? want_row : untouched));
      EXPECT_TRUE(same_mx(where + " column-wise", col.download(), has_col(which) ? want_col : untouched));
    }
    // Without the splits a gap row's entry would be read: refused before anything is enqueued.
    const Mxfp8Rowwise r = row.rowwise();
    EXPECT_THROW(kernels::launch_quantize_mxfp8_gathered(dtype, d_tokens.get(), {d_map.get(), sh.tokens + 1},
                                                         sh.capacity, cols, offsets.get(), nullptr, groups, &r, nullptr,
                                                         nullptr),
                 Error);
    // Nor without the rows of x.
    EXPECT_THROW(kernels::launch_quantize_mxfp8_gathered(dtype, d_tokens.get(), {d_map.get(), 0}, sh.capacity, cols,
                                                         offsets.get(), d_splits.get(), groups, &r, nullptr, nullptr),
                 Error);
  }
}

// A data row whose map entry names no row of x (at or past the bound) reads as zeros, never past
// x, and is reported: the first such row, its entry and the bound. The rest of the rows are
// quantized as the reference quantizes the gathered buffer with that row zero. Gap rows' entries
// (past the bound too) are never read, so they raise nothing.
TEST_P(Mxfp8Grouped, GatheredRowPastTheSourceIsZeroAndReported) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_gathered_past_", dtype_name(dtype))));
  const std::vector<int32_t> splits{40, 0, 70, 0, 1, 33, 0};
  const int64_t capacity = 352, cols = 288, tokens = 37;
  const GroupLayout l = make_layout(splits, 32, capacity);
  const int64_t used = l.offsets.back();
  const std::vector<double> x = mixed_values(rng, tokens, cols, dtype);
  std::vector<int32_t> map(capacity, static_cast<int32_t>(tokens + 1000));  // gap rows: past x, never read
  std::vector<double> gathered(capacity * cols, 0.0);
  const std::vector<bool> data = data_rows(l);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(tokens) - 1);
  for (int64_t r = 0; r < capacity; ++r) {
    if (!data[r]) continue;
    map[r] = token(rng);
    std::copy_n(x.begin() + map[r] * cols, cols, gathered.begin() + r * cols);
  }
  const int64_t bad_row = l.offsets[2] + 5, bad_entry = tokens;  // one past x
  ASSERT_TRUE(data[bad_row]);
  map[bad_row] = static_cast<int32_t>(bad_entry);
  std::fill_n(gathered.begin() + bad_row * cols, cols, 0.0);
  DeviceArray<uint16_t> d_x(x.size());
  d_x.upload(bits_of(x, dtype));
  DeviceArray<int32_t> d_map(map.size()), d_splits(splits.size());
  d_map.upload(map);
  d_splits.upload(splits);
  DeviceArray<int64_t> offsets(l.offsets.size());
  offsets.upload(l.offsets);
  DeviceArray<DeviceErrorRecord> error(1);
  testing::memset_and_wait(error.get(), 0, sizeof(DeviceErrorRecord));
  DeviceMx row(capacity, cols), col(capacity, cols);
  row.poison(), col.poison();
  const Mxfp8Rowwise r = row.rowwise();
  const Mxfp8Colwise c = col.colwise();
  kernels::launch_quantize_mxfp8_gathered(dtype, d_x.get(), {d_map.get(), tokens, error.get()}, capacity, cols,
                                          offsets.get(), d_splits.get(), static_cast<int>(splits.size()), &r, &c,
                                          nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(same_mx("row-wise", row.download(), reference_rowwise(gathered, capacity, cols, used)));
  EXPECT_TRUE(same_mx("column-wise", col.download(), reference_colwise(gathered, capacity, cols, used)));
  const DeviceErrorRecord e = error.download()[0];
  EXPECT_EQ(e.code, kDeviceErrorSourceRow);
  EXPECT_EQ(e.group, bad_row);
  EXPECT_EQ(e.value, bad_entry);
  EXPECT_EQ(e.limit, tokens);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Mxfp8Grouped, ::testing::Values(DType::kBF16, DType::kFP16),
                         [](const ::testing::TestParamInfo<DType>& info) { return std::string(dtype_name(info.param)); });

// ---- Quantize: grouped weights -----------------------------------------------------------------

struct WeightCase {
  DType dtype;
  int groups;
  int64_t n, k;
  Layouts layouts;
};

class Mxfp8WeightQuantizer : public ::testing::TestWithParam<WeightCase> {};

TEST_P(Mxfp8WeightQuantizer, MatchReference) {
  const WeightCase wc = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_weights_", dtype_name(wc.dtype), "_", wc.groups, "x", wc.n, "x", wc.k)));
  std::vector<double> w = mixed_values(rng, wc.groups * wc.n, wc.k, wc.dtype);
  if (wc.k % 32 == 0) plant_edges(w, wc.groups * wc.n, wc.k, wc.dtype, rng);
  DeviceArray<uint16_t> d_w(w.size());
  d_w.upload(bits_of(w, wc.dtype));
  DeviceMx row(wc.groups * wc.n, wc.k), col(wc.groups * wc.n, wc.k);
  const Mxfp8Rowwise r = row.rowwise();
  const Mxfp8Colwise c = col.colwise();
  kernels::launch_quantize_mxfp8_weights(wc.dtype, d_w.get(), wc.groups, wc.n, wc.k, has_row(wc.layouts) ? &r : nullptr,
                                         has_col(wc.layouts) ? &c : nullptr, nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  MxBuffer want_row = mx_buffer(wc.groups * wc.n, wc.k), want_col = mx_buffer(wc.groups * wc.n, wc.k);
  mx_quantize_weights(w, wc.groups, wc.n, wc.k, has_row(wc.layouts) ? &want_row : nullptr,
                      has_col(wc.layouts) ? &want_col : nullptr);
  EXPECT_TRUE(same_mx("weights row-wise [G, N, K]", row.download(), want_row));
  EXPECT_TRUE(same_mx("weights column-wise [G, K, N]", col.download(), want_col));
}

std::string weight_case_name(const ::testing::TestParamInfo<WeightCase>& info) {
  static const char* const names[] = {"row", "col", "both"};
  const WeightCase& c = info.param;
  return detail::concat(dtype_name(c.dtype), "_g", c.groups, "_n", c.n, "_k", c.k, "_", names[static_cast<int>(c.layouts)]);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Mxfp8WeightQuantizer,
    ::testing::Values(WeightCase{DType::kBF16, 3, 96, 160, Layouts::kBoth}, WeightCase{DType::kFP16, 3, 96, 160, Layouts::kBoth},
                      WeightCase{DType::kBF16, 5, 64, 256, Layouts::kRow}, WeightCase{DType::kBF16, 2, 64, 48, Layouts::kCol},
                      WeightCase{DType::kFP16, 1, 32, 32, Layouts::kBoth}),
    weight_case_name);

// ---- Dequantize -----------------------------------------------------------------------------------

// Equal, or both NaN (the NaN payload is not part of the rules).
bool same_value(double got, double want) {
  if (std::isnan(want) || std::isnan(got)) return std::isnan(want) && std::isnan(got);
  return got == want && std::signbit(got) == std::signbit(want);
}

double device_value(const std::vector<uint8_t>& bytes, std::size_t i, DType t) {
  if (t == DType::kFP32) {
    float f;
    std::memcpy(&f, bytes.data() + 4 * i, 4);
    return f;
  }
  uint16_t b;
  std::memcpy(&b, bytes.data() + 2 * i, 2);
  return from_bits(b, t);
}

// Every one of the 256 codes under scales spread over the whole E8M0 range (0, 1, 254, NaN and
// random ones) into bf16, fp16 and fp32; used rows end at 77 of 96, and the rest of y keeps the poison.
TEST(Mxfp8Dequantize, EveryCodeAtManyScalesMatchesReference) {
  std::mt19937_64 rng(test_seed("mxfp8_dequantize"));
  const int64_t rows = 96, cols = 160, used = 77;
  MxBuffer q = mx_buffer(rows, cols);
  for (std::size_t i = 0; i < q.data.size(); ++i) q.data[i] = static_cast<uint8_t>(i % 256 ^ (i / 256 * 37 % 256));
  static constexpr uint8_t kScales[] = {0, 1, 2, 60, 100, 119, 126, 127, 128, 135, 140, 200, 240, 253, 254, 255};
  std::uniform_int_distribution<int> pick(0, 2 * static_cast<int>(std::size(kScales)) - 1);
  for (uint8_t& s : q.scales) {
    const int p = pick(rng);
    s = p < static_cast<int>(std::size(kScales)) ? kScales[p] : static_cast<uint8_t>(rng());
  }
  DeviceArray<uint8_t> data(q.data.size()), scales(q.scales.size());
  data.upload(q.data);
  scales.upload(q.scales);
  DeviceArray<int64_t> offsets(3);
  offsets.upload({0, 40, used});
  for (DType out : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    const std::size_t size = dtype_size(out);
    DeviceArray<uint8_t> y(rows * cols * size);
    y.poison();
    kernels::launch_dequantize_mxfp8_rowwise(data.get(), scales.get(), out, y.get(), rows, cols, offsets.get(), 2,
                                             nullptr);
    MG_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint8_t> got = y.download();
    const std::vector<double> want = mx_dequantize_rowwise(q, cols, used, out);
    std::size_t bad = 0;
    for (int64_t i = 0; i < used * cols; ++i) {
      if (same_value(device_value(got, i, out), want[i])) continue;
      if (bad++ < 5)
        ADD_FAILURE() << dtype_name(out) << " element " << i << " (code 0x" << std::hex << int{q.data[i]} << ", scale 0x"
                      << int{q.scales[i / 32]} << std::dec << "): got " << device_value(got, i, out) << ", want " << want[i];
    }
    EXPECT_EQ(bad, 0u) << dtype_name(out);
    const bool untouched =
        std::all_of(got.begin() + used * cols * size, got.end(), [](uint8_t b) { return b == 0xff; });
    EXPECT_TRUE(untouched) << dtype_name(out) << ": rows past offsets[G] were written";
  }
}

// The column-wise copy back to row-major (the staged MXFP8 wgrad's operands): every code under
// scales over the whole E8M0 range, cols not a multiple of the 64-column tile, used rows ending at
// 77 of 96 (the rest of y keeps the poison). The want side is the row-wise reference, applied to
// each element as a block of its own.
TEST(Mxfp8Dequantize, ColumnWiseCopyBackToRowMajorMatchesReference) {
  std::mt19937_64 rng(test_seed("mxfp8_dequantize_colwise"));
  const int64_t rows = 96, cols = 144, used = 77;
  std::vector<uint8_t> data(cols * rows), scales(rows / 32 * cols);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i % 256 ^ (i / 256 * 91 % 256));
  static constexpr uint8_t kScales[] = {0, 1, 2, 60, 119, 126, 127, 128, 135, 200, 247, 253, 254, 255};
  for (uint8_t& s : scales) s = rng() % 2 ? kScales[rng() % std::size(kScales)] : static_cast<uint8_t>(rng());
  // Element (r, c) as block r * cols + c of a row-wise buffer whose first element is its code.
  MxBuffer single = mx_buffer(used * cols, 32, 0);
  for (int64_t r = 0; r < used; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      single.data[(r * cols + c) * 32] = data[mx_colwise_index(r, c, rows, cols)];
      single.scales[r * cols + c] = scales[r / 32 * cols + c];
    }
  DeviceArray<uint8_t> ddata(data.size()), dscales(scales.size());
  ddata.upload(data), dscales.upload(scales);
  DeviceArray<int64_t> offsets(3);
  offsets.upload({0, 64, used});
  for (DType out : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    const std::size_t size = dtype_size(out);
    DeviceArray<uint8_t> y(rows * cols * size);
    y.poison();
    kernels::launch_dequantize_mxfp8_colwise(ddata.get(), dscales.get(), out, y.get(), rows, cols, offsets.get(), 2,
                                             nullptr);
    MG_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint8_t> got = y.download();
    const std::vector<double> want = mx_dequantize_rowwise(single, 32, used * cols, out);
    std::size_t bad = 0;
    for (int64_t i = 0; i < used * cols; ++i) {
      if (same_value(device_value(got, i, out), want[32 * i])) continue;
      if (bad++ < 5)
        ADD_FAILURE() << dtype_name(out) << " row " << i / cols << " col " << i % cols << ": got "
                      << device_value(got, i, out) << ", want " << want[32 * i];
    }
    EXPECT_EQ(bad, 0u) << dtype_name(out);
    const bool untouched =
        std::all_of(got.begin() + used * cols * size, got.end(), [](uint8_t b) { return b == 0xff; });
    EXPECT_TRUE(untouched) << dtype_name(out) << ": rows past offsets[G] were written";
  }
}

// The column-wise values' kernel where each block walks several tiles (the double-buffered shared
// tile that the column role overwrites with values in place, then the next tiles): 2080 tiles of 32 x
// 128 against at most 4 blocks per SM. Values alone and beside the row-wise values equal the device
// dequantizer's reading of the codes (itself checked against the host rule above) bit for bit, gap
// rows hold NaN garbage (read as zero with the splits), and the rows past offsets[G] keep the poison.
TEST(Mxfp8ColwiseValues, ManyTilesPerBlockEqualTheDequantizedCodes) {
  std::mt19937_64 rng(test_seed("mxfp8_colwise_values_many_tiles"));
  const std::vector<int32_t> splits{700, 0, 1500, 3, 1900};
  const GroupLayout l = make_layout(splits, 32, 4224);
  const int64_t cols = 2048, used = l.offsets.back();
  int device = 0, sms = 0;
  MG_CUDA_CHECK(cudaGetDevice(&device));
  MG_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  ASSERT_GT((used + 31) / 32 * (cols / 128), 2 * 4 * sms) << "fewer than two tiles per block";
  std::vector<double> x = grouped_values(rng, l, cols, DType::kBF16);
  const std::vector<bool> data = data_rows(l);
  for (int64_t r = 0; r < used; ++r)
    if (!data[r]) std::fill(x.begin() + r * cols, x.begin() + (r + 1) * cols, kNaN);
  QuantizeRun run(DType::kBF16, l.capacity_rows, cols, x, l.offsets);
  run.set_splits(l.splits);
  const int64_t elements = run.rows * cols;
  DeviceArray<uint16_t> want(elements), got(elements), row_values(elements);
  want.upload(std::vector<uint16_t>(elements, kValuePoison));
  run.launch(Layouts::kCol);
  kernels::launch_dequantize_mxfp8_colwise(run.col.data.get(), run.col.scales.get(), DType::kBF16, want.get(),
                                           run.rows, cols, run.offsets.get(), run.groups(), nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> expected = want.download();
  std::size_t nonzero = 0;
  for (int64_t i = 0; i < used * cols; ++i) nonzero += (expected[i] & 0x7fffu) != 0;
  EXPECT_GT(nonzero, static_cast<std::size_t>(used * cols / 2)) << "the codes' values should be mostly non-zero";
  for (bool with_rows : {false, true}) {
    got.upload(std::vector<uint16_t>(elements, kValuePoison));
    Mxfp8Rowwise r;
    r.values = row_values.get();
    Mxfp8Colwise c;
    c.values = got.get();
    kernels::launch_quantize_mxfp8(DType::kBF16, run.x.get(), run.rows, cols, run.offsets.get(), run.splits.get(),
                                   run.groups(), with_rows ? &r : nullptr, &c, nullptr);
    MG_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(got.download(), expected) << (with_rows ? "beside the row-wise values" : "alone");
  }
}

// ---- Graph capture -------------------------------------------------------------------------------

// offsets (row_align 32) -> quantize both copies -> dequantize the row-wise one, captured once under
// cudaStreamCaptureModeGlobal and replayed with new device splits and new data each time.
TEST(Mxfp8Graph, CaptureOnceReplayWithNewSplitsAndData) {
  std::mt19937_64 rng(test_seed("mxfp8_graph"));
  const DType dtype = DType::kBF16;
  const int groups = 8;
  const int64_t capacity = 1024, cols = 384;
  DeviceArray<uint16_t> x(capacity * cols);
  DeviceArray<int32_t> splits(groups);
  DeviceArray<int64_t> offsets(groups + 1);
  DeviceArray<DeviceErrorRecord> error(1);
  DeviceMx row(capacity, cols), col(capacity, cols);
  DeviceArray<uint16_t> y(capacity * cols);
  Stream stream;

  const auto enqueue = [&] {
    kernels::launch_group_offsets(splits.get(), groups, 32, capacity, offsets.get(), error.get(), stream.get());
    const Mxfp8Rowwise r = row.rowwise();
    const Mxfp8Colwise c = col.colwise();
    kernels::launch_quantize_mxfp8(dtype, x.get(), capacity, cols, offsets.get(), nullptr, groups, &r, &c, stream.get());
    kernels::launch_dequantize_mxfp8_rowwise(row.data.get(), row.scales.get(), DType::kBF16, y.get(), capacity, cols,
                                             offsets.get(), groups, stream.get());
  };
  const auto new_inputs = [&](int64_t rows) {
    const GroupLayout l = make_layout(random_splits(rng, groups, rows, Routing::kSkewed), 32, capacity);
    splits.upload(l.splits);
    const std::vector<double> values = grouped_values(rng, l, cols, dtype);
    x.upload(bits_of(values, dtype));
    testing::memset_and_wait(error.get(), 0, sizeof(DeviceErrorRecord));
    row.poison();
    col.poison();
    y.poison();
    return std::make_pair(l, values);
  };

  new_inputs(500);
  enqueue();  // warm-up outside capture (lazy loading, the launchers' occupancy queries)
  MG_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  Graph graph(stream.get(), enqueue);

  // Up to capacity - groups * 31 rows: the aligned spans always fit (776 may fill it exactly).
  const int64_t rows_per_replay[] = {700, 0, 1, 776, 333, 64};
  int replay = 0;
  for (int64_t rows : rows_per_replay) {
    const auto [l, values] = new_inputs(rows);
    graph.launch(stream.get());
    MG_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    const std::string where = detail::concat("replay ", replay++, " (", rows, " rows, used ", l.offsets.back(), ")");
    EXPECT_EQ(error.download()[0].code, 0) << where;
    const int64_t used = l.offsets.back();
    const MxBuffer want_row = reference_rowwise(values, capacity, cols, used);
    EXPECT_TRUE(same_mx(where + " row-wise", row.download(), want_row));
    EXPECT_TRUE(same_mx(where + " column-wise", col.download(), reference_colwise(values, capacity, cols, used)));
    const std::vector<double> want_y = mx_dequantize_rowwise(want_row, cols, used, DType::kBF16);
    const std::vector<uint16_t> got_y = y.download();
    std::size_t bad = 0;
    for (int64_t i = 0; i < capacity * cols; ++i) {
      const bool ok = i < used * cols ? same_value(from_bits(got_y[i], DType::kBF16), want_y[i]) : got_y[i] == 0xffff;
      bad += ok ? 0 : 1;
    }
    EXPECT_EQ(bad, 0u) << where << ": dequantized values differ from the reference (or padding rows were written)";
    if (HasFailure()) break;
  }
}

}  // namespace
}  // namespace moegraph::test
