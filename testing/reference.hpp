// fp64 CPU references of the grouped-linear math, on inputs already rounded to the device type.
// Rows follow the device layout: group e occupies [offsets[e], offsets[e] + splits[e]).
#pragma once

#include <cstdint>
#include <vector>

namespace moegraph::testing {

struct GroupLayout {
  std::vector<int32_t> splits;   // [G]
  std::vector<int64_t> offsets;  // [G + 1], aligned starts
  int64_t capacity_rows = 0;
  int groups() const { return static_cast<int>(splits.size()); }
};

using Mat = std::vector<double>;

// y[r, n] = sum_k x[r, k] W[e, n, k] + s_r b[e, n]  (bias/scale may be empty). Gap rows: 0.
Mat ref_fprop(const GroupLayout& l, const Mat& x, const Mat& w, const Mat& bias, const Mat& scale, int64_t n,
              int64_t k);
// dx[r, k] = sum_n dy[r, n] W[e, n, k]. Gap rows: 0.
Mat ref_dgrad(const GroupLayout& l, const Mat& dy, const Mat& w, int64_t n, int64_t k);
// dW[e, n, k] = sum_{r in e} dy[r, n] x[r, k]
Mat ref_wgrad(const GroupLayout& l, const Mat& dy, const Mat& x, int64_t n, int64_t k);
// db[e, n] = sum_{r in e} s_r dy[r, n]
Mat ref_bias_grad(const GroupLayout& l, const Mat& dy, const Mat& scale, int64_t n);
// ds[r] = <dy_r, b_e>. Gap rows: 0.
Mat ref_scale_grad(const GroupLayout& l, const Mat& dy, const Mat& bias, int64_t n);

// Which rows of a grouped buffer a kernel writes: data rows and alignment gaps (true), and the
// padding past the last group (false).
std::vector<bool> written_rows(const GroupLayout& l);
std::vector<bool> data_rows(const GroupLayout& l);

}  // namespace moegraph::testing
