// The MoE routing kernels (kernels/routing/moe_routing.hpp) against fp64 host references
// (testing/moe_layer_reference.hpp where they fit, small loops here otherwise). Every output is
// poisoned before the launch; integer outputs must match exactly; what a launcher must not write
// (tokens past the step's count, rows past the used rows, guard rows past capacity) must still hold
// the poison afterwards. Also: invalid token counts, capacity overflow, and a captured
// dispatch -> permute -> combine replayed with new token counts and routings.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/routing/moe_routing.hpp"
#include "src/ops/group_layout.hpp"
#include "testing/device_array.hpp"
#include "testing/graph.hpp"
#include "testing/moe_layer_reference.hpp"
#include "tests/common/expect.hpp"

namespace moegraph::test {
namespace {

// ---- Helpers ------------------------------------------------------------------------------------

// launch_router_aux_loss's workspace, zeroed as its contract asks before the first launch.
DeviceArray<double> aux_loss_workspace() {
  DeviceArray<double> ws((kernels::kRouterAuxLossWorkspaceBytes + sizeof(double) - 1) / sizeof(double));
  ws.upload(std::vector<double>(ws.size(), 0.0));
  return ws;
}

constexpr int kIntPoisonByte = 0x7f;  // int32 outputs: never a valid id, row or -1
constexpr int32_t kIntPoison = 0x7f7f7f7f;
constexpr int64_t kGuardRows = 64;    // rows past capacity_rows that no launch may touch
const float kNaN = [] {
  const uint32_t bits = 0xffffffffu;  // what DeviceArray::poison writes
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}();

template <class T>
void fill_bytes(DeviceArray<T>& a, int byte) {
  testing::memset_and_wait(a.get(), byte, a.size() * sizeof(T));
}

template <class T>
std::vector<T> slice(const std::vector<T>& v, int64_t begin, int64_t end) {
  return std::vector<T>(v.begin() + begin, v.begin() + end);
}

std::vector<float> to_floats(const Mat& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<float>(v[i]);
  return out;
}

// Exact equality (floats by value: NaN never matches), reporting the first difference only.
template <class T>
::testing::AssertionResult same(const std::string& what, const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": " << got.size() << " values, expected " << want.size();
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!(got[i] == want[i]) && bad++ == 0) first = i;
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << got.size() << " differ; first at "
                                       << first << ": got " << +got[first] << ", expected " << +want[first];
}

// Every element of v[begin, end) has the bit pattern of `pattern` (still poisoned, or exactly -1 / 0).
template <class T>
::testing::AssertionResult all_bits(const std::string& what, const std::vector<T>& v, int64_t begin, int64_t end,
                                    T pattern) {
  for (int64_t i = begin; i < end; ++i)
    if (std::memcmp(&v[i], &pattern, sizeof(T)) != 0)
      return ::testing::AssertionFailure() << what << "[" << i << "] = " << +v[i] << ", expected the pattern of "
                                           << +pattern << " in [" << begin << ", " << end << ")";
  return ::testing::AssertionSuccess();
}

// Every element of v[begin, end) is zero (either sign).
::testing::AssertionResult all_zero(const std::string& what, const Mat& v, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i)
    if (v[i] != 0.0)
      return ::testing::AssertionFailure() << what << "[" << i << "] = " << v[i] << ", expected 0 in [" << begin
                                           << ", " << end << ")";
  return ::testing::AssertionSuccess();
}

DeviceArray<int32_t> device_scalar(int32_t v) {
  DeviceArray<int32_t> a(1);
  a.upload({v});
  return a;
}

DeviceArray<DeviceErrorRecord> cleared_error_record() {
  DeviceArray<DeviceErrorRecord> e(1);
  fill_bytes(e, 0);
  return e;
}

void expect_error(const DeviceErrorRecord& got, const DeviceErrorRecord& want) {
  EXPECT_EQ(got.code, want.code);
  EXPECT_EQ(got.group, want.group);
  EXPECT_EQ(got.value, want.value);
  EXPECT_EQ(got.limit, want.limit);
}

DeviceArray<uint16_t> upload16(const Mat& v, DType t) {
  DeviceArray<uint16_t> a(v.size());
  a.upload(to_device_bits(v, t));
  return a;
}

DeviceArray<float> upload_f32(const Mat& v) {
  DeviceArray<float> a(v.size());
  a.upload(to_floats(v));
  return a;
}

// Uniform in [lo, hi), rounded to fp32.
Mat random_f32(std::mt19937_64& rng, std::size_t count, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  Mat v(count);
  for (double& x : v) x = static_cast<float>(dist(rng));
  return v;
}

// k distinct experts per token, each drawn with Zipf weight 1 / (rank + 1)^zipf over a shuffled ranking.
std::vector<int32_t> random_topk_ids(std::mt19937_64& rng, int64_t tokens, int experts, int top_k, double zipf) {
  std::vector<double> weight(experts);
  for (int e = 0; e < experts; ++e) weight[e] = 1.0 / std::pow(e + 1.0, zipf);
  std::shuffle(weight.begin(), weight.end(), rng);
  std::discrete_distribution<int> pick(weight.begin(), weight.end());
  std::vector<int32_t> ids(tokens * top_k);
  for (int64_t t = 0; t < tokens; ++t)
    for (int j = 0; j < top_k; ++j) {
      int32_t e;
      do e = pick(rng);
      while (std::find(&ids[t * top_k], &ids[t * top_k + j], e) != &ids[t * top_k + j]);
      ids[t * top_k + j] = e;
    }
  return ids;
}

std::vector<int32_t> count_assignments(const std::vector<int32_t>& ids, int64_t n, int top_k, int experts) {
  std::vector<int32_t> counts(experts, 0);
  for (int64_t a = 0; a < n * top_k; ++a) ++counts[ids[a]];
  return counts;
}

// The router's output as the reference's dispatch reads it (scores are not used by dispatch).
RouterRef routed(const std::vector<int32_t>& ids, const Mat& weights, int64_t n, int experts, int top_k) {
  RouterRef r;
  r.tokens = n;
  r.scores.assign(n * experts, 0.0);
  r.topk_ids = slice(ids, 0, n * top_k);
  r.topk_weights = slice(weights, 0, n * top_k);
  r.counts = count_assignments(ids, n, top_k, experts);
  return r;
}

RouterSpec router_spec(int experts, int top_k, bool sigmoid, bool renormalize, double aux_coef = 0.0,
                       double capacity_factor = 0.0, int row_align = 1) {
  RouterSpec s;
  s.experts = experts;
  s.top_k = top_k;
  s.sigmoid = sigmoid;
  s.renormalize = renormalize;
  s.aux_coef = aux_coef;
  s.capacity_factor = capacity_factor;
  s.row_align = row_align;
  return s;
}

// Rows of the permuted buffers for any routing of max_tokens * top_k assignments.
int64_t worst_capacity(int64_t max_tokens, int experts, int top_k, int row_align) {
  const int64_t rows = max_tokens * top_k + int64_t{experts} * (row_align - 1);
  return (rows + row_align - 1) / row_align * row_align;
}

// ---- Router top-k -------------------------------------------------------------------------------

struct RouterCase {
  std::string name;
  int experts, top_k;
  bool sigmoid, renormalize;
  int64_t tokens, max_tokens;
};
void PrintTo(const RouterCase& c, std::ostream* os) { *os << c.name; }  // not a byte dump

struct RouterOutputs {
  std::vector<float> scores, weights;
  std::vector<int32_t> ids;
};

RouterOutputs run_router_topk(const Mat& logits, int32_t num_tokens, int64_t max_tokens, int experts, int top_k,
                              bool sigmoid, bool renormalize, DeviceArray<DeviceErrorRecord>& error,
                              DeviceArray<float>* scores_out = nullptr) {
  DeviceArray<float> d_logits = upload_f32(logits);
  DeviceArray<float> d_scores(max_tokens * experts), d_weights(max_tokens * top_k);
  DeviceArray<int32_t> d_ids(max_tokens * top_k);
  d_scores.poison();
  d_weights.poison();
  fill_bytes(d_ids, kIntPoisonByte);
  DeviceArray<int32_t> d_n = device_scalar(num_tokens);
  kernels::RouterTopkParams p;
  p.logits = d_logits.get();
  p.num_tokens = d_n.get();
  p.max_tokens = max_tokens;
  p.experts = experts;
  p.top_k = top_k;
  p.score = sigmoid ? RouterScore::kSigmoid : RouterScore::kSoftmax;
  p.renormalize = renormalize;
  p.scores = d_scores.get();
  p.topk_ids = d_ids.get();
  p.topk_weights = d_weights.get();
  p.error = error.get();
  kernels::launch_router_topk(p, nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  RouterOutputs out{d_scores.download(), d_weights.download(), d_ids.download()};
  if (scores_out != nullptr) *scores_out = std::move(d_scores);
  return out;
}

class MoeRouterTopk : public ::testing::TestWithParam<RouterCase> {};

TEST_P(MoeRouterTopk, MatchesReference) {
  const RouterCase& c = GetParam();
  std::mt19937_64 rng(test_seed("moe_router_topk_" + c.name));
  const int E = c.experts, K = c.top_k;
  const int64_t n = c.tokens, max = c.max_tokens;
  const Mat logits = random_values(rng, max * E, 4.0, DType::kFP32);
  auto error = cleared_error_record();
  DeviceArray<float> d_scores;
  const RouterOutputs got = run_router_topk(logits, static_cast<int32_t>(n), max, E, K, c.sigmoid, c.renormalize,
                                            error, &d_scores);
  EXPECT_EQ(error.download()[0].code, 0);

  const RouterSpec spec = router_spec(E, K, c.sigmoid, c.renormalize, 0.01);
  const Mat logits_n = slice(logits, 0, n * E);
  const RouterRef own = ref_router_forward(logits_n, n, spec);
  const std::vector<int32_t> ids_n = slice(got.ids, 0, n * K);
  ASSERT_TRUE(passed(check_topk_selection(own, ids_n, K, 1e-6)));
  // Where the reference's top k + 1 scores are clearly apart, the ids must be exactly its ids.
  int64_t clear_tokens = 0, differing = 0;
  for (int64_t t = 0; t < n; ++t) {
    std::vector<double> s(own.scores.begin() + t * E, own.scores.begin() + (t + 1) * E);
    const int top = std::min(K + 1, E);
    std::partial_sort(s.begin(), s.begin() + top, s.end(), std::greater<>());
    bool clear = true;
    for (int i = 1; i < top; ++i) clear = clear && s[i - 1] - s[i] > 1e-6;
    if (!clear) continue;
    ++clear_tokens;
    if (!std::equal(ids_n.begin() + t * K, ids_n.begin() + (t + 1) * K, own.topk_ids.begin() + t * K)) ++differing;
  }
  EXPECT_EQ(differing, 0) << "of " << clear_tokens << " tokens without near-ties";
  if (n > 0) {
    EXPECT_GT(clear_tokens, n / 2) << "the exact-id check must cover most tokens";
  }

  const RouterRef forced = ref_router_forward(logits_n, n, spec, &ids_n);
  const Tolerance fp32 = tolerance_for(DType::kFP32);
  EXPECT_TRUE(passed(all_close("scores", to_doubles(slice(got.scores, 0, n * E)), forced.scores, E, {}, fp32)));
  EXPECT_TRUE(
      passed(all_close("topk_weights", to_doubles(slice(got.weights, 0, n * K)), forced.topk_weights, K, {}, fp32)));
  EXPECT_TRUE(all_bits("scores past n", got.scores, n * E, max * E, kNaN));
  EXPECT_TRUE(all_bits("topk_ids past n", got.ids, n * K, max * K, kIntPoison));
  EXPECT_TRUE(all_bits("topk_weights past n", got.weights, n * K, max * K, kNaN));

  // The aux loss of these scores (rows past n are still NaN: it must not read them) and counts.
  DeviceArray<int32_t> d_counts(E), d_n = device_scalar(static_cast<int32_t>(n));
  d_counts.upload(forced.counts);
  DeviceArray<float> d_aux(1);
  d_aux.poison();
  DeviceArray<double> aux_ws = aux_loss_workspace();
  kernels::launch_router_aux_loss(d_scores.get(), d_counts.get(), d_n.get(), max, E, K,
                                  static_cast<float>(spec.aux_coef), d_aux.get(), aux_ws.get(), nullptr);
  const double aux = d_aux.download()[0];
  EXPECT_NEAR(aux, forced.aux_loss, 1e-5 * std::fabs(forced.aux_loss)) << "aux loss";
}

std::vector<RouterCase> router_cases() {
  return {
      {"e8_k1_softmax", 8, 1, false, false, 1000, 1000},
      {"e8_k8_softmax_renorm", 8, 8, false, true, 777, 1000},
      {"e64_k8_softmax_renorm", 64, 8, false, true, 2000, 2048},
      {"e64_k2_sigmoid", 64, 2, true, false, 1500, 1500},
      {"e64_k1_sigmoid_renorm_n1", 64, 1, true, true, 1, 64},
      {"e160_k6_softmax_renorm", 160, 6, false, true, 999, 1024},
      {"e1024_k8_sigmoid_renorm", 1024, 8, true, true, 300, 512},
      {"e1024_k8_softmax", 1024, 8, false, false, 512, 512},
      {"e64_k8_n0", 64, 8, false, true, 0, 128},
  };
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeRouterTopk, ::testing::ValuesIn(router_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(MoeRouterTopkTies, EqualScoresGoToTheLowerId) {
  constexpr int E = 64, K = 8, kTokens = 4;  // two experts per lane: ties across lanes and registers
  Mat logits(kTokens * E, 0.0);              // token 0: all equal
  std::vector<int32_t> expected = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int e = 0; e < E; ++e) logits[1 * E + e] = -1.0;
  for (int e : {50, 3, 17, 9, 40}) logits[1 * E + e] = 1.0;
  logits[1 * E + 60] = 1.5;
  expected.insert(expected.end(), {60, 3, 9, 17, 40, 50, 0, 1});
  for (int e = 0; e < E; ++e) logits[2 * E + e] = e % 4 == 1 ? 0.5 : 0.0;
  expected.insert(expected.end(), {1, 5, 9, 13, 17, 21, 25, 29});
  for (int e = 0; e < E; ++e) logits[3 * E + e] = e >= 32 ? 0.25 : 0.0;
  expected.insert(expected.end(), {32, 33, 34, 35, 36, 37, 38, 39});
  for (bool sigmoid : {false, true}) {
    auto error = cleared_error_record();
    const RouterOutputs got = run_router_topk(logits, kTokens, kTokens, E, K, sigmoid, true, error);
    EXPECT_TRUE(same(sigmoid ? "sigmoid ids" : "softmax ids", got.ids, expected));
    EXPECT_EQ(got.weights[0], 1.0f / K) << "equal scores renormalize to 1 / k";
  }
}

TEST(MoeRouterTopkTokenCount, InvalidCountIsRecordedAndClamped) {
  std::mt19937_64 rng(test_seed("moe_router_token_count"));
  constexpr int E = 16, K = 2;
  constexpr int64_t kMax = 100;
  const Mat logits = random_values(rng, kMax * E, 2.0, DType::kFP32);
  {  // negative: recorded, nothing routed
    auto error = cleared_error_record();
    const RouterOutputs got = run_router_topk(logits, -3, kMax, E, K, false, false, error);
    expect_error(error.download()[0], {kDeviceErrorTokenCount, -1, -3, kMax});
    EXPECT_TRUE(all_bits("scores", got.scores, 0, kMax * E, kNaN));
    EXPECT_TRUE(all_bits("topk_ids", got.ids, 0, kMax * K, kIntPoison));
  }
  {  // past the bucket: recorded, clamped to max_tokens
    auto error = cleared_error_record();
    const RouterOutputs got = run_router_topk(logits, kMax + 5, kMax, E, K, false, false, error);
    expect_error(error.download()[0], {kDeviceErrorTokenCount, -1, kMax + 5, kMax});
    const RouterRef ref = ref_router_forward(logits, kMax, router_spec(E, K, false, false));
    EXPECT_TRUE(passed(check_topk_selection(ref, got.ids, K, 1e-6)));
  }
  {  // an earlier error is never overwritten
    auto error = cleared_error_record();
    const DeviceErrorRecord earlier{1, 5, -7, 0};
    error.upload({earlier});
    run_router_topk(logits, -3, kMax, E, K, false, false, error);
    expect_error(error.download()[0], earlier);
  }
}

// ---- Aux loss -----------------------------------------------------------------------------------

struct AuxCase {
  std::string name;
  int experts, top_k;
  int64_t tokens, max_tokens;
};
void PrintTo(const AuxCase& c, std::ostream* os) { *os << c.name; }  // not a byte dump

class MoeRouterAuxLoss : public ::testing::TestWithParam<AuxCase> {};

// Two launches of case c on `ws` against fp64, bit-identical to each other. The second finds the
// workspace as the first left it (its ticket back at zero): a ticket left counting would make no
// block the last, and the poisoned output would stay.
void check_aux_loss(const AuxCase& c, DeviceArray<double>& ws) {
  SCOPED_TRACE(c.name);
  std::mt19937_64 rng(test_seed("moe_router_aux_" + c.name));
  const int E = c.experts, K = c.top_k;
  const int64_t n = c.tokens, max = c.max_tokens;
  Mat scores = random_f32(rng, max * E, 0.0, 1.0);
  std::fill(scores.begin() + n * E, scores.end(), std::nan(""));  // never read
  std::vector<int32_t> counts(E);
  std::uniform_int_distribution<int32_t> count_dist(0, static_cast<int32_t>(3 * n + 1));
  for (int32_t& v : counts) v = count_dist(rng);
  const float coef = 0.01f;
  double expected = 0.0;
  if (n > 0) {
    double sum = 0.0;
    for (int e = 0; e < E; ++e) {
      double column = 0.0;
      for (int64_t t = 0; t < n; ++t) column += scores[t * E + e];
      sum += counts[e] * column;
    }
    expected = static_cast<double>(coef) * E / (K * static_cast<double>(n) * n) * sum;
  }
  DeviceArray<float> d_scores = upload_f32(scores), d_aux(2);
  DeviceArray<int32_t> d_counts(E), d_n = device_scalar(static_cast<int32_t>(n));
  d_counts.upload(counts);
  d_aux.poison();
  for (int run = 0; run < 2; ++run)
    kernels::launch_router_aux_loss(d_scores.get(), d_counts.get(), d_n.get(), max, E, K, coef, d_aux.get() + run,
                                    ws.get(), nullptr);
  const std::vector<float> got = d_aux.download();
  EXPECT_NEAR(got[0], expected, 1e-6 * std::fabs(expected));
  EXPECT_TRUE(all_bits("second run", got, 1, 2, got[0])) << "bit-identical run to run";
  if (n == 0) {
    EXPECT_EQ(got[0], 0.0f);
  }
}

TEST_P(MoeRouterAuxLoss, MatchesReferenceAndIsDeterministic) {
  DeviceArray<double> ws = aux_loss_workspace();
  check_aux_loss(GetParam(), ws);
}

// One workspace for launches whose grids differ (256 blocks, 2, 1, then 256 again), as a layer's
// buckets of different sizes would if they shared one: each finds the ticket at zero.
TEST(MoeRouterAuxLossWorkspace, ServesLaunchesOfEveryGridInTurn) {
  DeviceArray<double> ws = aux_loss_workspace();
  const AuxCase cases[] = {{"e160_k4_many_tokens", 160, 4, 70000, 70000},
                           {"e6_k2_scalar", 6, 2, 1000, 1000},
                           {"e64_k8_one_token", 64, 8, 1, 1},
                           {"e160_k4_again", 160, 4, 60000, 70000}};
  for (const AuxCase& c : cases) check_aux_loss(c, ws);
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeRouterAuxLoss,
                         ::testing::Values(AuxCase{"e64_k8_vec4", 64, 8, 1500, 2048},
                                           AuxCase{"e6_k2_scalar", 6, 2, 1000, 1000},
                                           AuxCase{"e1024_k8", 1024, 8, 3000, 3000},
                                           AuxCase{"e160_k4_many_tokens", 160, 4, 70000, 70000},
                                           AuxCase{"e64_k8_n0", 64, 8, 0, 256}),
                         [](const auto& info) { return info.param.name; });

// ---- Router backward ----------------------------------------------------------------------------

struct RouterBackwardCase {
  std::string name;
  int experts, top_k;
  bool sigmoid, renormalize, aux;
  int64_t tokens, max_tokens;
  DType dtype;
};
void PrintTo(const RouterBackwardCase& c, std::ostream* os) { *os << c.name; }  // not a byte dump

class MoeRouterBackward : public ::testing::TestWithParam<RouterBackwardCase> {};

TEST_P(MoeRouterBackward, MatchesReference) {
  const RouterBackwardCase& c = GetParam();
  std::mt19937_64 rng(test_seed("moe_router_backward_" + c.name));
  const int E = c.experts, K = c.top_k;
  const int64_t n = c.tokens, max = c.max_tokens;
  // A coefficient that makes the aux gradient (about coef / n) as large as the routing one.
  const double aux_coef = c.aux ? 0.5 * static_cast<double>(std::max<int64_t>(n, 1)) : 0.0;
  const RouterSpec spec = router_spec(E, K, c.sigmoid, c.renormalize, aux_coef);
  RouterRef r = ref_router_forward(random_values(rng, n * E, 3.0, DType::kFP32), n, spec);
  for (double& s : r.scores) s = static_cast<float>(s);  // what the device saved
  for (double& w : r.topk_weights) w = static_cast<float>(w);
  const Mat d_tw = random_values(rng, n * K, 1.0, DType::kFP32);

  // Rows past n hold NaN / invalid ids: reading them would show.
  auto padded = [&](const Mat& v, int64_t width) {
    Mat out(max * width, std::nan(""));
    std::copy(v.begin(), v.end(), out.begin());
    return out;
  };
  DeviceArray<float> d_scores = upload_f32(padded(r.scores, E)), d_weights = upload_f32(padded(r.topk_weights, K)),
                     d_dw = upload_f32(padded(d_tw, K));
  std::vector<int32_t> ids(max * K, kIntPoison);
  std::copy(r.topk_ids.begin(), r.topk_ids.end(), ids.begin());
  DeviceArray<int32_t> d_ids(max * K), d_counts(E), d_n = device_scalar(static_cast<int32_t>(n));
  d_ids.upload(ids);
  d_counts.upload(r.counts);
  const std::size_t elem = dtype_size(c.dtype);
  DeviceArray<unsigned char> d_logits(max * E * elem);
  fill_bytes(d_logits, 0xff);

  kernels::RouterBackwardParams p;
  p.scores = d_scores.get();
  p.topk_ids = d_ids.get();
  p.topk_weights = d_weights.get();
  p.d_topk_weights = d_dw.get();
  p.counts = d_counts.get();
  p.num_tokens = d_n.get();
  p.max_tokens = max;
  p.experts = E;
  p.top_k = K;
  p.score = c.sigmoid ? RouterScore::kSigmoid : RouterScore::kSoftmax;
  p.renormalize = c.renormalize;
  p.aux_coef = static_cast<float>(aux_coef);
  p.dtype = c.dtype;
  p.d_logits = d_logits.get();
  kernels::launch_router_backward(p, nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());

  const std::vector<unsigned char> bytes = d_logits.download();
  Mat got(max * E);
  for (int64_t i = 0; i < max * E; ++i) {
    if (c.dtype == DType::kFP32) {
      float f;
      std::memcpy(&f, &bytes[i * 4], 4);
      got[i] = f;
    } else {
      uint16_t b;
      std::memcpy(&b, &bytes[i * 2], 2);
      got[i] = from_bits(b, c.dtype);
    }
  }
  r.tokens = n;
  const Mat expected = ref_router_backward(r, d_tw, spec);
  EXPECT_TRUE(passed(all_close("d_logits", slice(got, 0, n * E), expected, E, {}, tolerance_for(c.dtype))));
  EXPECT_TRUE(all_zero("d_logits past n", got, n * E, max * E));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MoeRouterBackward,
    ::testing::Values(RouterBackwardCase{"e8_k2_softmax_bf16", 8, 2, false, false, false, 1000, 1000, DType::kBF16},
                      RouterBackwardCase{"e64_k8_softmax_renorm_aux_bf16", 64, 8, false, true, true, 1700, 2048,
                                         DType::kBF16},
                      RouterBackwardCase{"e64_k1_sigmoid_fp16", 64, 1, true, false, false, 900, 1000, DType::kFP16},
                      RouterBackwardCase{"e160_k6_softmax_renorm_fp16", 160, 6, false, true, false, 500, 512,
                                         DType::kFP16},
                      RouterBackwardCase{"e1024_k8_sigmoid_renorm_aux_bf16", 1024, 8, true, true, true, 300, 384,
                                         DType::kBF16},
                      RouterBackwardCase{"e1024_k8_softmax_aux_fp32", 1024, 8, false, false, true, 256, 256,
                                         DType::kFP32},
                      RouterBackwardCase{"e64_k8_n0_bf16", 64, 8, false, true, true, 0, 128, DType::kBF16}),
    [](const auto& info) { return info.param.name; });

// ---- Dispatch -----------------------------------------------------------------------------------

// The device side of one dispatch: inputs and poisoned outputs, kGuardRows past capacity_rows.
struct DispatchBuffers {
  DispatchBuffers(int64_t max_tokens, int experts, int top_k, int64_t capacity_rows)
      : max_tokens(max_tokens), experts(experts), top_k(top_k), capacity_rows(capacity_rows),
        ids(max_tokens * top_k), weights(max_tokens * top_k), n(1), counts(experts), splits(experts),
        offsets(experts + 1), row_of(max_tokens * top_k), token_of_row(capacity_rows + kGuardRows),
        row_weight(capacity_rows + kGuardRows), dropped(1), error(1),
        workspace(std::max<std::size_t>(1, kernels::dispatch_workspace_bytes(max_tokens, experts, top_k) / 4)) {}

  void upload(int32_t num_tokens, const std::vector<int32_t>& topk_ids, const Mat& topk_weights) {
    n.upload({num_tokens});
    ids.upload(topk_ids);
    weights.upload(to_floats(topk_weights));
  }
  // Outputs (and the workspace: the kernels may not depend on its contents) poisoned, counters set.
  void poison(unsigned long long dropped_before = 7) {
    for (auto* a : {&counts, &splits, &row_of, &token_of_row, &workspace}) fill_bytes(*a, kIntPoisonByte);
    fill_bytes(offsets, kIntPoisonByte);
    row_weight.poison();
    dropped.upload({dropped_before});
    fill_bytes(error, 0);
  }
  kernels::DispatchParams params(int row_align, double capacity_factor) const {
    kernels::DispatchParams p;
    p.topk_ids = ids.get();
    p.topk_weights = weights.get();
    p.num_tokens = n.get();
    p.max_tokens = max_tokens;
    p.experts = experts;
    p.top_k = top_k;
    p.row_align = row_align;
    p.capacity_rows = capacity_rows;
    p.capacity_factor = capacity_factor;
    p.counts = counts.get();
    p.splits = splits.get();
    p.offsets = offsets.get();
    p.row_of = row_of.get();
    p.token_of_row = token_of_row.get();
    p.row_weight = row_weight.get();
    p.dropped = dropped.get();
    p.workspace = workspace.get();
    p.error = error.get();
    return p;
  }

  int64_t max_tokens;
  int experts, top_k;
  int64_t capacity_rows;
  DeviceArray<int32_t> ids;
  DeviceArray<float> weights;
  DeviceArray<int32_t> n, counts, splits;
  DeviceArray<int64_t> offsets;
  DeviceArray<int32_t> row_of, token_of_row;
  DeviceArray<float> row_weight;
  DeviceArray<unsigned long long> dropped;
  DeviceArray<DeviceErrorRecord> error;
  DeviceArray<int32_t> workspace;
};

struct DispatchResult {
  explicit DispatchResult(const DispatchBuffers& b)
      : counts(b.counts.download()), splits(b.splits.download()), offsets(b.offsets.download()),
        row_of(b.row_of.download()), token_of_row(b.token_of_row.download()), row_weight(b.row_weight.download()),
        dropped(b.dropped.download()[0]), error(b.error.download()[0]) {}
  std::vector<int32_t> counts, splits;
  std::vector<int64_t> offsets;
  std::vector<int32_t> row_of, token_of_row;
  std::vector<float> row_weight;
  unsigned long long dropped;
  DeviceErrorRecord error;
};

void expect_dispatch_matches(const DispatchResult& got, const DispatchRef& ref, const std::vector<int32_t>& counts,
                             int64_t n, int top_k, int64_t max_tokens, int64_t capacity_rows,
                             unsigned long long dropped_before) {
  EXPECT_EQ(got.error.code, 0);
  EXPECT_TRUE(same("counts", got.counts, counts));
  EXPECT_TRUE(same("splits", got.splits, ref.layout.splits));
  EXPECT_TRUE(same("offsets", got.offsets, ref.layout.offsets));
  EXPECT_TRUE(same("row_of", slice(got.row_of, 0, n * top_k), ref.row_of));
  EXPECT_TRUE(all_bits("row_of past n (-1)", got.row_of, n * top_k, max_tokens * top_k, -1));
  const int64_t used = ref.layout.offsets.back();
  EXPECT_TRUE(same("token_of_row", slice(got.token_of_row, 0, used), slice(ref.token_of_row, 0, used)));
  EXPECT_TRUE(all_bits("token_of_row past the used rows", got.token_of_row, used, capacity_rows + kGuardRows,
                       kIntPoison));
  EXPECT_TRUE(same("row_weight", slice(got.row_weight, 0, used), to_floats(slice(ref.row_weight, 0, used))));
  EXPECT_TRUE(all_bits("row_weight past the used rows", got.row_weight, used, capacity_rows + kGuardRows, kNaN));
  EXPECT_EQ(got.dropped, dropped_before + static_cast<unsigned long long>(ref.dropped));
}

struct DispatchCase {
  std::string name;
  int experts, top_k;
  int64_t tokens, max_tokens;
  int row_align;
  double capacity_factor, zipf;
};
void PrintTo(const DispatchCase& c, std::ostream* os) { *os << c.name; }  // not a byte dump

class MoeDispatch : public ::testing::TestWithParam<DispatchCase> {};

TEST_P(MoeDispatch, MatchesReferenceAndIsDeterministic) {
  const DispatchCase& c = GetParam();
  std::mt19937_64 rng(test_seed("moe_dispatch_" + c.name));
  const int E = c.experts, K = c.top_k;
  const int64_t n = c.tokens, max = c.max_tokens;
  // Tokens past n get valid ids too: counting them would change every output.
  const std::vector<int32_t> ids = random_topk_ids(rng, max, E, K, c.zipf);
  const Mat weights = random_f32(rng, max * K, 0.05, 1.0);
  const int64_t capacity = worst_capacity(max, E, K, c.row_align);
  DispatchBuffers b(max, E, K, capacity);
  b.upload(static_cast<int32_t>(n), ids, weights);
  b.poison();
  kernels::launch_dispatch(b.params(c.row_align, c.capacity_factor), nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  const DispatchResult first(b);

  const RouterRef r = routed(ids, weights, n, E, K);
  const DispatchRef ref = ref_dispatch(r, router_spec(E, K, false, false, 0.0, c.capacity_factor, c.row_align),
                                       capacity);
  expect_dispatch_matches(first, ref, r.counts, n, K, max, capacity, 7);
  if (c.capacity_factor > 0.0 && c.capacity_factor < 1.0 && n > 1) {
    EXPECT_GT(ref.dropped, 0) << "case covers drops";
  }
  if (c.row_align > 1 && n > 1) {
    EXPECT_NE(ref.layout.offsets.back(), n * K - ref.dropped) << "case covers alignment gaps";
  }

  b.poison();
  kernels::launch_dispatch(b.params(c.row_align, c.capacity_factor), nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  const DispatchResult second(b);
  EXPECT_TRUE(same("rerun row_of", second.row_of, first.row_of));
  EXPECT_TRUE(same("rerun token_of_row", second.token_of_row, first.token_of_row));
  EXPECT_TRUE(same("rerun offsets", second.offsets, first.offsets));
}

std::vector<DispatchCase> dispatch_cases() {
  return {
      {"e8_k1_align1", 8, 1, 1000, 1000, 1, 0.0, 0.0},
      {"e8_k2_align32_cf05", 8, 2, 900, 1000, 32, 0.5, 1.2},
      {"e64_k8_align1", 64, 8, 3000, 3000, 1, 0.0, 1.2},
      {"e64_k8_align32_cf05", 64, 8, 2500, 3000, 32, 0.5, 1.2},
      {"e64_k8_align16_cf125", 64, 8, 2500, 3000, 16, 1.25, 1.2},
      {"e16_k4_cf01", 16, 4, 2000, 2000, 1, 0.1, 1.2},
      {"e1024_k8_align32", 1024, 8, 4000, 4096, 32, 0.0, 1.2},
      {"e1024_k8_align1_cf05", 1024, 8, 4096, 4096, 1, 0.5, 0.0},
      {"e128_k8_align16_large", 128, 8, 69000, 70000, 16, 0.0, 1.2},  // chunks larger than the minimum
      {"e128_k8_align128_large_cf1", 128, 8, 70000, 70000, 128, 1.0, 1.2},
      {"e64_k8_align32_n0", 64, 8, 0, 512, 32, 0.0, 1.2},
      {"e64_k8_align32_cf05_n1", 64, 8, 1, 512, 32, 0.5, 1.2},
      // Capacities of at most 1024 assignments take the one-block path (e8_k1 above too); the
      // other cases take the three kernels.
      {"e1024_k8_align32_small", 1024, 8, 100, 128, 32, 0.0, 1.2},
      {"e128_k6_align16_cf05_small", 128, 6, 150, 170, 16, 0.5, 1.2},
      {"e64_k8_align32_n1_small", 64, 8, 1, 64, 32, 0.0, 1.2},
      {"e8_k2_n0_small", 8, 2, 0, 16, 1, 0.0, 0.0},
      {"e64_k8_just_past_small", 64, 8, 129, 129, 1, 0.0, 1.2},
  };
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeDispatch, ::testing::ValuesIn(dispatch_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(MoeDispatchErrors, RowsPastCapacityAreRecordedAndClamped) {
  // 500 tokens: the one-block path; 1500: the three kernels.
  for (const int64_t kTokens : {500, 1500}) {
    SCOPED_TRACE(detail::concat(kTokens, " tokens"));
    std::mt19937_64 rng(test_seed("moe_dispatch_overflow"));
    constexpr int E = 16, K = 2, kAlign = 32;
    constexpr int64_t kCapacity = 256;  // the assignments need ~2 x tokens + padding rows
    const std::vector<int32_t> ids = random_topk_ids(rng, kTokens, E, K, 1.2);
    const Mat weights = random_f32(rng, kTokens * K, 0.05, 1.0);
    DispatchBuffers b(kTokens, E, K, kCapacity);
    b.upload(kTokens, ids, weights);
    b.poison();
    kernels::launch_dispatch(b.params(kAlign, 0.0), nullptr);
    MG_CUDA_CHECK(cudaDeviceSynchronize());
    const DispatchResult got(b);

    const std::vector<int32_t> counts = count_assignments(ids, kTokens, K, E);
    const HostOffsets host = host_group_offsets(counts, kAlign, kCapacity);
    ASSERT_EQ(host.error.code, 2);
    expect_error(got.error, host.error);
    EXPECT_TRUE(same("counts", got.counts, counts));
    EXPECT_TRUE(same("splits", got.splits, counts));
    EXPECT_TRUE(same("offsets (clamped)", got.offsets, host.offsets));
    // Every placed assignment lies inside its expert's clamped span, at most once per row.
    std::vector<int> placed(E, 0), row_users(kCapacity, 0);
    for (int64_t a = 0; a < kTokens * K; ++a) {
      const int32_t row = got.row_of[a];
      if (row == -1) continue;
      const int e = ids[a];
      ASSERT_TRUE(row >= host.offsets[e] && row < host.offsets[e + 1]) << "row " << row << " of expert " << e;
      ++placed[e];
      ++row_users[row];
      EXPECT_EQ(got.token_of_row[row], a / K);
    }
    for (int e = 0; e < E; ++e)
      EXPECT_EQ(placed[e], std::min<int64_t>(counts[e], host.offsets[e + 1] - host.offsets[e])) << "expert " << e;
    EXPECT_EQ(*std::max_element(row_users.begin(), row_users.end()), 1);
    EXPECT_TRUE(all_bits("token_of_row guard", got.token_of_row, kCapacity, kCapacity + kGuardRows, kIntPoison));
    EXPECT_TRUE(all_bits("row_weight guard", got.row_weight, kCapacity, kCapacity + kGuardRows, kNaN));
  }
}

TEST(MoeDispatchErrors, InvalidTokenCountIsRecordedAndClamped) {
  // 200 tokens: the one-block path; 900: the three kernels.
  for (const int64_t kMax : {200, 900}) {
    SCOPED_TRACE(detail::concat(kMax, " tokens at most"));
    std::mt19937_64 rng(test_seed("moe_dispatch_token_count"));
    constexpr int E = 32, K = 4, kAlign = 16;
    const std::vector<int32_t> ids = random_topk_ids(rng, kMax, E, K, 1.2);
    const Mat weights = random_f32(rng, kMax * K, 0.05, 1.0);
    const int64_t capacity = worst_capacity(kMax, E, K, kAlign);
    DispatchBuffers b(kMax, E, K, capacity);
    const RouterSpec spec = router_spec(E, K, false, false, 0.0, 0.0, kAlign);
    for (int32_t bad : {-2, static_cast<int32_t>(kMax + 50)}) {
      SCOPED_TRACE(detail::concat("num_tokens ", bad));
      b.upload(bad, ids, weights);
      b.poison();
      kernels::launch_dispatch(b.params(kAlign, 0.0), nullptr);
      MG_CUDA_CHECK(cudaDeviceSynchronize());
      DispatchResult got(b);
      expect_error(got.error, {kDeviceErrorTokenCount, -1, bad, kMax});
      got.error.code = 0;
      const int64_t n = bad < 0 ? 0 : kMax;  // clamped
      const RouterRef r = routed(ids, weights, n, E, K);
      expect_dispatch_matches(got, ref_dispatch(r, spec, capacity), r.counts, n, K, kMax, capacity, 7);
    }
    // An earlier error is never overwritten.
    b.upload(-2, ids, weights);
    b.poison();
    const DeviceErrorRecord earlier{2, 3, 999, 10};
    b.error.upload({earlier});
    kernels::launch_dispatch(b.params(kAlign, 0.0), nullptr);
    MG_CUDA_CHECK(cudaDeviceSynchronize());
    expect_error(b.error.download()[0], earlier);
  }
}

// ---- Row kernels: permute, combine, their backward ----------------------------------------------

struct RowsCase {
  std::string name;
  DType dtype;
  int64_t hidden;
  int experts, top_k;
  int64_t tokens, max_tokens;
  int row_align;
  double capacity_factor;
};
void PrintTo(const RowsCase& c, std::ostream* os) { *os << c.name; }  // not a byte dump

// A routing and its dispatch plan (from the reference), on the device as launch_dispatch leaves it,
// except that row_of of tokens past n holds a valid row (0): kernels must not read it.
struct Routed {
  Routed(std::mt19937_64& rng, const RowsCase& c)
      : n(c.tokens), max(c.max_tokens), experts(c.experts), top_k(c.top_k),
        capacity(worst_capacity(c.max_tokens, c.experts, c.top_k, c.row_align)) {
    const std::vector<int32_t> ids = random_topk_ids(rng, max, experts, top_k, 1.2);
    weights = random_f32(rng, max * top_k, 0.05, 1.0);
    plan = ref_dispatch(routed(ids, weights, n, experts, top_k),
                        router_spec(experts, top_k, false, false, 0.0, c.capacity_factor, c.row_align), capacity);
    used = plan.layout.offsets.back();
    std::vector<int32_t> row_of(max * top_k, 0);
    std::copy(plan.row_of.begin(), plan.row_of.end(), row_of.begin());
    d_row_of = DeviceArray<int32_t>(row_of.size());
    d_row_of.upload(row_of);
    d_token_of_row = DeviceArray<int32_t>(capacity);
    d_token_of_row.upload(plan.token_of_row);
    d_splits = DeviceArray<int32_t>(experts);
    d_splits.upload(plan.layout.splits);
    d_offsets = DeviceArray<int64_t>(experts + 1);
    d_offsets.upload(plan.layout.offsets);
    d_weights = upload_f32(weights);
    d_n = device_scalar(static_cast<int32_t>(n));
  }
  bool is_data_row(int64_t r) const {
    const auto& o = plan.layout.offsets;
    const int e = static_cast<int>(std::upper_bound(o.begin(), o.end(), r) - o.begin()) - 1;
    return e < experts && r - o[e] < plan.layout.splits[e];
  }
  // Gap rows given a valid token and a non-zero weight: kernels must find gaps from splits/offsets.
  void disguise_gap_rows(Mat& row_weight) {
    std::vector<int32_t> token_of_row = plan.token_of_row;
    for (int64_t r = 0; r < used; ++r)
      if (!is_data_row(r)) token_of_row[r] = 0, row_weight[r] = 0.5;
    d_token_of_row.upload(token_of_row);
  }

  int64_t n, max;
  int experts, top_k;
  int64_t capacity, used = 0;
  Mat weights;
  DispatchRef plan;
  DeviceArray<int32_t> d_row_of, d_token_of_row, d_splits, d_n;
  DeviceArray<int64_t> d_offsets;
  DeviceArray<float> d_weights;
};

class MoeRowKernels : public ::testing::TestWithParam<RowsCase> {};

TEST_P(MoeRowKernels, PermuteRows) {
  const RowsCase& c = GetParam();
  std::mt19937_64 rng(test_seed("moe_permute_" + c.name));
  Routed rt(rng, c);
  Mat unused(rt.capacity, 0.0);
  rt.disguise_gap_rows(unused);
  const Mat x = random_values(rng, rt.max * c.hidden, 1.0, c.dtype);
  DeviceArray<uint16_t> d_x = upload16(x, c.dtype), d_out(rt.capacity * c.hidden);
  d_out.poison();
  kernels::launch_permute_rows(c.dtype, d_x.get(), rt.d_token_of_row.get(), rt.d_splits.get(), rt.d_offsets.get(),
                               c.experts, c.hidden, d_out.get(), nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> out = d_out.download();
  const Mat expected = ref_permute(rt.plan, slice(x, 0, rt.n * c.hidden), c.hidden);
  EXPECT_TRUE(same("permuted", from_bits16(slice(out, 0, rt.used * c.hidden), c.dtype),
                   slice(expected, 0, rt.used * c.hidden)));
  EXPECT_TRUE(all_bits<uint16_t>("permuted past the used rows", out, rt.used * c.hidden, rt.capacity * c.hidden,
                                 0xffff));
}

TEST_P(MoeRowKernels, Combine) {
  const RowsCase& c = GetParam();
  std::mt19937_64 rng(test_seed("moe_combine_" + c.name));
  Routed rt(rng, c);
  const Mat rows = random_values(rng, rt.capacity * c.hidden, 1.0, c.dtype);  // gap and padding rows too
  DeviceArray<uint16_t> d_rows = upload16(rows, c.dtype), d_y(rt.max * c.hidden);
  for (bool weighted : {true, false}) {
    SCOPED_TRACE(weighted ? "weighted" : "unweighted");
    d_y.poison();
    kernels::launch_combine(c.dtype, d_rows.get(), rt.d_row_of.get(), weighted ? rt.d_weights.get() : nullptr,
                            rt.d_n.get(), rt.max, c.top_k, c.hidden, d_y.get(), nullptr);
    MG_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> y = d_y.download();
    const Mat got = from_bits16(slice(y, 0, rt.n * c.hidden), c.dtype);
    const Mat expected =
        ref_combine(rt.plan, rows, weighted ? slice(rt.weights, 0, rt.n * c.top_k) : Mat{}, rt.n, c.top_k, c.hidden);
    EXPECT_TRUE(passed(all_close("y", got, expected, c.hidden, {}, tolerance_for(c.dtype))));
    for (int64_t t = 0; t < rt.n; ++t) {  // tokens whose assignments were all dropped: exact zeros
      bool any = false;
      for (int j = 0; j < c.top_k; ++j) any = any || rt.plan.row_of[t * c.top_k + j] >= 0;
      if (!any) {
        EXPECT_TRUE(all_zero("y of a fully dropped token", got, t * c.hidden, (t + 1) * c.hidden));
      }
    }
    EXPECT_TRUE(all_bits<uint16_t>("y past n", y, rt.n * c.hidden, rt.max * c.hidden, 0xffff));
  }
}

TEST_P(MoeRowKernels, CombineBackward) {
  const RowsCase& c = GetParam();
  std::mt19937_64 rng(test_seed("moe_combine_backward_" + c.name));
  Routed rt(rng, c);
  const int64_t h = c.hidden;
  Mat row_weight = rt.plan.row_weight;
  rt.disguise_gap_rows(row_weight);
  const Mat dy = random_values(rng, rt.max * h, 1.0, c.dtype);
  const Mat rows = random_values(rng, rt.capacity * h, 1.0, c.dtype);
  DeviceArray<uint16_t> d_dy = upload16(dy, c.dtype), d_rows = upload16(rows, c.dtype), d_out(rt.capacity * h);
  DeviceArray<float> d_row_weight = upload_f32(row_weight), d_dw(rt.capacity);
  for (bool weighted : {true, false}) {
    SCOPED_TRACE(weighted ? "weighted, with d_row_weight" : "unweighted, no d_row_weight");
    d_out.poison();
    d_dw.poison();
    kernels::launch_combine_backward(c.dtype, d_dy.get(), rt.d_token_of_row.get(),
                                     weighted ? d_row_weight.get() : nullptr, weighted ? d_rows.get() : nullptr,
                                     rt.d_splits.get(), rt.d_offsets.get(), c.experts, h, d_out.get(),
                                     weighted ? d_dw.get() : nullptr, nullptr);
    MG_CUDA_CHECK(cudaDeviceSynchronize());
    Mat expected(rt.used * h, 0.0), expected_dw(rt.used, 0.0);
    std::vector<bool> data(rt.used);
    for (int64_t r = 0; r < rt.used; ++r) {
      data[r] = rt.is_data_row(r);
      if (!data[r]) continue;
      const int64_t t = rt.plan.token_of_row[r];
      const double w = weighted ? row_weight[r] : 1.0;
      for (int64_t i = 0; i < h; ++i) {
        expected[r * h + i] = w * dy[t * h + i];
        expected_dw[r] += dy[t * h + i] * rows[r * h + i];
      }
    }
    const std::vector<uint16_t> out = d_out.download();
    const Mat got = from_bits16(slice(out, 0, rt.used * h), c.dtype);
    EXPECT_TRUE(passed(all_close("d_rows", got, expected, h, data, tolerance_for(c.dtype))));
    for (int64_t r = 0; r < rt.used; ++r)
      if (!data[r]) {
        EXPECT_TRUE(all_zero("d_rows gap row", got, r * h, (r + 1) * h));
      }
    EXPECT_TRUE(all_bits<uint16_t>("d_rows past the used rows", out, rt.used * h, rt.capacity * h, 0xffff));
    const std::vector<float> dw = d_dw.download();
    if (weighted) {
      EXPECT_TRUE(passed(all_close("d_row_weight", to_doubles(slice(dw, 0, rt.used)), expected_dw, 1, data,
                                   tolerance_for(DType::kFP32))));
      for (int64_t r = 0; r < rt.used; ++r)
        if (!data[r]) {
          EXPECT_EQ(dw[r], 0.0f) << "gap row " << r;
        }
      EXPECT_TRUE(all_bits("d_row_weight past the used rows", dw, rt.used, rt.capacity, kNaN));
    } else {
      EXPECT_TRUE(all_bits("d_row_weight (not requested)", dw, 0, rt.capacity, kNaN));
    }
  }
}

TEST_P(MoeRowKernels, GatherRowValues) {
  const RowsCase& c = GetParam();
  std::mt19937_64 rng(test_seed("moe_gather_" + c.name));
  Routed rt(rng, c);
  const Mat values = random_f32(rng, rt.capacity, -1.0, 1.0);
  DeviceArray<float> d_values = upload_f32(values), d_out(rt.max * c.top_k);
  d_out.poison();
  kernels::launch_gather_row_values(d_values.get(), rt.d_row_of.get(), rt.d_n.get(), rt.max, c.top_k, d_out.get(),
                                    nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> expected(rt.max * c.top_k, 0.0f);
  for (int64_t a = 0; a < rt.n * c.top_k; ++a)
    if (rt.plan.row_of[a] >= 0) expected[a] = static_cast<float>(values[rt.plan.row_of[a]]);
  EXPECT_TRUE(same("d_topk_weights", d_out.download(), expected));
}

TEST_P(MoeRowKernels, Unpermute) {
  const RowsCase& c = GetParam();
  std::mt19937_64 rng(test_seed("moe_unpermute_" + c.name));
  Routed rt(rng, c);
  const int64_t h = c.hidden;
  const Mat d_rows = random_values(rng, rt.capacity * h, 1.0, c.dtype);
  DeviceArray<uint16_t> d_d_rows = upload16(d_rows, c.dtype), d_dx(rt.max * h);
  d_dx.poison();  // every row must be written: sums below n, zeros past it
  kernels::launch_unpermute(c.dtype, d_d_rows.get(), rt.d_row_of.get(), rt.d_n.get(), rt.max, c.top_k, h, d_dx.get(),
                            nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> dx = d_dx.download();
  Mat expected(rt.n * h, 0.0);
  for (int64_t t = 0; t < rt.n; ++t)
    for (int j = 0; j < c.top_k; ++j)
      if (const int32_t row = rt.plan.row_of[t * c.top_k + j]; row >= 0)
        for (int64_t i = 0; i < h; ++i) expected[t * h + i] += d_rows[row * h + i];
  EXPECT_TRUE(passed(
      all_close("dx", from_bits16(slice(dx, 0, rt.n * h), c.dtype), expected, h, {}, tolerance_for(c.dtype))));
  EXPECT_TRUE(same("dx past n (zeros)", slice(dx, rt.n * h, rt.max * h),
                   std::vector<uint16_t>((rt.max - rt.n) * h, 0)));
}

std::vector<RowsCase> rows_cases() {
  return {
      {"bf16_h16_e8_k2_align1", DType::kBF16, 16, 8, 2, 500, 600, 1, 0.0},
      {"fp16_h80_e64_k8_align32_cf05", DType::kFP16, 80, 64, 8, 700, 800, 32, 0.5},
      {"bf16_h1024_e64_k8_align16", DType::kBF16, 1024, 64, 8, 300, 320, 16, 0.0},
      {"bf16_h256_e16_k1_cf05", DType::kBF16, 256, 16, 1, 1000, 1000, 1, 0.5},  // fully dropped tokens
      {"fp16_h48_e1024_k8_align32", DType::kFP16, 48, 1024, 8, 200, 256, 32, 0.0},
      {"bf16_h2048_e16_k8_align128", DType::kBF16, 2048, 16, 8, 64, 64, 128, 0.0},
      {"bf16_h64_e8_k4_n0", DType::kBF16, 64, 8, 4, 0, 100, 32, 0.0},
      {"bf16_h128_e8_k4_n1", DType::kBF16, 128, 8, 4, 1, 100, 16, 0.0},
  };
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeRowKernels, ::testing::ValuesIn(rows_cases()),
                         [](const auto& info) { return info.param.name; });

// ---- Router logits of a small batch --------------------------------------------------------------

// logits[t, e] = <x_t, W_r[e]> against fp64 for t < n (fp32 accumulation: within 1e-5 of the sum of
// |products|); rows from n on keep their poison; the token count is copied; a count past the bucket
// is recorded and clamped.
TEST(MoeRouterLogitsSmall, MatchesReferenceBelowNAndLeavesTheRest) {
  std::mt19937_64 rng(test_seed("moe_router_logits_small"));
  constexpr int64_t kMax = kernels::kRouterSmallTokens;
  for (DType dt : {DType::kBF16, DType::kFP16}) {
    for (const auto& [hidden, experts] : {std::pair<int64_t, int>{4096, 64}, {136, 13}}) {
      const Mat x = random_values(rng, kMax * hidden, 1.0, dt), w = random_values(rng, experts * hidden, 0.05, dt);
      DeviceArray<uint16_t> d_x(x.size()), d_w(w.size());
      d_x.upload(to_device_bits(x, dt));
      d_w.upload(to_device_bits(w, dt));
      DeviceArray<float> d_logits(kMax * experts);
      DeviceArray<int32_t> d_tokens(1);
      for (int32_t n : {1, 3, static_cast<int32_t>(kMax), static_cast<int32_t>(kMax + 3)}) {
        SCOPED_TRACE(detail::concat(dtype_name(dt), " hidden ", hidden, " experts ", experts, " n ", n));
        d_logits.poison();
        fill_bytes(d_tokens, kIntPoisonByte);
        auto error = cleared_error_record();
        DeviceArray<int32_t> d_n = device_scalar(n);
        kernels::RouterLogitsParams p;
        p.x = d_x.get(), p.w = d_w.get(), p.dtype = dt, p.num_tokens = d_n.get(), p.tokens_out = d_tokens.get();
        p.max_tokens = kMax, p.hidden = hidden, p.experts = experts, p.logits = d_logits.get();
        p.error = error.get();
        kernels::launch_router_logits_small(p, nullptr);
        MG_CUDA_CHECK(cudaDeviceSynchronize());
        const int64_t used = std::min<int64_t>(n, kMax);
        if (n > kMax) expect_error(error.download()[0], {kDeviceErrorTokenCount, -1, n, kMax});
        else EXPECT_EQ(error.download()[0].code, 0);
        EXPECT_EQ(d_tokens.download()[0], n);
        const std::vector<float> got = d_logits.download();
        int64_t bad = 0;
        for (int64_t t = 0; t < used; ++t)
          for (int e = 0; e < experts; ++e) {
            double ref = 0.0, mag = 0.0;
            for (int64_t h = 0; h < hidden; ++h) {
              const double prod = x[t * hidden + h] * w[e * hidden + h];
              ref += prod, mag += std::fabs(prod);
            }
            const double g = got[t * experts + e];
            if (!(std::fabs(g - ref) <= 1e-5 * mag + 1e-30) && bad++ < 5)
              ADD_FAILURE() << "logits[" << t << ", " << e << "] = " << g << ", fp64 " << ref;
          }
        EXPECT_EQ(bad, 0);
        EXPECT_TRUE(all_bits("logits past n", got, used * experts, kMax * experts, kNaN));
      }
    }
  }
  kernels::RouterLogitsParams too_many;  // the bucket bound is checked before anything is enqueued
  too_many.max_tokens = kMax + 1, too_many.hidden = 64, too_many.experts = 8;
  EXPECT_THROW(kernels::launch_router_logits_small(too_many, nullptr), Error);
}

// ---- Copy tokens --------------------------------------------------------------------------------

TEST(MoeCopyTokens, CopiesTokensBelowNAndZeroesTheRest) {
  std::mt19937_64 rng(test_seed("moe_copy_tokens"));
  constexpr int64_t kMax = 100;
  for (std::size_t row_bytes : {std::size_t{64}, std::size_t{12}, std::size_t{7}}) {  // 16-, 4-, 1-byte units
    std::vector<unsigned char> src(kMax * row_bytes);
    for (auto& b : src) b = static_cast<unsigned char>(rng() | 1);  // never zero
    DeviceArray<unsigned char> d_src(src.size()), d_dst(src.size());
    d_src.upload(src);
    for (int32_t n : {0, 37, static_cast<int32_t>(kMax)}) {
      SCOPED_TRACE(detail::concat("row_bytes ", row_bytes, ", n ", n));
      fill_bytes(d_dst, 0xff);
      DeviceArray<int32_t> d_n = device_scalar(n);
      kernels::launch_copy_tokens(d_src.get(), d_dst.get(), row_bytes, d_n.get(), kMax, nullptr);
      MG_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<unsigned char> expected(src.size(), 0);
      std::copy_n(src.begin(), n * row_bytes, expected.begin());
      EXPECT_TRUE(same("dst", d_dst.download(), expected));
    }
  }
}

// ---- SwiGLU with the routing weight -------------------------------------------------------------

struct SwigluCase {
  std::string name;
  DType dtype;
  int64_t ffn;
  int experts;
  int64_t rows;
  int row_align;
};
void PrintTo(const SwigluCase& c, std::ostream* os) { *os << c.name; }  // not a byte dump

class MoeSwigluWeighted : public ::testing::TestWithParam<SwigluCase> {};

TEST_P(MoeSwigluWeighted, ForwardAndBackwardMatchReference) {
  const SwigluCase& c = GetParam();
  std::mt19937_64 rng(test_seed("moe_swiglu_weighted_" + c.name));
  const int64_t f = c.ffn;
  const std::vector<int32_t> splits = random_splits(rng, c.experts, c.rows, Routing::kSkewed);
  const int64_t capacity = worst_capacity(c.rows, c.experts, 1, c.row_align) + 2 * c.row_align;
  const GroupLayout layout = make_layout(splits, c.row_align, capacity);
  const int64_t used = layout.offsets.back();
  const std::vector<bool> data = data_rows(layout);
  // Every row holds data in h and da (gap rows too): only the weight makes a gap row zero.
  const Mat h = random_values(rng, capacity * 2 * f, 2.0, c.dtype);
  const Mat da = random_values(rng, capacity * f, 1.0, c.dtype);
  Mat row_weight = random_f32(rng, capacity, 0.05, 1.0);
  for (int64_t r = 0; r < capacity; ++r)
    if (r >= used) row_weight[r] = std::nan("");  // never read
    else if (!data[r]) row_weight[r] = 0.0;        // as dispatch leaves gap rows
  const Mat extra = random_f32(rng, capacity, -1.0, 1.0);

  DeviceArray<uint16_t> d_h = upload16(h, c.dtype), d_da = upload16(da, c.dtype), d_a(capacity * f),
                        d_dh(capacity * 2 * f);
  DeviceArray<float> d_w = upload_f32(row_weight), d_extra = upload_f32(extra), d_dw(capacity);
  DeviceArray<int64_t> d_offsets(c.experts + 1);
  d_offsets.upload(layout.offsets);

  auto silu = [](double g) { return g / (1.0 + std::exp(-g)); };
  Mat a_ref(used * f), dh_ref(used * 2 * f);
  std::vector<double> dw_ref(used, 0.0);
  for (int64_t r = 0; r < used; ++r)
    for (int64_t j = 0; j < f; ++j) {
      const double g = h[r * 2 * f + j], u = h[r * 2 * f + f + j], w = row_weight[r], d = da[r * f + j];
      const double s = 1.0 / (1.0 + std::exp(-g));
      a_ref[r * f + j] = w * silu(g) * u;
      dh_ref[r * 2 * f + j] = d * w * u * s * (1.0 + g * (1.0 - s));
      dh_ref[r * 2 * f + f + j] = d * w * silu(g);
      dw_ref[r] += d * silu(g) * u;
    }

  d_a.poison();
  kernels::launch_swiglu_weighted_forward(c.dtype, d_h.get(), d_w.get(), d_a.get(), f, d_offsets.get(), c.experts,
                                          nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> a = d_a.download();
  const Mat a_got = from_bits16(slice(a, 0, used * f), c.dtype);
  EXPECT_TRUE(passed(all_close("a", a_got, a_ref, f, {}, tolerance_for(c.dtype))));
  for (int64_t r = 0; r < used; ++r)
    if (!data[r]) {
      EXPECT_TRUE(all_zero("a gap row", a_got, r * f, (r + 1) * f));
    }
  EXPECT_TRUE(all_bits<uint16_t>("a past the used rows", a, used * f, capacity * f, 0xffff));

  for (bool with_extra : {true, false}) {
    SCOPED_TRACE(with_extra ? "with extra" : "without extra");
    d_dh.poison();
    d_dw.poison();
    kernels::launch_swiglu_weighted_backward(c.dtype, d_h.get(), d_w.get(), d_da.get(), d_dh.get(),
                                             with_extra ? d_extra.get() : nullptr, d_dw.get(), f, d_offsets.get(),
                                             c.experts, nullptr);
    MG_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> dh = d_dh.download();
    EXPECT_TRUE(passed(all_close("dh", from_bits16(slice(dh, 0, used * 2 * f), c.dtype), dh_ref, 2 * f, {},
                                 tolerance_for(c.dtype))));
    EXPECT_TRUE(all_bits<uint16_t>("dh past the used rows", dh, used * 2 * f, capacity * 2 * f, 0xffff));
    std::vector<double> dw_expected = dw_ref;
    if (with_extra)
      for (int64_t r = 0; r < used; ++r) dw_expected[r] += extra[r];
    const std::vector<float> dw = d_dw.download();
    EXPECT_TRUE(passed(
        all_close("d_row_weight", to_doubles(slice(dw, 0, used)), dw_expected, 1, {}, tolerance_for(DType::kFP32))));
    EXPECT_TRUE(all_bits("d_row_weight past the used rows", dw, used, capacity, kNaN));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeSwigluWeighted,
                         ::testing::Values(SwigluCase{"bf16_f256_e8_align32", DType::kBF16, 256, 8, 700, 32},
                                           SwigluCase{"fp16_f48_e16_align16", DType::kFP16, 48, 16, 500, 16},
                                           SwigluCase{"bf16_f1040_e4_align1", DType::kBF16, 1040, 4, 200, 1},
                                           SwigluCase{"bf16_f64_e64_align128", DType::kBF16, 64, 64, 1000, 128}),
                         [](const auto& info) { return info.param.name; });

// ---- Graph capture ------------------------------------------------------------------------------

TEST(MoeRoutingGraph, DispatchPermuteCombineReplaysWithNewTokenCountsAndRoutings) {
  std::mt19937_64 rng(test_seed("moe_routing_graph"));
  constexpr int E = 32, K = 4, kAlign = 16;
  constexpr int64_t kMax = 1024, kHidden = 256;
  constexpr double kCapacityFactor = 1.0;
  constexpr DType kType = DType::kBF16;
  const int64_t capacity = worst_capacity(kMax, E, K, kAlign);
  DispatchBuffers b(kMax, E, K, capacity);
  DeviceArray<uint16_t> d_x(kMax * kHidden), d_permuted(capacity * kHidden), d_y(kMax * kHidden);
  Stream stream;
  auto enqueue = [&] {
    kernels::launch_dispatch(b.params(kAlign, kCapacityFactor), stream.get());
    kernels::launch_permute_rows(kType, d_x.get(), b.token_of_row.get(), b.splits.get(), b.offsets.get(), E,
                                 kHidden, d_permuted.get(), stream.get());
    kernels::launch_combine(kType, d_permuted.get(), b.row_of.get(), b.weights.get(), b.n.get(), kMax, K, kHidden,
                            d_y.get(), stream.get());
  };
  struct Step {
    int32_t n;
    double zipf;
  };
  const Step steps[] = {{static_cast<int32_t>(kMax), 1.2}, {1, 0.0}, {0, 1.2}, {700, 2.0}, {513, 0.0}};
  std::vector<int32_t> ids;
  Mat weights, x;
  auto prepare = [&](const Step& s) {
    ids = random_topk_ids(rng, kMax, E, K, s.zipf);
    weights = random_f32(rng, kMax * K, 0.05, 1.0);
    x = random_values(rng, kMax * kHidden, 1.0, kType);
    b.upload(s.n, ids, weights);
    d_x.upload(to_device_bits(x, kType));
    b.poison(0);
    d_permuted.poison();
    d_y.poison();
    MG_CUDA_CHECK(cudaDeviceSynchronize());  // the stream is non-blocking: order it after the set-up
  };
  prepare(steps[0]);
  enqueue();  // warm-up outside capture
  MG_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  Graph graph(stream.get(), enqueue);

  for (const Step& s : steps) {
    SCOPED_TRACE(detail::concat("replay with n = ", s.n));
    prepare(s);
    graph.launch(stream.get());
    MG_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    const int64_t n = s.n;
    const RouterRef r = routed(ids, weights, n, E, K);
    const DispatchRef plan =
        ref_dispatch(r, router_spec(E, K, false, false, 0.0, kCapacityFactor, kAlign), capacity);
    expect_dispatch_matches(DispatchResult(b), plan, r.counts, n, K, kMax, capacity, 0);
    const int64_t used = plan.layout.offsets.back();
    const Mat permuted_ref = ref_permute(plan, slice(x, 0, n * kHidden), kHidden);
    const std::vector<uint16_t> permuted = d_permuted.download();
    EXPECT_TRUE(same("permuted", from_bits16(slice(permuted, 0, used * kHidden), kType),
                     slice(permuted_ref, 0, used * kHidden)));
    const std::vector<uint16_t> y = d_y.download();
    const Mat y_ref = ref_combine(plan, permuted_ref, slice(weights, 0, n * K), n, K, kHidden);
    EXPECT_TRUE(passed(all_close("y", from_bits16(slice(y, 0, n * kHidden), kType), y_ref, kHidden, {},
                                 tolerance_for(kType))));
    EXPECT_TRUE(all_bits<uint16_t>("y past n", y, n * kHidden, kMax * kHidden, 0xffff));
    if (::testing::Test::HasFailure()) break;
  }
}

}  // namespace
}  // namespace moegraph::test
