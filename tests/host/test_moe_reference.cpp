// The fp64 MoE-layer reference (testing/moe_layer_reference.hpp): the router, dispatch, permute
// and combine on hand-computed examples; the whole layer's gradients against central finite
// differences of its own exact forward (round_intermediates = false); and differential checks
// (fused vs unfused routing weights, the expert-MLP reference on the dispatched rows).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <ostream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "testing/expert_mlp_reference.hpp"
#include "testing/moe_layer_reference.hpp"
#include "tests/common/expect.hpp"

namespace moegraph::test {
namespace {

using Ids = std::vector<int32_t>;

// Hand-computed values are exact up to a few fp64 rounding steps.
constexpr double kHand = 1e-15;

void expect_near_all(const Mat& got, const Mat& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << what << "[" << i << "]";
}

double max_abs(const Mat& m) {
  double v = 0.0;
  for (double e : m) v = std::max(v, std::fabs(e));
  return v;
}

// Equal up to fp64 reassociation: |got - want| <= 1e-12 max|want| element-wise.
void expect_same_math(const Mat& got, const Mat& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  ASSERT_FALSE(want.empty()) << what;
  const double tol = 1e-12 * std::max(1.0, max_abs(want));
  std::size_t bad = 0;
  for (std::size_t i = 0; i < want.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= tol) && bad++ == 0)
      ADD_FAILURE() << what << "[" << i << "]: " << got[i] << " vs " << want[i];
  EXPECT_EQ(bad, 0u) << what << ": elements that differ";
}

bool on_grid(const Mat& m, DType t) {
  return std::all_of(m.begin(), m.end(), [t](double v) { return round_to(v, t) == v; });
}

// A router result built by hand: dispatch, permute and combine read only its ids and weights.
RouterRef routed(int64_t tokens, int experts, Ids ids, Mat weights) {
  RouterRef r;
  r.tokens = tokens;
  r.scores.assign(tokens * experts, 0.0);
  r.counts.assign(experts, 0);
  for (int32_t id : ids) ++r.counts[id];
  r.topk_ids = std::move(ids);
  r.topk_weights = std::move(weights);
  return r;
}

// ---- Router -----------------------------------------------------------------------------------

TEST(RouterReference, SoftmaxTopKTiesGoToTheLowerId) {
  const Mat logits{0, std::log(2.0), std::log(3.0), 0,                 // scores {1, 2, 3, 1} / 7
                   std::log(4.0), 0, std::log(4.0), std::log(2.0)};  // {4, 1, 4, 2} / 11: 0 and 2 tie
  RouterSpec spec{.experts = 4, .top_k = 2};
  const RouterRef r = ref_router_forward(logits, 2, spec);
  expect_near_all(r.scores, {1 / 7., 2 / 7., 3 / 7., 1 / 7., 4 / 11., 1 / 11., 4 / 11., 2 / 11.}, kHand, "scores");
  EXPECT_EQ(r.topk_ids, (Ids{2, 1, 0, 2}));
  expect_near_all(r.topk_weights, {3 / 7., 2 / 7., 4 / 11., 4 / 11.}, kHand, "weights");
  EXPECT_EQ(r.counts, (Ids{1, 1, 2, 0}));
  EXPECT_EQ(r.aux_loss, 0.0);

  spec.renormalize = true;
  spec.aux_coef = 0.5;
  const RouterRef rn = ref_router_forward(logits, 2, spec);
  EXPECT_EQ(rn.topk_ids, r.topk_ids);
  expect_near_all(rn.topk_weights, {0.6, 0.4, 0.5, 0.5}, kHand, "renormalized weights");
  // coef * E / (k n^2) * sum_e counts[e] * sum_t scores[t, e]
  const double aux = 0.5 * 4 / (2 * 4) * (1 * (1 / 7. + 4 / 11.) + 1 * (2 / 7. + 1 / 11.) + 2 * (3 / 7. + 4 / 11.));
  EXPECT_NEAR(rn.aux_loss, aux, kHand);
}

TEST(RouterReference, SigmoidScoresAndRenormalizedWeights) {
  const Mat logits{0, std::log(3.0), -std::log(3.0), 0};  // sigmoids {1/2, 3/4, 1/4, 1/2}: 0 and 3 tie
  RouterSpec spec{.experts = 4, .top_k = 2, .sigmoid = true};
  const RouterRef r = ref_router_forward(logits, 1, spec);
  expect_near_all(r.scores, {0.5, 0.75, 0.25, 0.5}, kHand, "scores");
  EXPECT_EQ(r.topk_ids, (Ids{1, 0}));
  expect_near_all(r.topk_weights, {0.75, 0.5}, kHand, "weights");
  EXPECT_EQ(r.counts, (Ids{1, 1, 0, 0}));

  spec.renormalize = true;
  spec.aux_coef = 0.2;
  const RouterRef rn = ref_router_forward(logits, 1, spec);
  expect_near_all(rn.topk_weights, {0.6, 0.4}, kHand, "renormalized weights");
  EXPECT_NEAR(rn.aux_loss, 0.2 * 4 / 2 * (0.5 + 0.75), kHand);
}

TEST(RouterReference, ForcedIdsTakeTheirOwnScores) {
  const Mat logits{0, std::log(3.0), -std::log(3.0), 0};
  const RouterSpec spec{.experts = 4, .top_k = 2, .sigmoid = true, .renormalize = true};
  const Ids forced{3, 2};
  const RouterRef r = ref_router_forward(logits, 1, spec, &forced);
  EXPECT_EQ(r.topk_ids, forced);
  expect_near_all(r.topk_weights, {0.5 / 0.75, 0.25 / 0.75}, kHand, "weights");
  EXPECT_EQ(r.counts, (Ids{0, 0, 1, 1}));
  const Ids out_of_range{4, 0};
  EXPECT_THROW(ref_router_forward(logits, 1, spec, &out_of_range), Error);
}

TEST(RouterReference, BackwardOnAHandExample) {
  // Two experts with equal logits, k = 1: expert 0 wins the tie, its weight is p_0 = 1/2.
  RouterSpec spec{.experts = 2, .top_k = 1};
  const Mat logits{0, 0}, dw{1};
  const RouterRef r = ref_router_forward(logits, 1, spec);
  ASSERT_EQ(r.topk_ids, Ids{0});
  // softmax: dlogit_e = p_e (ds_e - sum p ds), ds = {1, 0}
  expect_near_all(ref_router_backward(r, dw, spec), {0.25, -0.25}, kHand, "softmax");
  spec.sigmoid = true;  // dlogit_e = ds_e s_e (1 - s_e)
  expect_near_all(ref_router_backward(ref_router_forward(logits, 1, spec), dw, spec), {0.25, 0}, kHand, "sigmoid");
  spec.renormalize = true;  // one renormalized weight is always 1: no gradient
  expect_near_all(ref_router_backward(ref_router_forward(logits, 1, spec), dw, spec), {0, 0}, kHand, "renormalized");
  spec.aux_coef = 0.4;  // ds_e = coef E counts[e] / (k n^2) = {0.8, 0}
  expect_near_all(ref_router_backward(ref_router_forward(logits, 1, spec), dw, spec), {0.2, 0}, kHand, "aux");
}

// ---- Finite differences ---------------------------------------------------------------------------

struct Evaluation {
  double loss;
  Ids topk_ids;  // the selection the loss was computed under
};

struct FdStats {
  int checked = 0, skipped = 0;
};

// Central differences (eps = 1e-6) of `evaluate` with respect to `param[i]` for each listed i,
// against the analytic `grad`. The loss is piecewise smooth in the routing: a perturbation that
// changes the selection is skipped and counted, never compared.
FdStats expect_gradient(const std::string& what, Mat& param, const Mat& grad, const std::vector<std::size_t>& elements,
                        const Ids& base_ids, const std::function<Evaluation()>& evaluate) {
  constexpr double kEps = 1e-6;
  FdStats stats;
  EXPECT_EQ(grad.size(), param.size()) << what;
  if (grad.size() != param.size()) return stats;
  for (std::size_t i : elements) {
    const double saved = param[i];
    param[i] = saved + kEps;
    const Evaluation plus = evaluate();
    param[i] = saved - kEps;
    const Evaluation minus = evaluate();
    param[i] = saved;
    if (plus.topk_ids != base_ids || minus.topk_ids != base_ids) {
      ++stats.skipped;
      continue;
    }
    ++stats.checked;
    const double fd = (plus.loss - minus.loss) / (2 * kEps);
    EXPECT_NEAR(grad[i], fd, 1e-7 * (1.0 + std::fabs(fd))) << what << "[" << i << "]";
  }
  return stats;
}

// Every index of a small tensor, or `limit` distinct random ones of a larger one.
std::vector<std::size_t> elements_of(std::size_t size, std::size_t limit, std::mt19937_64& rng) {
  std::vector<std::size_t> all(size);
  std::iota(all.begin(), all.end(), std::size_t{0});
  if (size <= limit) return all;
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(limit);
  return all;
}

TEST(RouterReference, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(test_seed("RouterReference.BackwardMatchesFiniteDifferences"));
  constexpr int64_t n = 6;
  constexpr int E = 5, k = 3;
  Mat logits = random_values(rng, n * E, 2.0, DType::kFP32);
  const Mat dw = random_values(rng, n * k, 1.0, DType::kFP32);
  for (bool sigmoid : {false, true})
    for (bool renormalize : {false, true})
      for (double aux_coef : {0.0, 0.3}) {
        const RouterSpec spec{.experts = E, .top_k = k, .sigmoid = sigmoid, .renormalize = renormalize,
                              .aux_coef = aux_coef};
        SCOPED_TRACE(detail::concat("sigmoid ", sigmoid, " renormalize ", renormalize, " aux_coef ", aux_coef));
        const RouterRef base = ref_router_forward(logits, n, spec);
        const Mat d_logits = ref_router_backward(base, dw, spec);
        auto evaluate = [&] {
          const RouterRef r = ref_router_forward(logits, n, spec);
          double loss = r.aux_loss;
          for (std::size_t i = 0; i < dw.size(); ++i) loss += dw[i] * r.topk_weights[i];
          return Evaluation{loss, r.topk_ids};
        };
        const FdStats stats = expect_gradient("d_logits", logits, d_logits, elements_of(logits.size(), logits.size(), rng),
                                              base.topk_ids, evaluate);
        EXPECT_EQ(stats.skipped, 0);
      }
}

// ---- Top-k selection check ------------------------------------------------------------------------

TEST(RouterReference, TopkSelectionCheckAcceptsValidIdsAndRejectsWrongOnes) {
  // Token 0: scores of experts 1 > 2 > 3 > 0. Token 1: the same, but 2 and 3 tie to 1e-9 in logits.
  const Mat logits{0, 3, 2, 1, 0, 3, 2, 2 + 1e-9};
  const RouterRef r = ref_router_forward(logits, 2, RouterSpec{.experts = 4, .top_k = 2});
  ASSERT_EQ(r.topk_ids, (Ids{1, 2, 1, 3}));
  auto check = [&](const Ids& ids, double eps = 1e-6) { return check_topk_selection(r, ids, 2, eps); };
  EXPECT_TRUE(passed(check({1, 2, 1, 3})));
  EXPECT_TRUE(passed(check({1, 2, 1, 2})));  // the near-tie resolved the other way: within eps
  EXPECT_FALSE(check({1, 2, 1, 2}, 0.0).ok);  // ... but not with eps = 0
  const CompareResult wrong = check({1, 2, 1, 0});  // experts 2 and 3 outscore the chosen 0
  EXPECT_FALSE(wrong.ok);
  EXPECT_EQ(wrong.out_of_tolerance, 1u);
  EXPECT_NE(wrong.message.find("token 1"), std::string::npos) << wrong.message;
  EXPECT_FALSE(check({2, 1, 1, 3}).ok);   // not in descending order
  EXPECT_FALSE(check({1, 1, 1, 3}).ok);   // a duplicate
  EXPECT_FALSE(check({1, 4, 1, 3}).ok);   // out of range
  EXPECT_FALSE(check({-1, 1, 1, 3}).ok);  // out of range
  EXPECT_FALSE(check({1, 2, 1}).ok);      // too few ids
}

// ---- Dispatch, permute, combine ---------------------------------------------------------------------

// Three tokens, k = 2, three experts: assignments (t, j) -> expert
//   (0,0)->2  (0,1)->0  (1,0)->0  (1,1)->1  (2,0)->0  (2,1)->2
RouterRef three_tokens() { return routed(3, 3, {2, 0, 0, 1, 0, 2}, {.1, .2, .3, .4, .5, .6}); }
RouterSpec three_tokens_spec(int row_align = 1, double capacity_factor = 0.0) {
  return RouterSpec{.experts = 3, .top_k = 2, .capacity_factor = capacity_factor, .row_align = row_align};
}

TEST(DispatchReference, RowsOrderedByExpertThenTokenThenJ) {
  const DispatchRef d = ref_dispatch(three_tokens(), three_tokens_spec(), 6);
  EXPECT_EQ(d.layout.splits, (Ids{3, 1, 2}));
  EXPECT_EQ(d.layout.offsets, make_layout({3, 1, 2}, 1, 6).offsets);
  // expert 0: (0,1) (1,0) (2,0); expert 1: (1,1); expert 2: (0,0) (2,1)
  EXPECT_EQ(d.row_of, (Ids{4, 0, 1, 3, 2, 5}));
  EXPECT_EQ(d.token_of_row, (Ids{0, 1, 2, 1, 0, 2}));
  EXPECT_EQ(d.row_weight, (Mat{.2, .3, .5, .4, .1, .6}));
  EXPECT_EQ(d.dropped, 0);
}

TEST(DispatchReference, AlignedGroupsLeaveEmptyGapRows) {
  const DispatchRef d = ref_dispatch(three_tokens(), three_tokens_spec(16), 64);
  EXPECT_EQ(d.layout.offsets, (std::vector<int64_t>{0, 16, 32, 48}));
  EXPECT_EQ(d.layout.offsets, make_layout({3, 1, 2}, 16, 64).offsets);
  EXPECT_EQ(d.row_of, (Ids{32, 0, 1, 16, 2, 33}));
  for (int64_t row = 0; row < 64; ++row) {
    const bool data = row < 3 || row == 16 || row == 32 || row == 33;
    EXPECT_EQ(d.token_of_row[row] >= 0, data) << "row " << row;
    if (!data) {
      EXPECT_EQ(d.row_weight[row], 0.0) << "row " << row;
    }
  }
  EXPECT_EQ(d.token_of_row[16], 1);
  EXPECT_EQ(d.row_weight[33], .6);
}

TEST(DispatchReference, CapacityFactorDropsTheLaterAssignments) {
  // C = ceil(capacity_factor * n * k / E): 1.0 -> 2; 0.6 -> ceil(1.2) = 2; 0.5 -> 1.
  for (double factor : {1.0, 0.6}) {
    const DispatchRef d = ref_dispatch(three_tokens(), three_tokens_spec(1, factor), 6);
    EXPECT_EQ(d.layout.splits, (Ids{2, 1, 2})) << factor;  // expert 0 drops (2,0)
    EXPECT_EQ(d.layout.offsets, make_layout({2, 1, 2}, 1, 6).offsets) << factor;
    EXPECT_EQ(d.row_of, (Ids{3, 0, 1, 2, -1, 4})) << factor;
    EXPECT_EQ(d.dropped, 1) << factor;
    EXPECT_EQ(d.token_of_row[5], -1) << factor;
  }
  const DispatchRef d = ref_dispatch(three_tokens(), three_tokens_spec(16, 0.5), 48);
  EXPECT_EQ(d.layout.splits, (Ids{1, 1, 1}));
  EXPECT_EQ(d.row_of, (Ids{32, 0, -1, 16, -1, -1}));  // token 2 loses both assignments
  EXPECT_EQ(d.dropped, 3);
}

TEST(DispatchReference, PermuteCopiesTokenRowsAndZeroesTheRest) {
  const DispatchRef d = ref_dispatch(three_tokens(), three_tokens_spec(16), 64);
  const Mat x{1, 2, 3, 4, 5, 6};  // [3 tokens, hidden 2]
  const Mat p = ref_permute(d, x, 2);
  ASSERT_EQ(p.size(), 128u);
  Mat want(128, 0.0);
  auto put = [&](int row, int token) { std::copy_n(&x[token * 2], 2, &want[row * 2]); };
  put(0, 0), put(1, 1), put(2, 2), put(16, 1), put(32, 0), put(33, 2);
  EXPECT_EQ(p, want);
}

TEST(DispatchReference, CombineSumsWeightedRowsOfKeptAssignments) {
  const RouterRef r = three_tokens();
  const DispatchRef d = ref_dispatch(r, three_tokens_spec(), 6);
  const Mat rows{10, 20, 30, 40, 50, 60};  // hidden 1
  expect_near_all(ref_combine(d, rows, r.topk_weights, 3, 2, 1), {.1 * 50 + .2 * 10, .3 * 20 + .4 * 40, .5 * 30 + .6 * 60},
                  kHand, "weighted");
  EXPECT_EQ(ref_combine(d, rows, {}, 3, 2, 1), (Mat{60, 60, 90}));
  const DispatchRef capped = ref_dispatch(r, three_tokens_spec(1, 1.0), 6);  // (2,0) dropped
  expect_near_all(ref_combine(capped, rows, r.topk_weights, 3, 2, 1), {.1 * 40 + .2 * 10, .3 * 20 + .4 * 30, .6 * 50},
                  kHand, "capped");
  const DispatchRef all_dropped = ref_dispatch(r, three_tokens_spec(1, 0.5), 6);  // token 2 keeps nothing
  EXPECT_EQ(ref_combine(all_dropped, rows, r.topk_weights, 3, 2, 1)[2], 0.0);
}

// ---- The whole layer ---------------------------------------------------------------------------------

struct LayerCase {
  std::string name;
  bool sigmoid = false, renormalize = false;
  double aux_coef = 0.0, capacity_factor = 0.0;
  int row_align = 1;
  bool fuse_weights = false, bias = false;
};

// Rows of the permuted buffers: the worst aligned layout of `assignments` rows over the experts.
int64_t capacity_for(int64_t assignments, int experts, int row_align) {
  const int64_t worst = assignments + int64_t{experts} * (row_align - 1);
  return std::max<int64_t>(row_align, (worst + row_align - 1) / row_align * row_align);
}

// Random inputs of one layer, owned here; inputs() points into them, so a test may perturb them.
struct LayerData {
  int64_t tokens, hidden, ffn;
  int experts, top_k;
  Mat x, wr, w1, b1, w2, b2, dy;

  MoeLayerInputs inputs(const LayerCase& c, DType dtype, bool round) const {
    MoeLayerInputs in;
    in.x = &x, in.wr = &wr, in.w1 = &w1, in.b1 = &b1, in.w2 = &w2, in.b2 = &b2, in.dy = &dy;
    in.tokens = tokens, in.hidden = hidden, in.ffn = ffn;
    in.capacity_rows = capacity_for(tokens * top_k, experts, c.row_align);
    in.router = RouterSpec{.experts = experts, .top_k = top_k, .sigmoid = c.sigmoid, .renormalize = c.renormalize,
                           .aux_coef = c.aux_coef, .capacity_factor = c.capacity_factor, .row_align = c.row_align};
    in.fuse_weights = c.fuse_weights;
    in.dtype = dtype;
    in.round_intermediates = round;
    return in;
  }
};

// Values in `dtype` (kFP32: continuous enough for finite differences).
LayerData make_layer_data(std::mt19937_64& rng, int64_t tokens, int experts, int top_k, int64_t hidden, int64_t ffn,
                          bool bias, DType dtype) {
  LayerData d{tokens, hidden, ffn, experts, top_k, {}, {}, {}, {}, {}, {}, {}};
  d.x = random_values(rng, tokens * hidden, 1.0, dtype);
  d.wr = random_values(rng, experts * hidden, 1.0, dtype);
  d.w1 = random_values(rng, experts * 2 * ffn * hidden, 0.5, dtype);
  d.w2 = random_values(rng, experts * hidden * ffn, 0.5, dtype);
  if (bias) {
    d.b1 = random_values(rng, experts * 2 * ffn, 0.3, dtype);
    d.b2 = random_values(rng, experts * hidden, 0.3, dtype);
  }
  d.dy = random_values(rng, tokens * hidden, 1.0, dtype);
  return d;
}

void PrintTo(const LayerCase& c, std::ostream* os) { *os << c.name; }

class MoeLayerGradient : public ::testing::TestWithParam<LayerCase> {};

// Every gradient of L = sum(y * dy) + aux_loss against central differences of the exact forward.
TEST_P(MoeLayerGradient, MatchesFiniteDifferences) {
  const LayerCase& c = GetParam();
  std::mt19937_64 rng(test_seed("MoeLayerGradient." + c.name));
  LayerData data = make_layer_data(rng, 5, 4, 2, 8, 8, c.bias, DType::kFP32);
  const MoeLayerInputs in = data.inputs(c, DType::kFP32, false);
  const MoeLayerRef ref = ref_moe_layer(in);
  if (c.capacity_factor > 0) {
    ASSERT_GT(ref.dispatch.dropped, 0) << "the case must drop assignments";
  }
  if (c.aux_coef > 0) {
    ASSERT_GT(ref.aux_loss, 0.0);
  }
  EXPECT_EQ(ref.db1.empty(), !c.bias);
  EXPECT_EQ(ref.db2.empty(), !c.bias);

  MoeLayerInputs forward = in;
  forward.dy = nullptr;
  auto evaluate = [&] {
    const MoeLayerRef r = ref_moe_layer(forward);
    double loss = r.aux_loss;
    for (std::size_t i = 0; i < r.y.size(); ++i) loss += r.y[i] * data.dy[i];
    return Evaluation{loss, r.router.topk_ids};
  };
  constexpr std::size_t kLimit = 256;  // elements checked per tensor (all but half of w1)
  FdStats total;
  auto check = [&](const char* what, Mat& param, const Mat& grad) {
    const FdStats s = expect_gradient(what, param, grad, elements_of(param.size(), kLimit, rng),
                                      ref.router.topk_ids, evaluate);
    total.checked += s.checked, total.skipped += s.skipped;
  };
  check("dx", data.x, ref.dx);
  check("dwr", data.wr, ref.dwr);
  check("dw1", data.w1, ref.dw1);
  check("dw2", data.w2, ref.dw2);
  if (c.bias) {
    check("db1", data.b1, ref.db1);
    check("db2", data.b2, ref.db2);
  }
  EXPECT_GE(total.checked, c.bias ? 600 : 500);
  EXPECT_LE(total.skipped, total.checked / 20) << "too many perturbations changed the routing";
}

std::vector<LayerCase> gradient_cases() {
  return {
      {.name = "softmax"},
      {.name = "softmax_renormalize_aux_bias_align16", .renormalize = true, .aux_coef = 0.1, .row_align = 16,
       .bias = true},
      {.name = "softmax_fused_aux_bias", .aux_coef = 0.05, .fuse_weights = true, .bias = true},
      {.name = "softmax_renormalize_fused_align32", .renormalize = true, .row_align = 32, .fuse_weights = true},
      {.name = "sigmoid_aux_bias", .sigmoid = true, .aux_coef = 0.2, .bias = true},
      {.name = "sigmoid_renormalize_fused_bias_align16", .sigmoid = true, .renormalize = true, .row_align = 16,
       .fuse_weights = true, .bias = true},
      // C = ceil(0.6 * 10 / 4) = 2 keeps at most 8 of 10 assignments; 0.3 -> C = 1 keeps at most 4.
      {.name = "capacity_softmax_renormalize_aux_bias_align16", .renormalize = true, .aux_coef = 0.1,
       .capacity_factor = 0.6, .row_align = 16, .bias = true},
      {.name = "capacity_softmax_renormalize_fused_aux", .renormalize = true, .aux_coef = 0.1,
       .capacity_factor = 0.6, .fuse_weights = true},
      {.name = "capacity_sigmoid_fused_aux_bias", .sigmoid = true, .aux_coef = 0.1, .capacity_factor = 0.3,
       .fuse_weights = true, .bias = true},
      {.name = "capacity_sigmoid_renormalize_bias_align16", .sigmoid = true, .renormalize = true,
       .capacity_factor = 0.3, .row_align = 16, .bias = true},
  };
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeLayerGradient, ::testing::ValuesIn(gradient_cases()),
                         [](const ::testing::TestParamInfo<LayerCase>& info) { return info.param.name; });

void expect_same_layer(const MoeLayerRef& got, const MoeLayerRef& want, bool bias) {
  expect_same_math(got.y, want.y, "y");
  EXPECT_NEAR(got.aux_loss, want.aux_loss, 1e-15);
  expect_same_math(got.dx, want.dx, "dx");
  expect_same_math(got.dwr, want.dwr, "dwr");
  expect_same_math(got.d_logits, want.d_logits, "d_logits");
  expect_same_math(got.dw1, want.dw1, "dw1");
  expect_same_math(got.dw2, want.dw2, "dw2");
  if (bias) {
    expect_same_math(got.db1, want.db1, "db1");
    expect_same_math(got.db2, want.db2, "db2");
  }
}

TEST(MoeLayerReference, FusedAndUnfusedWeightsAgreeInExactMath) {
  std::mt19937_64 rng(test_seed("MoeLayerReference.FusedAndUnfusedWeightsAgreeInExactMath"));
  const LayerData data = make_layer_data(rng, 16, 4, 2, 16, 16, true, DType::kFP32);
  for (bool sigmoid : {false, true}) {
    SCOPED_TRACE(sigmoid ? "sigmoid" : "softmax");
    LayerCase c{.name = "", .sigmoid = sigmoid, .renormalize = !sigmoid, .aux_coef = 0.1, .capacity_factor = 0.6,
                .row_align = 16, .bias = true};
    const MoeLayerRef unfused = ref_moe_layer(data.inputs(c, DType::kFP32, false));
    ASSERT_GT(unfused.dispatch.dropped, 0);
    c.fuse_weights = true;
    expect_same_layer(ref_moe_layer(data.inputs(c, DType::kFP32, false)), unfused, true);
  }
}

// Rounding: every stored output is a bf16 value; the rounded layers (fused and unfused round
// different intermediates) differ from exact math and from each other, but only by a few bf16
// storage errors (2^-9 relative each) in the relative Frobenius norm. Element-wise bounds do not
// apply here: d_logits, dx and the weight gradients are sums with cancellation.
TEST(MoeLayerReference, RoundingOnlyMovesResultsByStorageErrors) {
  std::mt19937_64 rng(test_seed("MoeLayerReference.RoundingOnlyMovesResultsByStorageErrors"));
  constexpr int E = 8;
  constexpr int64_t h = 32, f = 32;
  const LayerData data = make_layer_data(rng, 64, E, 2, h, f, true, DType::kBF16);
  LayerCase c{.name = "", .renormalize = true, .aux_coef = 0.01, .row_align = 16, .bias = true};
  const MoeLayerRef exact = ref_moe_layer(data.inputs(c, DType::kBF16, false));
  const MoeLayerRef unfused = ref_moe_layer(data.inputs(c, DType::kBF16, true));
  c.fuse_weights = true;
  const MoeLayerRef fused = ref_moe_layer(data.inputs(c, DType::kBF16, true));
  ASSERT_EQ(unfused.router.topk_ids, exact.router.topk_ids);  // logits are never rounded
  for (const MoeLayerRef* r : {&unfused, &fused}) {
    EXPECT_TRUE(on_grid(r->y, DType::kBF16));
    EXPECT_TRUE(on_grid(r->dx, DType::kBF16));
    EXPECT_TRUE(on_grid(r->d_logits, DType::kBF16));
  }
  EXPECT_FALSE(on_grid(exact.y, DType::kBF16));  // the checks above can fail
  EXPECT_FALSE(on_grid(exact.dx, DType::kBF16));
  EXPECT_FALSE(on_grid(exact.d_logits, DType::kBF16));

  constexpr double kFewStorageErrors = 1e-2;  // measured: 0.0015 to 0.005
  auto expect_storage_level = [&](const char* what, const MoeLayerRef& got, const MoeLayerRef& want) {
    SCOPED_TRACE(what);
    const std::vector<std::tuple<const char*, const Mat*, const Mat*, int64_t>> outputs{
        {"y", &got.y, &want.y, h},
        {"dx", &got.dx, &want.dx, h},
        {"d_logits", &got.d_logits, &want.d_logits, E},
        {"dwr", &got.dwr, &want.dwr, h},
        {"dw1", &got.dw1, &want.dw1, h},
        {"dw2", &got.dw2, &want.dw2, f},
        {"db1", &got.db1, &want.db1, 2 * f},
        {"db2", &got.db2, &want.db2, h}};
    for (const auto& [name, a, b, cols] : outputs) {
      ASSERT_EQ(a->size(), b->size()) << name;
      EXPECT_LT(relative_error(*a, *b, cols, {}), kFewStorageErrors) << name;
    }
  };
  expect_storage_level("unfused vs exact", unfused, exact);
  expect_storage_level("fused vs exact", fused, exact);
  expect_storage_level("fused vs unfused", fused, unfused);
  EXPECT_NE(fused.y, unfused.y);  // they round different values
}
// The unfused layer is the expert-MLP reference on the dispatched rows, combined with the routing
// weights: the same stored intermediates, the same parameter gradients.
TEST(MoeLayerReference, UnfusedLayerIsTheExpertMlpOnTheDispatchedRows) {
  std::mt19937_64 rng(test_seed("MoeLayerReference.UnfusedLayerIsTheExpertMlpOnTheDispatchedRows"));
  constexpr int64_t n = 12, h = 16, f = 16;
  constexpr int E = 4, k = 2;
  constexpr DType t = DType::kBF16;
  const LayerData data = make_layer_data(rng, n, E, k, h, f, true, t);
  const LayerCase c{.name = "", .renormalize = true, .aux_coef = 0.05, .capacity_factor = 0.6, .row_align = 16,
                    .bias = true};
  const MoeLayerInputs in = data.inputs(c, t, true);
  const MoeLayerRef layer = ref_moe_layer(in);
  const DispatchRef& d = layer.dispatch;
  ASSERT_GT(d.dropped, 0);
  auto store = [](Mat m) {
    for (double& v : m) v = round_to(v, t);
    return m;
  };

  const Mat px = ref_permute(d, data.x, h);
  Mat d_rows(in.capacity_rows * h, 0.0);  // the combine backward: w_r dy[t_r], stored
  for (int64_t r = 0; r < in.capacity_rows; ++r)
    if (const int32_t token = d.token_of_row[r]; token >= 0)
      for (int64_t i = 0; i < h; ++i) d_rows[r * h + i] = round_to(d.row_weight[r] * data.dy[token * h + i], t);
  const ExpertMlpReference mlp =
      ref_expert_mlp(d.layout, {&px, &data.w1, &data.b1, &data.w2, &data.b2, &d_rows, h, f, t});
  const Mat out_rows = store(mlp.y);
  expect_same_math(layer.y, store(ref_combine(d, out_rows, layer.router.topk_weights, n, k, h)), "y");
  expect_same_math(layer.dw1, mlp.dw1, "dw1");
  expect_same_math(layer.dw2, mlp.dw2, "dw2");
  expect_same_math(layer.db1, mlp.db1, "db1");
  expect_same_math(layer.db2, mlp.db2, "db2");

  // The router's gradient: d_topk_weights[t, j] = <dy[t], stored expert output of (t, j)>.
  Mat d_topk(n * k, 0.0);
  for (int64_t i = 0; i < n * k; ++i)
    if (const int32_t row = d.row_of[i]; row >= 0)
      for (int64_t c2 = 0; c2 < h; ++c2) d_topk[i] += data.dy[(i / k) * h + c2] * out_rows[row * h + c2];
  const Mat d_logits = store(ref_router_backward(layer.router, d_topk, in.router));
  expect_same_math(layer.d_logits, d_logits, "d_logits");
  // dx = stored(d_logits W_r + stored(sum_j stored(expert input gradient of (t, j)))).
  const Mat d_perm = store(mlp.dx);
  Mat dx(n * h, 0.0);
  for (int64_t token = 0; token < n; ++token)
    for (int64_t i = 0; i < h; ++i) {
      double router = 0.0;
      for (int e = 0; e < E; ++e) router += d_logits[token * E + e] * data.wr[e * h + i];
      double experts = 0.0;
      for (int j = 0; j < k; ++j)
        if (const int32_t row = d.row_of[token * k + j]; row >= 0) experts += d_perm[row * h + i];
      dx[token * h + i] = round_to(router + round_to(experts, t), t);
    }
  expect_same_math(layer.dx, dx, "dx");
}

// The fused layer stores w_r silu(gate) up (one rounding) and scales FC2's bias by w_r; its
// combine gradient is dy itself. Restated with the operator references.
TEST(MoeLayerReference, FusedLayerRoundsTheWeightedSwiglu) {
  std::mt19937_64 rng(test_seed("MoeLayerReference.FusedLayerRoundsTheWeightedSwiglu"));
  constexpr int64_t n = 12, h = 16, f = 16;
  constexpr int k = 2;
  constexpr DType t = DType::kBF16;
  const LayerData data = make_layer_data(rng, n, 4, k, h, f, true, t);
  const LayerCase c{.name = "", .sigmoid = true, .aux_coef = 0.05, .row_align = 16, .fuse_weights = true,
                    .bias = true};
  const MoeLayerInputs in = data.inputs(c, t, true);
  const MoeLayerRef layer = ref_moe_layer(in);
  const DispatchRef& d = layer.dispatch;
  const GroupLayout& l = d.layout;
  const int64_t rows = in.capacity_rows;
  auto store = [](Mat m) {
    for (double& v : m) v = round_to(v, t);
    return m;
  };
  auto sigmoid = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };

  const Mat px = ref_permute(d, data.x, h);
  const Mat h1 = store(ref_fprop(l, px, data.w1, data.b1, {}, 2 * f, h));
  Mat a(rows * f, 0.0), dh1(rows * 2 * f, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < f; ++j) {
      const double gate = h1[r * 2 * f + j], up = h1[r * 2 * f + f + j];
      a[r * f + j] = round_to(d.row_weight[r] * (gate * sigmoid(gate) * up), t);
    }
  const Mat out = store(ref_fprop(l, a, data.w2, data.b2, d.row_weight, h, f));
  expect_same_math(layer.y, store(ref_combine(d, out, {}, n, k, h)), "y");

  Mat d_rows(rows * h, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    if (const int32_t token = d.token_of_row[r]; token >= 0)
      std::copy_n(&data.dy[token * h], h, &d_rows[r * h]);
  const Mat da = store(ref_dgrad(l, d_rows, data.w2, h, f));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < f; ++j) {
      const double gate = h1[r * 2 * f + j], up = h1[r * 2 * f + f + j], g = da[r * f + j];
      const double s = sigmoid(gate), w = d.row_weight[r];
      dh1[r * 2 * f + j] = round_to(w * (g * up * s * (1.0 + gate * (1.0 - s))), t);
      dh1[r * 2 * f + f + j] = round_to(w * (g * gate * s), t);
    }
  expect_same_math(layer.dw2, ref_wgrad(l, d_rows, a, h, f), "dw2");
  expect_same_math(layer.db2, ref_bias_grad(l, d_rows, d.row_weight, h), "db2");
  expect_same_math(layer.dw1, ref_wgrad(l, dh1, px, 2 * f, h), "dw1");
  expect_same_math(layer.db1, ref_bias_grad(l, dh1, {}, 2 * f), "db1");
}

TEST(MoeLayerReference, ForcedIdsReplaceTheOwnSelection) {
  std::mt19937_64 rng(test_seed("MoeLayerReference.ForcedIdsReplaceTheOwnSelection"));
  constexpr int E = 4, k = 2;
  const LayerData data = make_layer_data(rng, 8, E, k, 16, 16, true, DType::kBF16);
  const LayerCase c{.name = "", .aux_coef = 0.1, .bias = true};
  MoeLayerInputs in = data.inputs(c, DType::kBF16, true);
  const MoeLayerRef own = ref_moe_layer(in);

  in.forced_ids = &own.router.topk_ids;
  const MoeLayerRef same = ref_moe_layer(in);
  EXPECT_EQ(same.y, own.y);
  EXPECT_EQ(same.dx, own.dx);
  EXPECT_EQ(same.dwr, own.dwr);

  Ids other(own.router.topk_ids.size());  // distinct ids, never the reference's own top-k
  for (std::size_t t = 0; t < other.size() / k; ++t) {
    other[t * k] = (own.router.topk_ids[t * k] + 1) % E;
    other[t * k + 1] = (own.router.topk_ids[t * k] + 2) % E;
  }
  EXPECT_FALSE(check_topk_selection(own.router, other, k, 1e-9).ok);
  in.forced_ids = &other;
  const MoeLayerRef forced = ref_moe_layer(in);
  EXPECT_EQ(forced.router.topk_ids, other);
  for (std::size_t i = 0; i < other.size(); ++i) {
    EXPECT_EQ(forced.router.topk_weights[i], own.router.scores[(i / k) * E + other[i]]) << i;
    const int32_t row = forced.dispatch.row_of[i], e = other[i];
    EXPECT_GE(row, forced.dispatch.layout.offsets[e]) << i;
    EXPECT_LT(row, forced.dispatch.layout.offsets[e] + forced.dispatch.layout.splits[e]) << i;
  }
  EXPECT_NE(forced.y, own.y);
}

TEST(MoeLayerReference, ForwardOnlyLeavesGradientsEmpty) {
  std::mt19937_64 rng(test_seed("MoeLayerReference.ForwardOnlyLeavesGradientsEmpty"));
  const LayerData data = make_layer_data(rng, 8, 4, 2, 16, 16, true, DType::kBF16);
  const LayerCase c{.name = "", .bias = true};
  MoeLayerInputs in = data.inputs(c, DType::kBF16, true);
  const MoeLayerRef with_dy = ref_moe_layer(in);
  in.dy = nullptr;
  const MoeLayerRef forward = ref_moe_layer(in);
  EXPECT_EQ(forward.y, with_dy.y);
  EXPECT_TRUE(forward.dx.empty() && forward.dwr.empty() && forward.dw1.empty() && forward.db2.empty() &&
              forward.d_logits.empty());
  EXPECT_FALSE(with_dy.dx.empty());
}

}  // namespace
}  // namespace moegraph::test
