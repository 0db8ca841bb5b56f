// The operands the MXFP8 recipe's GEMMs read (docs/mxfp8.md "Where the recipe uses them"), as fp64
// matrices in the layout of the 16-bit tensors they are made from: each is quantized as the device
// quantizes it (testing/mxfp8_reference) and dequantized exactly (e4m3 * 2^(scale - 127) has 4
// significant bits, which the tensor cores multiply exactly too). Shared by the grouped-linear
// reference (testing/problem) and the layer reference (testing/moe_layer_reference).
#pragma once

#include <cstdint>
#include <deque>
#include <utility>

#include "moegraph/types.hpp"
#include "testing/reference.hpp"

namespace moegraph::testing {

// x [rows, cols] quantized row-wise (blocks of 32 along cols: fprop's x, dgrad's dy), dequantized.
// Rows that are zero (gap and padding rows of the host copies) stay zero.
Mat mx_rowwise_values(const Mat& x, int64_t rows, int64_t cols);

// A grouped buffer x [l.capacity_rows, cols], zero outside the data rows, quantized column-wise as
// the device does for wgrad: blocks of 32 rows from each group's start (a multiple of 32, else
// std::invalid_argument), over the used rows [0, offsets[G]) only (the last block may be short),
// dequantized; zero past them.
Mat mx_colwise_values(const GroupLayout& l, const Mat& x, int64_t cols);

// The weights w [groups, n, k] as fprop reads them (row-wise, blocks along k) or as dgrad reads
// them (each expert's W_e^T [k, n] row-wise, blocks along n), dequantized, both in w's [groups, n,
// k] layout.
Mat mx_weight_values(const Mat& w, int groups, int64_t n, int64_t k, bool for_dgrad);

// The operands of one layout's GEMMs as a recipe reads them: with bf16 the 16-bit tensors
// themselves (returned as they are: no copy, the values unchanged); with mxfp8 the copies above,
// held until this object goes. Only the GEMMs read these: bias gradients read the unquantized dy.
class GemmOperands {
 public:
  GemmOperands(Recipe recipe, const GroupLayout& l) : mxfp8_(recipe == Recipe::kMXFP8), l_(l) {}

  // fprop's x and dgrad's dy [capacity_rows, cols]: blocks of 32 along cols (K of fprop, N of dgrad).
  const Mat& rowwise(const Mat& m, int64_t cols);
  // wgrad's dy and x [capacity_rows, cols]: blocks of 32 rows from each group's start.
  const Mat& colwise(const Mat& m, int64_t cols);
  // W [groups, n, k] as fprop reads it (blocks along k) or as dgrad reads it (W_e^T, blocks along n).
  const Mat& weight(const Mat& w, int64_t n, int64_t k, bool for_dgrad);

 private:
  const Mat& hold(Mat m) { return held_.emplace_back(std::move(m)); }  // a deque never moves its elements

  bool mxfp8_;
  const GroupLayout& l_;
  std::deque<Mat> held_;
};

}  // namespace moegraph::testing
