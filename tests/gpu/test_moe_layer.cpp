// The whole MoE layer (MoeLayer) against the fp64 composition of reference operators: forward and
// every gradient, eager and graph-replayed (bit-identical), delayed vs immediate wgrad, fused vs
// unfused routing weights, dropped-token accounting, invalid token counts, and the step runtime
// running the layer.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "moegraph/moe_layer.hpp"
#include "moegraph/step_graphs.hpp"
#include "testing/data.hpp"
#include "testing/device_array.hpp"
#include "testing/graph.hpp"
#include "testing/moe_layer_reference.hpp"
#include "testing/step_weights.hpp"
#include "tests/common/expect.hpp"

namespace moegraph::test {
namespace {

struct LayerCase {
  const char* name;
  int experts, top_k;
  int64_t hidden, ffn, max_tokens;
  bool bias, sigmoid, renormalize;
  double aux, capacity_factor;
  bool fuse;
  int row_align;
  bool main_grad, delay;
};

MoeLayerOptions options_of(const LayerCase& c) {
  MoeLayerOptions o;
  o.experts = c.experts, o.top_k = c.top_k, o.hidden = c.hidden, o.ffn = c.ffn, o.max_tokens = c.max_tokens;
  o.bias = c.bias;
  o.score = c.sigmoid ? RouterScore::kSigmoid : RouterScore::kSoftmax;
  o.renormalize = c.renormalize;
  o.aux_loss_coef = c.aux;
  o.capacity_factor = c.capacity_factor;
  o.fuse_weights = c.fuse;
  o.row_align = c.row_align;
  o.training = true;
  o.wgrad_slots = 2;
  o.delay_wgrad = c.delay;
  o.main_grad_fp32 = c.main_grad;
  return o;
}


struct LayerOutputs {
  Mat y, dx, dwr, dw1, dw2, db1, db2;
  double aux = 0;
  bool operator==(const LayerOutputs& o) const {
    return same_bits(y, o.y) && same_bits(dx, o.dx) && same_bits(dwr, o.dwr) && same_bits(dw1, o.dw1) &&
           same_bits(dw2, o.dw2) && same_bits(db1, o.db1) && same_bits(db2, o.db2) &&
           (aux == o.aux || (std::isnan(aux) && std::isnan(o.aux)));
  }
};

class LayerHarness {
 public:
  LayerHarness(const MoeLayerOptions& o, uint64_t seed) : o_(o), rng_(seed) {
    const int64_t e = o.experts, h = o.hidden, f = o.ffn, t = o.max_tokens;
    const DType dt = o.dtype;
    wr_ = grid_values(rng_, e * h, 64, 1.0 / 256);
    w1_ = random_values(rng_, e * 2 * f * h, 1.0 / std::sqrt(double(h)), dt);
    w2_ = random_values(rng_, e * h * f, 1.0 / std::sqrt(double(f)), dt);
    if (o.bias) b1_ = random_values(rng_, e * 2 * f, 0.1, dt), b2_ = random_values(rng_, e * h, 0.1, dt);
    wr_d_ = upload(wr_), w1_d_ = upload(w1_), w2_d_ = upload(w2_);
    if (o.bias) b1_d_ = upload(b1_), b2_d_ = upload(b2_);
    x_d_ = DeviceArray<uint16_t>(t * h), y_d_ = DeviceArray<uint16_t>(t * h);
    dy_d_ = DeviceArray<uint16_t>(t * h), dx_d_ = DeviceArray<uint16_t>(t * h);
    tokens_d_ = DeviceArray<int32_t>(1), aux_d_ = DeviceArray<float>(1);
    MoeLayerWeights w;
    w.router = wr_d_.get(), w.w1 = w1_d_.get(), w.w2 = w2_d_.get();
    if (o.bias) {
      db1_d_ = DeviceArray<uint16_t>(e * 2 * f), db2_d_ = DeviceArray<uint16_t>(e * h);
      w.b1 = b1_d_.get(), w.b2 = b2_d_.get(), w.db1 = db1_d_.get(), w.db2 = db2_d_.get();
    }
    if (o.main_grad_fp32) {
      mgr_ = DeviceArray<float>(e * h), mg1_ = DeviceArray<float>(e * 2 * f * h), mg2_ = DeviceArray<float>(e * h * f);
      w.main_grad_router = mgr_.get(), w.main_grad1 = mg1_.get(), w.main_grad2 = mg2_.get();
    } else {
      dwr_ = DeviceArray<uint16_t>(e * h), dw1_ = DeviceArray<uint16_t>(e * 2 * f * h);
      dw2_ = DeviceArray<uint16_t>(e * h * f);
      w.d_router = dwr_.get(), w.dw1 = dw1_.get(), w.dw2 = dw2_.get();
    }
    layer_ = std::make_unique<MoeLayer>(o, w);
  }

  MoeLayer& layer() { return *layer_; }
  cudaStream_t stream() const { return stream_.get(); }
  MoeLayerIO io() const {
    MoeLayerIO io;
    io.x = x_d_.get(), io.num_tokens = tokens_d_.get(), io.y = y_d_.get(), io.aux_loss = aux_d_.get();
    io.dy = dy_d_.get(), io.dx = dx_d_.get();
    return io;
  }

  // Fresh x (every row, so rows past n hold data the layer must ignore) and dy; n tokens.
  void set_inputs(int64_t n) {
    const int64_t t = o_.max_tokens, h = o_.hidden;
    x_ = grid_values(rng_, t * h, 4, 0.25);
    dy_ = random_values(rng_, t * h, 1.0, o_.dtype);
    x_d_.upload(to_device_bits(x_, o_.dtype));
    dy_d_.upload(to_device_bits(dy_, o_.dtype));
    set_tokens(n);
  }
  void set_tokens(int64_t n) {
    n_ = n;
    tokens_d_.upload({static_cast<int32_t>(n)});
  }
  // NaN outputs, zero main_grad (it accumulates), NaN written gradients.
  void poison() {
    y_d_.poison(), dx_d_.poison(), aux_d_.poison();
    for (DeviceArray<float>* a : {&mgr_, &mg1_, &mg2_})
      if (a->size()) testing::memset_and_wait(a->get(), 0, a->size() * sizeof(float));
    for (DeviceArray<uint16_t>* a : {&dwr_, &dw1_, &dw2_, &db1_d_, &db2_d_})
      if (a->size()) a->poison();
  }
  void train_step() {
    const MoeLayerIO x = io();
    layer_->forward_train(x, stream());
    layer_->backward(x, stream());
    if (o_.delay_wgrad) layer_->backward_dw(stream());
  }
  LayerOutputs read() {
    MG_CUDA_CHECK(cudaStreamSynchronize(stream()));
    LayerOutputs out;
    const DType dt = o_.dtype;
    out.y = download_bits(y_d_, dt);
    out.dx = download_bits(dx_d_, dt);
    out.aux = aux_d_.download()[0];
    if (o_.main_grad_fp32) {
      out.dwr = download_floats(mgr_), out.dw1 = download_floats(mg1_), out.dw2 = download_floats(mg2_);
    } else {
      out.dwr = download_bits(dwr_, dt), out.dw1 = download_bits(dw1_, dt), out.dw2 = download_bits(dw2_, dt);
    }
    if (o_.bias) out.db1 = download_bits(db1_d_, dt), out.db2 = download_bits(db2_d_, dt);
    return out;
  }

  MoeLayerRef reference(bool with_backward) const {
    const int64_t h = o_.hidden;
    const Mat x(x_.begin(), x_.begin() + n_ * h), dy(dy_.begin(), dy_.begin() + n_ * h);
    RouterSpec spec;
    spec.experts = o_.experts, spec.top_k = o_.top_k, spec.sigmoid = o_.score == RouterScore::kSigmoid;
    spec.renormalize = o_.renormalize, spec.aux_coef = o_.aux_loss_coef;
    spec.capacity_factor = o_.capacity_factor, spec.row_align = o_.row_align;
    MoeLayerInputs in;
    in.x = &x, in.wr = &wr_, in.w1 = &w1_, in.b1 = &b1_, in.w2 = &w2_, in.b2 = &b2_;
    in.dy = with_backward ? &dy : nullptr;
    in.tokens = n_, in.hidden = h, in.ffn = o_.ffn, in.capacity_rows = moe_layer_rows(o_);
    in.router = spec, in.fuse_weights = o_.fuse_weights, in.dtype = o_.dtype;
    return ref_moe_layer(in);
  }

  void expect_matches_reference(const LayerOutputs& got, const std::string& where, bool with_backward = true) const {
    const MoeLayerRef ref = reference(with_backward);
    const int64_t h = o_.hidden, f = o_.ffn, n = n_;
    const Tolerance tol = chain_tolerance_for(o_.dtype);
    const Mat y(got.y.begin(), got.y.begin() + n * h);
    if (n > 0) {
      EXPECT_TRUE(passed(all_close(where + " y", y, ref.y, h, {}, tol)));
    }
    if (o_.aux_loss_coef > 0) {
      EXPECT_NEAR(got.aux, ref.aux_loss, 1e-4 * std::abs(ref.aux_loss) + 1e-6) << where << " aux_loss";
    }
    if (!with_backward) return;
    const Mat dx(got.dx.begin(), got.dx.begin() + n * h);
    if (n > 0) {
      EXPECT_TRUE(passed(all_close(where + " dx", dx, ref.dx, h, {}, tol)));
    }
    std::size_t nonzero_past_n = 0;
    for (std::size_t i = n * h; i < got.dx.size(); ++i) nonzero_past_n += got.dx[i] != 0.0;
    EXPECT_EQ(nonzero_past_n, 0u) << where << " dx rows past n must be written as zero";
    EXPECT_TRUE(passed(all_close(where + " d_router", got.dwr, ref.dwr, h, {}, tol)));
    EXPECT_TRUE(passed(all_close(where + " dw1", got.dw1, ref.dw1, h, {}, tol)));
    EXPECT_TRUE(passed(all_close(where + " dw2", got.dw2, ref.dw2, f, {}, tol)));
    if (o_.bias) {
      EXPECT_TRUE(passed(all_close(where + " db1", got.db1, ref.db1, 2 * f, {}, tol)));
      EXPECT_TRUE(passed(all_close(where + " db2", got.db2, ref.db2, h, {}, tol)));
    }
  }
  uint64_t reference_dropped() const { return reference(false).dispatch.dropped; }

 private:
  DeviceArray<uint16_t> upload(const Mat& v) const {
    DeviceArray<uint16_t> a(v.size());
    a.upload(to_device_bits(v, o_.dtype));
    return a;
  }

  MoeLayerOptions o_;
  std::mt19937_64 rng_;
  Mat wr_, w1_, w2_, b1_, b2_, x_, dy_;
  int64_t n_ = 0;
  DeviceArray<uint16_t> wr_d_, w1_d_, w2_d_, b1_d_, b2_d_, x_d_, y_d_, dy_d_, dx_d_;
  DeviceArray<uint16_t> dwr_, dw1_, dw2_, db1_d_, db2_d_;
  DeviceArray<float> mgr_, mg1_, mg2_, aux_d_;
  DeviceArray<int32_t> tokens_d_;
  Stream stream_;
  std::unique_ptr<MoeLayer> layer_;
};

const LayerCase kCases[] = {
    // name                      E   k  H    F    T   bias  sigm  renorm aux    cf   fuse  align mg    delay
    {"softmax_top2_bias_renorm", 8, 2, 128, 64, 64, true, false, true, 0.0, 0.0, false, 1, true, false},
    {"sigmoid_top8_e64_aux", 64, 8, 256, 128, 96, false, true, true, 0.01, 0.0, false, 1, false, true},
    {"fused_weights_bias_align16", 16, 4, 128, 128, 64, true, false, false, 0.001, 0.0, true, 16, true, false},
    {"capacity_half_align32", 8, 2, 128, 64, 128, false, false, true, 0.0, 0.5, false, 32, true, true},
    {"top1_e4_odd_tokens", 4, 1, 64, 32, 33, true, false, false, 0.0, 0.0, false, 1, false, false},
    {"fused_sigmoid_capacity", 32, 6, 128, 64, 80, true, true, true, 0.01, 0.75, true, 128, true, true},
};

class MoeLayerCase : public ::testing::TestWithParam<LayerCase> {};

// Eager train steps at several token counts, then the inference forward on the same data.
TEST_P(MoeLayerCase, TrainStepMatchesReference) {
  const LayerCase& c = GetParam();
  LayerHarness h(options_of(c), test_seed(c.name));
  for (int64_t n : {c.max_tokens, c.max_tokens / 2 + 1, int64_t{1}}) {
    h.set_inputs(n);
    h.poison();
    h.train_step();
    h.layer().check_device_errors(h.stream());
    const LayerOutputs train = h.read();
    h.expect_matches_reference(train, detail::concat(c.name, " n=", n));
    h.poison();
    h.layer().forward(h.io(), h.stream());
    const LayerOutputs infer = h.read();
    EXPECT_TRUE(same_bits(infer.y, train.y)) << c.name << " n=" << n << ": inference y differs from forward_train's";
  }
}

// One capture (under cudaStreamCaptureModeGlobal) replayed for other token counts and data; every
// replay matches the reference and an eager run on the same data bit for bit.
TEST_P(MoeLayerCase, GraphReplaysMatchEagerAndReference) {
  const LayerCase& c = GetParam();
  LayerHarness h(options_of(c), test_seed(c.name) + 1);
  h.set_inputs(c.max_tokens);
  h.train_step();  // warm-up outside capture
  testing::Graph graph(h.stream(), [&] { h.train_step(); });
  for (int64_t n : {c.max_tokens, int64_t{0}, c.max_tokens / 3 + 1, int64_t{1}}) {
    h.set_inputs(n);
    h.poison();
    graph.launch(h.stream());
    const LayerOutputs replayed = h.read();
    h.expect_matches_reference(replayed, detail::concat(c.name, " graph n=", n));
    h.poison();
    h.train_step();
    EXPECT_TRUE(h.read() == replayed) << c.name << " n=" << n << ": graph replay and eager run differ";
  }
  h.layer().check_device_errors(h.stream());
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeLayerCase, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(MoeLayer, DelayedWgradIsBitIdenticalToImmediate) {
  LayerCase c = kCases[1];
  c.delay = true;
  LayerHarness delayed(options_of(c), 7);
  c.delay = false;
  LayerHarness immediate(options_of(c), 7);
  for (LayerHarness* h : {&delayed, &immediate}) {
    h->set_inputs(c.max_tokens - 5);
    h->poison();
    h->train_step();
  }
  EXPECT_TRUE(delayed.read() == immediate.read());
}

TEST(MoeLayer, FusedRoutingWeightsMatchUnfused) {
  for (LayerCase c : {kCases[0], kCases[1]}) {
    c.fuse = false;
    LayerHarness unfused(options_of(c), 11);
    c.fuse = true;
    LayerHarness fused(options_of(c), 11);
    for (LayerHarness* h : {&unfused, &fused}) {
      h->set_inputs(c.max_tokens);
      h->poison();
      h->train_step();
    }
    const LayerOutputs a = unfused.read(), b = fused.read();
    EXPECT_FALSE(a == b) << "fusion must change the computation (else this test proves nothing)";
    fused.expect_matches_reference(b, detail::concat(c.name, " fused"));
    unfused.expect_matches_reference(a, detail::concat(c.name, " unfused"));
    // Each side is within the chain tolerance of the fp64 reference, so their difference is within
    // twice that (both carry storage rounding; the dW sums cancel, so one side alone is not enough).
    const Tolerance one = chain_tolerance_for(DType::kBF16);
    const Tolerance tol{2 * one.rtol, 2 * one.atol, 2 * one.rel_fro};
    const std::string where = detail::concat(c.name, " fused vs unfused ");
    EXPECT_TRUE(passed(all_close(where + "y", b.y, a.y, c.hidden, {}, tol)));
    EXPECT_TRUE(passed(all_close(where + "dx", b.dx, a.dx, c.hidden, {}, tol)));
    EXPECT_TRUE(passed(all_close(where + "d_router", b.dwr, a.dwr, c.hidden, {}, tol)));
    EXPECT_TRUE(passed(all_close(where + "dw1", b.dw1, a.dw1, c.hidden, {}, tol)));
    EXPECT_TRUE(passed(all_close(where + "dw2", b.dw2, a.dw2, c.ffn, {}, tol)));
  }
}

TEST(MoeLayer, DroppedAssignmentsAreCountedNotLost) {
  const LayerCase c = kCases[3];  // capacity factor 0.5: about half the assignments are dropped
  LayerHarness h(options_of(c), 5);
  uint64_t expected = 0;
  for (int64_t n : {c.max_tokens, int64_t{40}}) {
    h.set_inputs(n);
    h.poison();
    h.layer().forward(h.io(), h.stream());
    expected += h.reference_dropped();
  }
  EXPECT_GT(expected, 0u);
  EXPECT_EQ(h.layer().read_dropped(h.stream()), expected);
  EXPECT_EQ(h.layer().read_dropped(h.stream()), 0u) << "reading resets the counter";
}

TEST(MoeLayer, InvalidTokenCountIsReported) {
  const LayerCase c = kCases[0];
  LayerHarness h(options_of(c), 3);
  h.set_inputs(c.max_tokens);
  h.set_tokens(c.max_tokens + 5);
  h.layer().forward(h.io(), h.stream());
  try {
    h.layer().check_device_errors(h.stream());
    FAIL() << "a token count past max_tokens must be reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kDeviceSplits);
    EXPECT_NE(e.message().find(detail::concat("num_tokens = ", c.max_tokens + 5)), std::string::npos) << e.message();
  }
  EXPECT_NO_THROW(h.layer().check_device_errors(h.stream())) << "records are cleared once reported";
  h.set_tokens(-1);
  h.layer().forward(h.io(), h.stream());
  EXPECT_THROW(h.layer().check_device_errors(h.stream()), Error);
}

TEST(MoeLayer, PhaseOrderIsChecked) {
  const LayerCase c = kCases[0];
  LayerHarness h(options_of(c), 3);
  h.set_inputs(8);
  EXPECT_THROW(h.layer().backward(h.io(), h.stream()), Error) << "backward without forward_train";
  EXPECT_THROW(h.layer().backward_dw(h.stream()), Error) << "backward_dw without a delayed backward";
  h.layer().forward_train(h.io(), h.stream());
  EXPECT_THROW(h.layer().forward(h.io(), h.stream()), Error) << "inference would overwrite slot 0";
  h.layer().forward_train(h.io(), h.stream());
  EXPECT_THROW(h.layer().forward_train(h.io(), h.stream()), Error) << "both slots in flight";
  h.layer().backward(h.io(), h.stream());
  h.layer().backward(h.io(), h.stream());
  EXPECT_EQ(h.layer().pending_backwards(), 0);
  MG_CUDA_CHECK(cudaStreamSynchronize(h.stream()));
}

// The step runtime on the whole layer, built from typed options on the caller's weights: graph
// replays equal eager steps bit for bit, for the bf16 and the mxfp8 recipe.
class MoeLayerStep : public ::testing::TestWithParam<Recipe> {};
TEST_P(MoeLayerStep, StepGraphsReplayTheWholeLayer) {
  StepGraphsOptions o;
  o.step = StepKind::kMoeLayer;
  MoeLayerOptions& l = o.layer;
  l.recipe = GetParam();
  l.experts = 16, l.hidden = 128, l.ffn = 128, l.top_k = 4, l.bias = true;
  l.score = RouterScore::kSoftmax, l.renormalize = true, l.aux_loss_coef = 0.01;
  l.training = true, l.delay_wgrad = true, l.wgrad_slots = 2;
  l.row_align = 32;
  o.buckets = {16, 64};
  const testing::OwnedStepWeights weights = testing::make_step_weights(o, nullptr);
  StepGraphs step(o, weights.weights);
  step.weights_changed(nullptr);  // MXFP8: quantize the weights just written
  Stream stream;
  cudaStream_t s = stream.get();
  const int b = step.bucket_for(40);
  const BucketIO io = step.io(b);
  const std::size_t n = io.tokens * l.hidden;
  std::mt19937_64 rng(test_seed("moe_layer_step"));
  DeviceArray<uint16_t> x(n), dy(n);
  auto run = [&](bool graph) {
    MG_CUDA_CHECK(cudaMemcpy(io.x, x.get(), n * 2, cudaMemcpyDeviceToDevice));
    MG_CUDA_CHECK(cudaMemcpy(io.dy, dy.get(), n * 2, cudaMemcpyDeviceToDevice));
    testing::memset_and_wait(step.weights().main_grad1, 0, l.experts * 2 * l.ffn * l.hidden * 4);
    testing::memset_and_wait(io.y, 0xff, n * 2);
    testing::memset_and_wait(io.dx, 0xff, n * 2);
    graph ? step.forward_train(b, s) : step.run_eager(b, StepPhase::kForwardTrain, s);
    graph ? step.backward(b, s) : step.run_eager(b, StepPhase::kBackward, s);
    graph ? step.wgrad(b, s) : step.run_eager(b, StepPhase::kWgrad, s);
    step.check_device_errors(s);
    std::vector<uint16_t> y(n), dx(n);
    std::vector<float> g(l.experts * 2 * l.ffn * l.hidden);
    MG_CUDA_CHECK(cudaMemcpy(y.data(), io.y, n * 2, cudaMemcpyDeviceToHost));
    MG_CUDA_CHECK(cudaMemcpy(dx.data(), io.dx, n * 2, cudaMemcpyDeviceToHost));
    MG_CUDA_CHECK(cudaMemcpy(g.data(), step.weights().main_grad1, g.size() * 4, cudaMemcpyDeviceToHost));
    return std::make_tuple(y, dx, g);
  };
  for (int32_t tokens : {40, 64, 17}) {
    x.upload(to_device_bits(random_values(rng, n, 1.0, DType::kBF16), DType::kBF16));
    dy.upload(to_device_bits(random_values(rng, n, 1.0, DType::kBF16), DType::kBF16));
    MG_CUDA_CHECK(cudaMemcpy(io.num_tokens, &tokens, 4, cudaMemcpyHostToDevice));
    const auto eager = run(false), replay = run(true);
    EXPECT_TRUE(std::get<0>(eager) == std::get<0>(replay)) << "y, " << tokens << " tokens";
    EXPECT_TRUE(std::get<1>(eager) == std::get<1>(replay)) << "dx, " << tokens << " tokens";
    EXPECT_TRUE(std::get<2>(eager) == std::get<2>(replay)) << "main_grad1, " << tokens << " tokens";
    std::size_t nan = 0;
    for (std::size_t i = 0; i < std::size_t(tokens) * l.hidden; ++i)
      nan += std::isnan(from_bits(std::get<0>(replay)[i], DType::kBF16));
    EXPECT_EQ(nan, 0u) << "every routed token's output is written";
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, MoeLayerStep, ::testing::Values(Recipe::kBF16, Recipe::kMXFP8));

}  // namespace
}  // namespace moegraph::test
