// The MXFP8 quantizer bit for bit against the host reference on the shapes that exercise its walks
// (the activations' contiguous share of tiles per block, the weights' bands of row tiles): rows of
// 56 column tiles (7168 columns) over more tiles than the persistent grid holds, so a block's share
// crosses from one row tile to the next (and a band's end), and the last band is short; ragged groups
// with row_align 32 whose gap rows hold NaN that the splits must mask; row_align 1 and row_align 8
// groups that start inside a tile (row-wise: each row's own group); used rows that end inside a
// tile and a partial column tile; scales pointers that are not 4-byte aligned; grouped weights.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "kernels/quantize/mxfp8.hpp"
#include "testing/device_array.hpp"
#include "testing/mxfp8_reference.hpp"
#include "tests/common/expect.hpp"
#include "tests/gpu/mxfp8_quantize_harness.hpp"

namespace moegraph::test {
namespace {

// The references of both layouts, computed once and compared against every run.
struct Expected {
  MxBuffer row, col;
};
Expected expected_of(const std::vector<double>& x, int64_t rows, int64_t cols, int64_t used, bool col = true) {
  return {reference_rowwise(x, rows, cols, used), col ? reference_colwise(x, rows, cols, used) : mx_buffer(rows, cols)};
}

// Runs `which`: the requested copies equal `want`, the other keeps its poison.
void expect_quantized(QuantizeRun& run, Layouts which, const Expected& want, const std::string& where) {
  const MxBuffer untouched = mx_buffer(run.rows, run.cols);
  run.row.poison();
  run.col.poison();
  run.launch(which);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(same_mx(where + " row-wise", run.row.download(), has_row(which) ? want.row : untouched));
  EXPECT_TRUE(same_mx(where + " column-wise", run.col.download(), has_col(which) ? want.col : untouched));
}

// x with NaN on the alignment-gap rows below offsets[G], which the splits must mask.
std::vector<double> nan_gaps(std::vector<double> x, const GroupLayout& l, int64_t cols) {
  const std::vector<bool> data = data_rows(l);
  for (int64_t r = 0; r < l.offsets.back(); ++r)
    if (!data[r]) std::fill(x.begin() + r * cols, x.begin() + (r + 1) * cols, kNaN);
  return x;
}

class Mxfp8QuantizeShapes : public ::testing::TestWithParam<DType> {};

// 7168 columns (56 column tiles) and ragged groups aligned to 32 with NaN in their gaps: 2080 used
// rows, 65 row tiles; 3640 tiles, more than four per block of the persistent grid (792 blocks on an
// H100), so a block's contiguous share of them crosses row tiles (and group gaps, whose rows the
// walk's remembered answer must not carry over). Both copies from one read and each alone.
TEST_P(Mxfp8QuantizeShapes, WideRowsRaggedGroupsWithSplits) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_shapes_wide_", dtype_name(dtype))));
  const std::vector<int32_t> splits{300, 0, 1, 31, 32, 33, 517, 0, 64, 250, 7, 700};
  const GroupLayout l = make_layout(splits, 32, 2112);
  const int64_t cols = 7168, used = l.offsets.back();
  ASSERT_GT(l.capacity_rows - used, 31) << "a padding tile past the used rows";
  const std::vector<double> x = grouped_values(rng, l, cols, dtype);  // zero gaps: the expectation
  QuantizeRun run(dtype, l.capacity_rows, cols, nan_gaps(x, l, cols), l.offsets);
  run.set_splits(splits);
  const Expected want = expected_of(x, l.capacity_rows, cols, used);
  expect_quantized(run, Layouts::kBoth, want, "7168 columns, ragged groups, both");
  expect_quantized(run, Layouts::kRow, want, "7168 columns, ragged groups, row-wise");
  expect_quantized(run, Layouts::kCol, want, "7168 columns, ragged groups, column-wise");
}

// Row-wise copies need no alignment, so a tile may hold rows of several groups: each row's own
// group decides whether it is a gap. row_align 1 (no gaps; a look-up by the tile's first row would
// mask most rows of the later groups) and row_align 8 (gaps inside tiles, NaN on input), used rows
// ending inside a tile, with whole column tiles (7168 columns) and a partial one (2080).
TEST_P(Mxfp8QuantizeShapes, RowwiseGroupsStartInsideTiles) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_shapes_rowwise_", dtype_name(dtype))));
  const std::vector<int32_t> splits{5, 0, 37, 11, 0, 70, 1, 200, 33, 3, 90};
  for (const int row_align : {1, 8}) {
    for (const int64_t cols : {int64_t{7168}, int64_t{2080}}) {
      const GroupLayout l = make_layout(splits, row_align, 560);
      const int64_t used = l.offsets.back();
      ASSERT_NE(used % 32, 0);
      const std::vector<double> x = grouped_values(rng, l, cols, dtype);
      QuantizeRun run(dtype, l.capacity_rows, cols, nan_gaps(x, l, cols), l.offsets);
      run.set_splits(splits);
      const Expected want = expected_of(x, l.capacity_rows, cols, used, /*col=*/false);
      expect_quantized(run, Layouts::kRow, want, detail::concat("row_align ", row_align, ", ", cols, " columns"));
    }
  }
}

// One group of 1000 rows in 1056 (NaN padding): the last column-wise block of each column is
// short. 7264 columns end in a 96-column tile.
TEST_P(Mxfp8QuantizeShapes, UsedRowsEndInsideATileAndPartialColumnTile) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_shapes_partial_", dtype_name(dtype))));
  const int64_t rows = 1056, cols = 7264, used = 1000;
  std::vector<double> x = mixed_values(rng, rows, cols, dtype);
  plant_edges(x, used / 32 * 32, cols, dtype, rng);
  std::fill(x.begin() + used * cols, x.end(), kNaN);
  QuantizeRun run(dtype, rows, cols, x, {0, used});
  const Expected want = expected_of(x, rows, cols, used);
  expect_quantized(run, Layouts::kBoth, want, "1000 of 1056 rows, 7264 columns, both");
  expect_quantized(run, Layouts::kCol, want, "1000 of 1056 rows, 7264 columns, column-wise");
}

// Scales pointers one byte past a 4-byte boundary (only the data pointers must be aligned): every
// scale byte lands in place, and the byte before each array is left alone.
TEST_P(Mxfp8QuantizeShapes, UnalignedScalesPointers) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_shapes_unaligned_", dtype_name(dtype))));
  const int64_t rows = 320, cols = 1024, used = 300;
  const std::vector<double> x = mixed_values(rng, rows, cols, dtype);
  QuantizeRun run(dtype, rows, cols, x, {0, 128, used});
  const Expected want = expected_of(x, rows, cols, used);
  DeviceArray<uint8_t> row_scales(rows * cols / 32 + 1), col_scales(rows * cols / 32 + 1);
  const auto scales_of = [](const DeviceArray<uint8_t>& a) {
    const std::vector<uint8_t> all = a.download();
    EXPECT_EQ(all[0], 0xff) << "the byte before the scales was written";
    return std::vector<uint8_t>(all.begin() + 1, all.end());
  };
  run.row.poison(), run.col.poison(), row_scales.poison(), col_scales.poison();
  const kernels::Mxfp8Rowwise r{run.row.data.get(), row_scales.get() + 1};
  const kernels::Mxfp8Colwise c{run.col.data.get(), col_scales.get() + 1};
  kernels::launch_quantize_mxfp8(dtype, run.x.get(), rows, cols, run.offsets.get(), nullptr, run.groups(), &r, &c,
                                 nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(same_mx("unaligned scales, row-wise", {run.row.data.download(), scales_of(row_scales)}, want.row));
  EXPECT_TRUE(same_mx("unaligned scales, column-wise", {run.col.data.download(), scales_of(col_scales)}, want.col));
}

// Grouped weights (one batch per expert, scales not block-major): 33 row tiles per expert (a band
// of 32 and one of 1) with a 16-column tail (column-wise only), 7168 columns, and 50 rows per
// expert (row-wise only: a tile past each expert's end).
TEST_P(Mxfp8QuantizeShapes, GroupedWeights) {
  const DType dtype = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("mxfp8_shapes_weights_", dtype_name(dtype))));
  struct Shape {
    int groups;
    int64_t n, k;
    Layouts layouts;
  };
  for (const Shape s : {Shape{3, 1056, 272, Layouts::kCol}, Shape{2, 96, 7168, Layouts::kBoth},
                        Shape{4, 50, 256, Layouts::kRow}}) {
    const std::string where = detail::concat("weights ", s.groups, " x ", s.n, " x ", s.k);
    const std::vector<double> w = mixed_values(rng, s.groups * s.n, s.k, dtype);
    DeviceArray<uint16_t> d_w(w.size());
    d_w.upload(bits_of(w, dtype));
    MxBuffer want_row = mx_buffer(s.groups * s.n, s.k), want_col = mx_buffer(s.groups * s.n, s.k);
    mx_quantize_weights(w, s.groups, s.n, s.k, has_row(s.layouts) ? &want_row : nullptr,
                        has_col(s.layouts) ? &want_col : nullptr);
    DeviceMx row(s.groups * s.n, s.k), col(s.groups * s.n, s.k);  // poisoned
    const kernels::Mxfp8Rowwise r = row.rowwise();
    const kernels::Mxfp8Colwise c = col.colwise();
    kernels::launch_quantize_mxfp8_weights(dtype, d_w.get(), s.groups, s.n, s.k, has_row(s.layouts) ? &r : nullptr,
                                           has_col(s.layouts) ? &c : nullptr, nullptr);
    MG_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(same_mx(where + " row-wise", row.download(), want_row));
    EXPECT_TRUE(same_mx(where + " column-wise", col.download(), want_col));
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Mxfp8QuantizeShapes, ::testing::Values(DType::kBF16, DType::kFP16),
                         [](const ::testing::TestParamInfo<DType>& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace moegraph::test
