#include "testing/expert_mlp_reference.hpp"

#include <cmath>

#include "testing/data.hpp"

namespace moegraph::testing {

ExpertMlpReference ref_expert_mlp(const GroupLayout& l, const ExpertMlpInputs& in) {
  const int64_t h = in.hidden, f = in.ffn, rows = l.capacity_rows;
  auto round_all = [&](Mat m) {
    for (double& v : m) v = round_to(v, in.dtype);
    return m;
  };
  auto sigmoid = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  const Mat h1 = round_all(ref_fprop(l, *in.x, *in.w1, *in.b1, {}, 2 * f, h));
  Mat a(rows * f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < f; ++j) {
      const double gate = h1[r * 2 * f + j], up = h1[r * 2 * f + f + j];
      a[r * f + j] = gate * sigmoid(gate) * up;
    }
  a = round_all(std::move(a));
  ExpertMlpReference out;
  out.y = ref_fprop(l, a, *in.w2, *in.b2, {}, h, f);
  if (in.dy == nullptr) return out;
  const Mat da = round_all(ref_dgrad(l, *in.dy, *in.w2, h, f));
  Mat dh1(rows * 2 * f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < f; ++j) {
      const double gate = h1[r * 2 * f + j], up = h1[r * 2 * f + f + j], g = da[r * f + j];
      const double s = sigmoid(gate);
      dh1[r * 2 * f + j] = g * up * s * (1.0 + gate * (1.0 - s));
      dh1[r * 2 * f + f + j] = g * gate * s;
    }
  dh1 = round_all(std::move(dh1));
  out.dx = ref_dgrad(l, dh1, *in.w1, 2 * f, h);
  out.dw2 = ref_wgrad(l, *in.dy, a, h, f);
  out.dw1 = ref_wgrad(l, dh1, *in.x, 2 * f, h);
  if (!in.b2->empty()) {
    out.db2 = ref_bias_grad(l, *in.dy, {}, h);
    out.db1 = ref_bias_grad(l, dh1, {}, 2 * f);
  }
  return out;
}

}  // namespace moegraph::testing
