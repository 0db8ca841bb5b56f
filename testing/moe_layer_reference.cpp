#include "testing/moe_layer_reference.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "moegraph/error.hpp"
#include "testing/mxfp8_operands.hpp"
#include "testing/mxfp8_reference.hpp"

namespace moegraph::testing {
namespace {

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// What the device stores: the activation dtype when rounding, exact fp64 otherwise.
struct Storage {
  DType dtype;
  bool round;
  double operator()(double v) const {
    if (!round) return v;
    return dtype == DType::kFP32 ? static_cast<double>(static_cast<float>(v)) : round_to(v, dtype);
  }
  Mat operator()(Mat m) const {
    for (double& v : m) v = (*this)(v);
    return m;
  }
};

const Mat& or_empty(const Mat* m) {
  static const Mat kEmpty;
  return m == nullptr ? kEmpty : *m;
}

// The k = top_k highest scores of one token, descending; ties go to the lower id.
void select_topk(const double* scores, int experts, int top_k, int32_t* ids) {
  for (int j = 0; j < top_k; ++j) {
    int best = -1;
    for (int e = 0; e < experts; ++e) {
      if (std::find(ids, ids + j, e) != ids + j) continue;
      if (best < 0 || scores[e] > scores[best]) best = e;  // strict: an equal later id loses
    }
    ids[j] = best;
  }
}

// d aux / d scores[t, e], the same for every token (counts are piecewise constant).
std::vector<double> aux_score_grad(const RouterRef& r, const RouterSpec& spec) {
  std::vector<double> g(spec.experts, 0.0);
  if (spec.aux_coef == 0.0 || r.tokens == 0) return g;
  const double n = static_cast<double>(r.tokens);
  for (int e = 0; e < spec.experts; ++e) g[e] = spec.aux_coef * spec.experts * r.counts[e] / (spec.top_k * n * n);
  return g;
}

// Why token t's ids are not a valid top-k of its scores (empty: valid).
std::string topk_problem(const double* scores, const int32_t* ids, int experts, int top_k, double eps) {
  std::ostringstream os;
  for (int j = 0; j < top_k; ++j) {
    if (ids[j] < 0 || ids[j] >= experts) {
      os << "id " << ids[j] << " at j = " << j << " is outside [0, " << experts << ")";
      return os.str();
    }
    if (std::find(ids, ids + j, ids[j]) != ids + j) {
      os << "id " << ids[j] << " is chosen twice";
      return os.str();
    }
    if (j > 0 && scores[ids[j]] > scores[ids[j - 1]] + eps) {
      os << "ids not in descending score order: id " << ids[j - 1] << " (score " << scores[ids[j - 1]]
         << ") before id " << ids[j] << " (score " << scores[ids[j]] << ")";
      return os.str();
    }
  }
  int lowest = ids[0];
  for (int j = 1; j < top_k; ++j)
    if (scores[ids[j]] < scores[lowest]) lowest = ids[j];
  for (int e = 0; e < experts; ++e) {
    if (std::find(ids, ids + top_k, e) != ids + top_k) continue;
    if (scores[e] > scores[lowest] + eps) {
      os << "unchosen id " << e << " (score " << scores[e] << ") scores above chosen id " << lowest << " (score "
         << scores[lowest] << ")";
      return os.str();
    }
  }
  return {};
}

}  // namespace

RouterRef ref_router_forward(const Mat& logits, int64_t n, const RouterSpec& spec,
                             const std::vector<int32_t>* forced_ids) {
  const int E = spec.experts, k = spec.top_k;
  MG_CHECK(E >= 1 && k >= 1 && k <= E, "the router needs 1 <= top_k <= experts, got top_k ", k, ", experts ", E);
  MG_CHECK(n >= 0 && logits.size() >= static_cast<std::size_t>(n * E), "logits hold ", logits.size(),
           " values, fewer than tokens * experts = ", n * E);
  MG_CHECK(forced_ids == nullptr || forced_ids->size() >= static_cast<std::size_t>(n * k), "forced ids hold ",
           forced_ids ? forced_ids->size() : 0, " values, fewer than tokens * top_k = ", n * k);
  RouterRef r;
  r.tokens = n;
  r.scores.assign(n * E, 0.0);
  r.topk_ids.assign(n * k, 0);
  r.topk_weights.assign(n * k, 0.0);
  r.counts.assign(E, 0);
  for (int64_t t = 0; t < n; ++t) {
    const double* l = &logits[t * E];
    double* s = &r.scores[t * E];
    if (spec.sigmoid) {
      for (int e = 0; e < E; ++e) s[e] = sigmoid(l[e]);
    } else {
      const double top = *std::max_element(l, l + E);
      double sum = 0.0;
      for (int e = 0; e < E; ++e) sum += s[e] = std::exp(l[e] - top);
      for (int e = 0; e < E; ++e) s[e] /= sum;
    }
    int32_t* ids = &r.topk_ids[t * k];
    if (forced_ids != nullptr) {
      std::copy_n(forced_ids->begin() + t * k, k, ids);
      for (int j = 0; j < k; ++j)
        MG_CHECK(ids[j] >= 0 && ids[j] < E, "forced id ", ids[j], " of token ", t, " is outside [0, ", E,
                 "): check it with check_topk_selection first");
    } else {
      select_topk(s, E, k, ids);
    }
    double* w = &r.topk_weights[t * k];
    double chosen = 0.0;
    for (int j = 0; j < k; ++j) chosen += w[j] = s[ids[j]];
    for (int j = 0; j < k; ++j) {
      if (spec.renormalize) w[j] /= chosen;
      ++r.counts[ids[j]];
    }
  }
  if (spec.aux_coef != 0.0 && n > 0) {
    double sum = 0.0;
    for (int e = 0; e < E; ++e) {
      double column = 0.0;
      for (int64_t t = 0; t < n; ++t) column += r.scores[t * E + e];
      sum += r.counts[e] * column;
    }
    r.aux_loss = spec.aux_coef * E / (k * static_cast<double>(n) * static_cast<double>(n)) * sum;
  }
  return r;
}

Mat ref_router_backward(const RouterRef& r, const Mat& d_topk_weights, const RouterSpec& spec) {
  const int E = spec.experts, k = spec.top_k;
  const int64_t n = r.tokens;
  MG_CHECK(d_topk_weights.size() >= static_cast<std::size_t>(n * k), "d_topk_weights hold ",
           d_topk_weights.size(), " values, fewer than tokens * top_k = ", n * k);
  const std::vector<double> aux = aux_score_grad(r, spec);
  Mat d_logits(n * E, 0.0);
  std::vector<double> ds(E);
  for (int64_t t = 0; t < n; ++t) {
    const double* s = &r.scores[t * E];
    const int32_t* ids = &r.topk_ids[t * k];
    const double* w = &r.topk_weights[t * k];
    const double* dw = &d_topk_weights[t * k];
    ds = aux;
    if (spec.renormalize) {
      double chosen = 0.0, dot = 0.0;
      for (int j = 0; j < k; ++j) chosen += s[ids[j]], dot += dw[j] * w[j];
      for (int j = 0; j < k; ++j) ds[ids[j]] += (dw[j] - dot) / chosen;
    } else {
      for (int j = 0; j < k; ++j) ds[ids[j]] += dw[j];
    }
    double* dl = &d_logits[t * E];
    if (spec.sigmoid) {
      for (int e = 0; e < E; ++e) dl[e] = ds[e] * s[e] * (1.0 - s[e]);
    } else {
      double dot = 0.0;
      for (int e = 0; e < E; ++e) dot += s[e] * ds[e];
      for (int e = 0; e < E; ++e) dl[e] = s[e] * (ds[e] - dot);
    }
  }
  return d_logits;
}

CompareResult check_topk_selection(const RouterRef& r, const std::vector<int32_t>& ids, int top_k, double eps) {
  const int E = static_cast<int>(r.counts.size());
  const int64_t n = r.tokens;
  CompareResult result;
  if (top_k < 1 || ids.size() < static_cast<std::size_t>(n * top_k)) {
    result.ok = false;
    result.message = detail::concat("topk_ids: ", ids.size(), " ids for ", n, " tokens of top_k ", top_k);
    return result;
  }
  result.compared = static_cast<std::size_t>(n * top_k);
  int64_t first_bad = -1;
  std::string first_problem;
  for (int64_t t = 0; t < n; ++t) {
    std::string problem = topk_problem(&r.scores[t * E], &ids[t * top_k], E, top_k, eps);
    if (problem.empty()) continue;
    if (result.out_of_tolerance++ == 0) first_bad = t, first_problem = std::move(problem);
  }
  result.ok = result.out_of_tolerance == 0;
  if (!result.ok)
    result.message = detail::concat("topk_ids: ", result.out_of_tolerance, " of ", n,
                                    " tokens are not a valid top-", top_k, " (eps ", eps, "); first: token ",
                                    first_bad, ": ", first_problem);
  return result;
}

DispatchRef ref_dispatch(const RouterRef& r, const RouterSpec& spec, int64_t capacity_rows) {
  const int E = spec.experts, k = spec.top_k;
  const int64_t n = r.tokens, assignments = n * k;
  MG_CHECK(r.topk_ids.size() >= static_cast<std::size_t>(assignments), "the router holds ", r.topk_ids.size(),
           " ids, fewer than tokens * top_k = ", assignments);
  const bool capped = spec.capacity_factor > 0.0;
  const double capacity = capped ? std::ceil(spec.capacity_factor * static_cast<double>(n) * k / E) : 0.0;
  std::vector<int32_t> kept(E, 0);
  std::vector<int32_t> slot(assignments, -1);  // index among its expert's kept assignments
  DispatchRef d;
  for (int64_t i = 0; i < assignments; ++i) {  // (token, j) order: the earlier assignments are kept
    const int32_t e = r.topk_ids[i];
    MG_CHECK(e >= 0 && e < E, "expert id ", e, " of assignment ", i, " is outside [0, ", E, ")");
    if (!capped || kept[e] < capacity)
      slot[i] = kept[e]++;
    else
      ++d.dropped;
  }
  d.layout = make_layout(kept, spec.row_align, capacity_rows);
  d.row_of.assign(assignments, -1);
  d.token_of_row.assign(capacity_rows, -1);
  d.row_weight.assign(capacity_rows, 0.0);
  for (int64_t i = 0; i < assignments; ++i) {
    if (slot[i] < 0) continue;
    const int64_t row = d.layout.offsets[r.topk_ids[i]] + slot[i];
    d.row_of[i] = static_cast<int32_t>(row);
    d.token_of_row[row] = static_cast<int32_t>(i / k);
    d.row_weight[row] = r.topk_weights[i];
  }
  return d;
}

Mat ref_permute(const DispatchRef& d, const Mat& x, int64_t hidden) {
  const int64_t rows = static_cast<int64_t>(d.token_of_row.size());
  Mat out(rows * hidden, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    if (const int32_t t = d.token_of_row[r]; t >= 0) std::copy_n(&x[t * hidden], hidden, &out[r * hidden]);
  return out;
}

Mat ref_combine(const DispatchRef& d, const Mat& rows, const Mat& topk_weights, int64_t n, int top_k,
                int64_t hidden) {
  Mat y(n * hidden, 0.0);
  for (int64_t t = 0; t < n; ++t)
    for (int j = 0; j < top_k; ++j) {
      const int32_t row = d.row_of[t * top_k + j];
      if (row < 0) continue;
      const double w = topk_weights.empty() ? 1.0 : topk_weights[t * top_k + j];
      for (int64_t c = 0; c < hidden; ++c) y[t * hidden + c] += w * rows[row * hidden + c];
    }
  return y;
}

MoeLayerRef ref_moe_layer(const MoeLayerInputs& in) {
  const int64_t n = in.tokens, h = in.hidden, f = in.ffn, rows = in.capacity_rows;
  const int E = in.router.experts, k = in.router.top_k;
  const Storage store{in.dtype, in.round_intermediates};
  const Mat& x = *in.x;
  const Mat& wr = *in.wr;
  const Mat& b1 = or_empty(in.b1);
  const Mat& b2 = or_empty(in.b2);
  auto expect_size = [](const char* what, const Mat& m, int64_t size) {
    MG_CHECK(m.size() == static_cast<std::size_t>(size), "ref_moe_layer: ", what, " holds ", m.size(),
             " values, expected ", size);
  };
  expect_size("x", x, n * h);
  expect_size("wr", wr, int64_t{E} * h);
  expect_size("w1", *in.w1, int64_t{E} * 2 * f * h);
  expect_size("w2", *in.w2, int64_t{E} * h * f);
  if (!b1.empty()) expect_size("b1", b1, int64_t{E} * 2 * f);
  if (!b2.empty()) expect_size("b2", b2, int64_t{E} * h);
  if (in.dy != nullptr) expect_size("dy", *in.dy, n * h);
  // The device needs multiples of 128 (its GEMMs stage 128 K at a time); the reference only whole
  // blocks along K and N, and for the backward (column-wise copies) groups starting on a block of rows.
  MG_CHECK(in.recipe != Recipe::kMXFP8 ||
               (h % kMxBlockSize == 0 && f % kMxBlockSize == 0 &&
                (in.dy == nullptr || in.router.row_align == 32 || in.router.row_align == 128)),
           "ref_moe_layer: the mxfp8 recipe needs hidden and ffn multiples of ", kMxBlockSize,
           " and for the backward row_align 32 or 128, got hidden ", h, ", ffn ", f, ", row_align ",
           in.router.row_align, in.dy == nullptr ? " (forward only)" : " (with the backward)");
  MoeLayerRef out;

  // Router: fp32 logits and scores on the device, not rounded here.
  out.logits.assign(n * E, 0.0);
  for (int64_t t = 0; t < n; ++t)
    for (int e = 0; e < E; ++e) {
      double acc = 0.0;
      for (int64_t c = 0; c < h; ++c) acc += x[t * h + c] * wr[e * h + c];
      out.logits[t * E + e] = acc;
    }
  out.router = ref_router_forward(out.logits, n, in.router, in.forced_ids);
  out.aux_loss = out.router.aux_loss;
  out.dispatch = ref_dispatch(out.router, in.router, rows);
  const DispatchRef& d = out.dispatch;
  const GroupLayout& l = d.layout;
  const Mat& w_row = d.row_weight;  // 0 on gap rows, so their fused SwiGLU output stays 0
  GemmOperands gemm(in.recipe, l);

  // Experts: FC1 -> SwiGLU (optionally scaled by the routing weight) -> FC2.
  const Mat px = ref_permute(d, x, h);
  out.h1 = store(ref_fprop(l, gemm.rowwise(px, h), gemm.weight(*in.w1, 2 * f, h, false), b1, {}, 2 * f, h));
  const Mat& h1 = out.h1;
  Mat& a = out.a;
  a.assign(rows * f, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < f; ++j) {
      const double gate = h1[r * 2 * f + j], up = h1[r * 2 * f + f + j];
      const double swiglu = gate * sigmoid(gate) * up;
      a[r * f + j] = store(in.fuse_weights ? w_row[r] * swiglu : swiglu);
    }
  out.expert_out = store(
      ref_fprop(l, gemm.rowwise(a, f), gemm.weight(*in.w2, h, f, false), b2, in.fuse_weights ? w_row : Mat{}, h, f));
  const Mat& expert_out = out.expert_out;
  out.y = store(ref_combine(d, expert_out, in.fuse_weights ? Mat{} : out.router.topk_weights, n, k, h));
  if (in.dy == nullptr) return out;
  const Mat& dy = *in.dy;

  // Combine backward.
  Mat d_out(rows * h, 0.0);
  Mat d_row_weight(rows, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t t = d.token_of_row[r];
    if (t < 0) continue;
    double dot = 0.0;
    for (int64_t c = 0; c < h; ++c) {
      const double g = dy[t * h + c];
      d_out[r * h + c] = in.fuse_weights ? g : store(w_row[r] * g);
      dot += g * expert_out[r * h + c];
    }
    if (!in.fuse_weights) d_row_weight[r] = dot;
  }

  // FC2 backward.
  out.da = store(ref_dgrad(l, gemm.rowwise(d_out, h), gemm.weight(*in.w2, h, f, true), h, f));
  const Mat& da = out.da;
  out.dw2 = ref_wgrad(l, gemm.colwise(d_out, h), gemm.colwise(a, f), h, f);
  Mat bias_scale_grad;  // gradient of FC2's per-row bias scale (fused with bias)
  if (!b2.empty()) {
    out.db2 = ref_bias_grad(l, d_out, in.fuse_weights ? w_row : Mat{}, h);
    if (in.fuse_weights) bias_scale_grad = ref_scale_grad(l, d_out, b2, h);
  }

  // SwiGLU backward.
  Mat& dh1 = out.dh1;
  dh1.assign(rows * 2 * f, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const double w = in.fuse_weights ? w_row[r] : 1.0;
    double dot = 0.0;
    for (int64_t j = 0; j < f; ++j) {
      const double gate = h1[r * 2 * f + j], up = h1[r * 2 * f + f + j], g = da[r * f + j];
      const double s = sigmoid(gate);
      dh1[r * 2 * f + j] = store(w * (g * up * s * (1.0 + gate * (1.0 - s))));
      dh1[r * 2 * f + f + j] = store(w * (g * gate * s));
      dot += g * (gate * s * up);
    }
    if (in.fuse_weights && d.token_of_row[r] >= 0)
      d_row_weight[r] = dot + (bias_scale_grad.empty() ? 0.0 : bias_scale_grad[r]);
  }

  // FC1 backward.
  const Mat d_perm = store(ref_dgrad(l, gemm.rowwise(dh1, 2 * f), gemm.weight(*in.w1, 2 * f, h, true), 2 * f, h));
  out.dw1 = ref_wgrad(l, gemm.colwise(dh1, 2 * f), gemm.colwise(px, h), 2 * f, h);
  if (!b1.empty()) out.db1 = ref_bias_grad(l, dh1, {}, 2 * f);

  // Router backward.
  Mat d_topk_weights(n * k, 0.0);
  for (int64_t i = 0; i < n * k; ++i)
    if (d.row_of[i] >= 0) d_topk_weights[i] = d_row_weight[d.row_of[i]];
  out.d_logits = store(ref_router_backward(out.router, d_topk_weights, in.router));

  // dx: the gathered expert input gradients are summed and stored first (the un-permute), then
  // the router's input gradient is added by its GEMM in fp32 with one more rounding; dW_r.
  out.dx.assign(n * h, 0.0);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < h; ++c) {
      double router = 0.0;
      for (int e = 0; e < E; ++e) router += out.d_logits[t * E + e] * wr[e * h + c];
      double experts = 0.0;
      for (int j = 0; j < k; ++j)
        if (const int32_t row = d.row_of[t * k + j]; row >= 0) experts += d_perm[row * h + c];
      out.dx[t * h + c] = store(router + store(experts));
    }
  out.dwr.assign(static_cast<std::size_t>(E) * h, 0.0);
  for (int64_t t = 0; t < n; ++t)
    for (int e = 0; e < E; ++e) {
      const double g = out.d_logits[t * E + e];
      for (int64_t c = 0; c < h; ++c) out.dwr[e * h + c] += g * x[t * h + c];
    }
  return out;
}

}  // namespace moegraph::testing
