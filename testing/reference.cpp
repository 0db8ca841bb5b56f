#include "testing/reference.hpp"

#include <algorithm>
#include <thread>

namespace moegraph::testing {
namespace {

// Runs f(i) for i in [0, count) on all cores: the reference of the large cases is the slow part.
template <class F>
void parallel_for(int64_t count, F f) {
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(std::thread::hardware_concurrency(), count));
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      for (int64_t i = w; i < count; i += workers) f(i);
    });
  for (auto& t : pool) t.join();
}

// The group holding data row r, or -1 for gap and padding rows.
std::vector<int> row_groups(const GroupLayout& l) {
  std::vector<int> g(l.capacity_rows, -1);
  for (int e = 0; e < l.groups(); ++e)
    for (int64_t r = l.offsets[e]; r < l.offsets[e] + l.splits[e]; ++r) g[r] = e;
  return g;
}

}  // namespace

std::vector<bool> data_rows(const GroupLayout& l) {
  const auto g = row_groups(l);
  std::vector<bool> out(l.capacity_rows);
  for (int64_t r = 0; r < l.capacity_rows; ++r) out[r] = g[r] >= 0;
  return out;
}

std::vector<bool> written_rows(const GroupLayout& l) {
  std::vector<bool> out(l.capacity_rows, false);
  for (int64_t r = 0; r < l.offsets.back(); ++r) out[r] = true;
  return out;
}

Mat ref_fprop(const GroupLayout& l, const Mat& x, const Mat& w, const Mat& bias, const Mat& scale, int64_t n,
              int64_t k) {
  const auto groups = row_groups(l);
  Mat y(l.capacity_rows * n, 0.0);
  parallel_for(l.capacity_rows, [&](int64_t r) {
    const int e = groups[r];
    if (e < 0) return;
    const double s = scale.empty() ? 1.0 : scale[r];
    for (int64_t j = 0; j < n; ++j) {
      const double* xr = &x[r * k];
      const double* wr = &w[(e * n + j) * k];
      double acc = 0.0;
      for (int64_t i = 0; i < k; ++i) acc += xr[i] * wr[i];
      if (!bias.empty()) acc += s * bias[e * n + j];
      y[r * n + j] = acc;
    }
  });
  return y;
}

Mat ref_dgrad(const GroupLayout& l, const Mat& dy, const Mat& w, int64_t n, int64_t k) {
  const auto groups = row_groups(l);
  Mat dx(l.capacity_rows * k, 0.0);
  parallel_for(l.capacity_rows, [&](int64_t r) {
    const int e = groups[r];
    if (e < 0) return;
    for (int64_t j = 0; j < n; ++j) {
      const double g = dy[r * n + j];
      const double* wr = &w[(e * n + j) * k];
      for (int64_t i = 0; i < k; ++i) dx[r * k + i] += g * wr[i];
    }
  });
  return dx;
}

Mat ref_wgrad(const GroupLayout& l, const Mat& dy, const Mat& x, int64_t n, int64_t k) {
  const int g = l.groups();
  Mat dw(static_cast<std::size_t>(g) * n * k, 0.0);
  parallel_for(static_cast<int64_t>(g) * n, [&](int64_t en) {
    const int e = static_cast<int>(en / n);
    const int64_t j = en % n;
    double* out = &dw[en * k];
    for (int64_t r = l.offsets[e]; r < l.offsets[e] + l.splits[e]; ++r) {
      const double d = dy[r * n + j];
      const double* xr = &x[r * k];
      for (int64_t i = 0; i < k; ++i) out[i] += d * xr[i];
    }
  });
  return dw;
}

Mat ref_bias_grad(const GroupLayout& l, const Mat& dy, const Mat& scale, int64_t n) {
  Mat db(static_cast<std::size_t>(l.groups()) * n, 0.0);
  for (int e = 0; e < l.groups(); ++e)
    for (int64_t r = l.offsets[e]; r < l.offsets[e] + l.splits[e]; ++r) {
      const double s = scale.empty() ? 1.0 : scale[r];
      for (int64_t j = 0; j < n; ++j) db[e * n + j] += s * dy[r * n + j];
    }
  return db;
}

Mat ref_scale_grad(const GroupLayout& l, const Mat& dy, const Mat& bias, int64_t n) {
  const auto groups = row_groups(l);
  Mat ds(l.capacity_rows, 0.0);
  for (int64_t r = 0; r < l.capacity_rows; ++r) {
    const int e = groups[r];
    if (e < 0) continue;
    double acc = 0.0;
    for (int64_t j = 0; j < n; ++j) acc += dy[r * n + j] * bias[e * n + j];
    ds[r] = acc;
  }
  return ds;
}

}  // namespace moegraph::testing
