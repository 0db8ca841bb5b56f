#include "testing/mxfp8_operands.hpp"

#include <stdexcept>
#include <utility>

#include "testing/mxfp8_reference.hpp"

namespace moegraph::testing {
namespace {

// An MXFP8 element in fp64: e4m3 * 2^(scale - 127) is exact (4 significant bits), which the
// tensor cores multiply exactly too, unlike mx_dequantize_rowwise's rounding into an output type.
double mx_value(const MxBuffer& q, int64_t element, int64_t scale) {
  return e4m3_decode(q.data[element]) * e8m0_decode(q.scales[scale]);
}

}  // namespace

Mat mx_rowwise_values(const Mat& x, int64_t rows, int64_t cols) {
  MxBuffer q = mx_buffer(rows, cols);
  mx_quantize_rowwise(x, rows, cols, rows, q);
  Mat out(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) out[i] = mx_value(q, i, i / kMxBlockSize);
  return out;
}

Mat mx_colwise_values(const GroupLayout& l, const Mat& x, int64_t cols) {
  for (int e = 0; e < l.groups(); ++e)
    if (l.splits[e] > 0 && l.offsets[e] % kMxBlockSize != 0)
      throw std::invalid_argument("MXFP8 column-wise blocks need groups starting on multiples of 32");
  const int64_t used = l.offsets.back();
  const int64_t rows = (used + kMxBlockSize - 1) / kMxBlockSize * kMxBlockSize;
  Mat head(x.begin(), x.begin() + used * cols);
  head.resize(rows * cols, 0.0);
  MxBuffer q = mx_buffer(rows, cols);
  mx_quantize_colwise(head, rows, cols, used, q);
  Mat out(l.capacity_rows * cols, 0.0);
  for (int64_t r = 0; r < used; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[r * cols + c] = mx_value(q, mx_colwise_index(r, c, rows, cols), r / kMxBlockSize * cols + c);
  return out;
}

Mat mx_weight_values(const Mat& w, int groups, int64_t n, int64_t k, bool for_dgrad) {
  MxBuffer q = mx_buffer(groups * (for_dgrad ? k : n), for_dgrad ? n : k);
  mx_quantize_weights(w, groups, n, k, for_dgrad ? nullptr : &q, for_dgrad ? &q : nullptr);
  Mat out(w.size());
  for (int64_t e = 0; e < groups; ++e)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < k; ++i) {
        const int64_t at = (e * n + j) * k + i, stored = for_dgrad ? (e * k + i) * n + j : at;
        out[at] = mx_value(q, stored, stored / kMxBlockSize);
      }
  return out;
}

const Mat& GemmOperands::rowwise(const Mat& m, int64_t cols) {
  return mxfp8_ ? hold(mx_rowwise_values(m, l_.capacity_rows, cols)) : m;
}

const Mat& GemmOperands::colwise(const Mat& m, int64_t cols) {
  return mxfp8_ ? hold(mx_colwise_values(l_, m, cols)) : m;
}

const Mat& GemmOperands::weight(const Mat& w, int64_t n, int64_t k, bool for_dgrad) {
  return mxfp8_ ? hold(mx_weight_values(w, l_.groups(), n, k, for_dgrad)) : w;
}

}  // namespace moegraph::testing
