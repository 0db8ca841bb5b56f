// The whole MoE layer (MoeLayer) against the fp64 composition of reference operators: forward and
// every gradient, eager and graph-replayed (bit-identical), delayed vs immediate wgrad, fused vs
// unfused routing weights, dropped-token accounting, invalid token counts, and the step runtime
// running the layer.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "moegraph/moe_layer.hpp"
#include "moegraph/step_graphs.hpp"
#include "testing/data.hpp"
#include "testing/device_array.hpp"
#include "testing/graph.hpp"
#include "testing/guarded_buffer.hpp"
#include "testing/moe_layer_reference.hpp"
#include "testing/step_weights.hpp"
#include "tests/common/expect.hpp"
#include "tests/common/thrown.hpp"
#include "tests/gpu/moe_layer_harness.hpp"

namespace moegraph::test {
namespace {

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
  expect_train_steps_match(GetParam(), Recipe::kBF16, test_seed(GetParam().name));
}

// One capture (under cudaStreamCaptureModeGlobal) replayed for other token counts and data; every
// replay matches the reference and an eager run on the same data bit for bit.
TEST_P(MoeLayerCase, GraphReplaysMatchEagerAndReference) {
  expect_graph_replays_match(GetParam(), Recipe::kBF16, test_seed(GetParam().name) + 1);
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

// Two micro-batches in flight (F0 F1 B0 B1 W0 W1, or F0 F1 B0 B1 with immediate wgrad), the
// caller's x and dy rewritten between the phases, against the same micro-batches one step after
// the other: every output and the accumulated gradients bit for bit. With bf16 training the layer
// saves the expert linears' inputs (and with delayed wgrad their output gradients) per slot where
// they are written (FC1 and FC2 keep pointers), so a tensor shared by the slots would show here as
// the other micro-batch's data.
TEST(MoeLayer, PipelinedMicroBatchesMatchSequentialSteps) {
  for (const auto& [fuse, delay] : {std::pair{false, true}, std::pair{true, true}, std::pair{false, false}}) {
    SCOPED_TRACE(detail::concat(fuse ? "fused routing weights" : "unfused", delay ? ", delayed" : ", immediate",
                                " wgrad"));
    LayerCase c = kCases[0];  // bf16, biases, fp32 main_grad
    c.delay = delay, c.fuse = fuse;
    LayerHarness h(options_of(c), 11);
    std::vector<LayerHarness::Inputs> in;
    std::vector<LayerOutputs> seq;
    h.poison();
    for (int64_t n : {c.max_tokens - 3, c.max_tokens / 2}) {
      h.set_inputs(n);
      in.push_back(h.inputs());
      h.train_step();
      seq.push_back(h.read());
    }
    ASSERT_FALSE(same_bits(seq[0].dx, seq[1].dx)) << "the two micro-batches should differ";

    h.poison();
    std::vector<LayerOutputs> pipe(2);
    for (int mb = 0; mb < 2; ++mb) {
      h.write_forward_inputs(in[mb]);
      h.layer().forward_train(h.io(), h.stream());
      pipe[mb].y = h.read().y;
    }
    for (int mb = 0; mb < 2; ++mb) {
      h.write_dy(in[mb]);
      h.layer().backward(h.io(), h.stream());
      pipe[mb].dx = h.read().dx;
    }
    if (delay) {
      h.layer().backward_dw(h.stream());
      h.layer().backward_dw(h.stream());
    }
    h.layer().check_device_errors(h.stream());
    const LayerOutputs last = h.read();
    for (int mb = 0; mb < 2; ++mb) {
      EXPECT_TRUE(same_bits(pipe[mb].y, seq[mb].y)) << "micro-batch " << mb << " y";
      EXPECT_TRUE(same_bits(pipe[mb].dx, seq[mb].dx)) << "micro-batch " << mb << " dx";
    }
    EXPECT_TRUE(same_bits(last.dwr, seq[1].dwr)) << "router main_grad";
    EXPECT_TRUE(same_bits(last.dw1, seq[1].dw1)) << "main_grad1";
    EXPECT_TRUE(same_bits(last.dw2, seq[1].dw2)) << "main_grad2";
    EXPECT_TRUE(same_bits(last.db1, seq[1].db1) && same_bits(last.db2, seq[1].db2)) << "biases' gradients";
  }
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

std::vector<uint16_t> download16(const void* p, int64_t count) {
  std::vector<uint16_t> host(static_cast<std::size_t>(count));
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  MG_CUDA_CHECK(cudaMemcpy(host.data(), p, host.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  return host;
}

// MoeLayerIO's promise that rows at or past n of x, y and dy are never read or written, on which
// the PyTorch module relies (it passes tensors of n rows). Each of those buffers here ends where
// mapped memory ends, so an access past row n faults; the results must equal, bit for bit, those of
// the harness's buffers of max_tokens rows. (The router's logits GEMM, which runs over max_tokens
// rows, read x past row n until it read the router's own copy.)
TEST(MoeLayer, BuffersOfNTokenRowsSuffice) {
  const LayerCase c = kCases[1];  // 64 experts, top-8, aux loss, delayed wgrad
  LayerHarness h(options_of(c), 17);
  const int64_t n = c.max_tokens - 7, elements = n * c.hidden;
  const std::size_t bytes = static_cast<std::size_t>(elements) * sizeof(uint16_t);
  h.set_inputs(n);
  h.poison();
  h.layer().forward(h.io(), h.stream());
  const std::vector<uint16_t> y_infer = download16(h.io().y, elements);
  h.poison();
  h.train_step();
  const LayerOutputs full = h.read();
  const std::vector<uint16_t> y_train = download16(h.io().y, elements);

  testing::GuardedBuffer x(bytes), y(bytes), dy(bytes);
  MG_CUDA_CHECK(cudaMemcpy(x.get(), h.io().x, bytes, cudaMemcpyDeviceToDevice));
  MG_CUDA_CHECK(cudaMemcpy(dy.get(), h.io().dy, bytes, cudaMemcpyDeviceToDevice));
  MoeLayerIO io = h.io();
  io.x = x.get(), io.y = y.get(), io.dy = dy.get();
  MG_CUDA_CHECK(cudaMemset(y.get(), 0xff, bytes));  // NaN
  h.layer().forward(io, h.stream());
  EXPECT_EQ(download16(y.get(), elements), y_infer) << "inference forward";  // synchronizes: a fault shows here

  MG_CUDA_CHECK(cudaMemset(y.get(), 0xff, bytes));
  h.poison();
  h.layer().forward_train(io, h.stream());
  h.layer().backward(io, h.stream());
  if (c.delay) h.layer().backward_dw(h.stream());
  const LayerOutputs guarded = h.read();
  EXPECT_EQ(download16(y.get(), elements), y_train) << "training forward";
  EXPECT_TRUE(same_bits(guarded.dx, full.dx));
  EXPECT_TRUE(same_bits(guarded.dwr, full.dwr));
  EXPECT_TRUE(same_bits(guarded.dw1, full.dw1));
  EXPECT_TRUE(same_bits(guarded.dw2, full.dw2));
  EXPECT_EQ(guarded.aux, full.aux);
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

// A call refused for a missing pointer enqueues nothing and changes no state: the operators before
// the one that read the pointer used to run (FC1 and FC2 took slots, gradients were accumulated)
// and the layer's queues then disagreed with theirs. After each refusal the same steps give the
// bits of a layer that never saw one.
TEST(MoeLayer, ARefusedCallLeavesTheLayerAsItWas) {
  const LayerCase c = kCases[1];  // aux loss, delayed 16-bit dW
  LayerHarness refused(options_of(c), 11), clean(options_of(c), 11);
  for (LayerHarness* h : {&refused, &clean}) {
    h->set_inputs(c.max_tokens - 3);
    h->poison();
  }
  MoeLayer& layer = refused.layer();
  const cudaStream_t s = refused.stream();
  const MoeLayerIO io = refused.io();
  MoeLayerIO bad = io;
  bad.y = nullptr;
  EXPECT_THROW(layer.forward_train(bad, s), Error);
  bad = io, bad.aux_loss = nullptr;
  EXPECT_THROW(layer.forward_train(bad, s), Error);
  bad = io, bad.num_tokens = nullptr;
  EXPECT_THROW(layer.forward(bad, s), Error);
  EXPECT_EQ(layer.pending_backwards(), 0);
  layer.forward_train(io, s);
  bad = io, bad.dx = nullptr;
  EXPECT_THROW(layer.backward(bad, s), Error);
  MoeLayerWeights no_dw1 = refused.weights();
  no_dw1.dw1 = nullptr;
  layer.set_weights(no_dw1);
  EXPECT_THROW(layer.backward(io, s), Error) << "dw1 is missing";
  layer.set_weights(refused.weights());
  EXPECT_EQ(layer.pending_backwards(), 1);
  EXPECT_EQ(layer.queued_wgrads(), 0);
  refused.train_step();  // a whole step after the refusals, both forwards pending before backwards
  layer.backward(io, s);
  layer.backward_dw(s);
  clean.train_step();
  clean.train_step();
  EXPECT_TRUE(refused.read() == clean.read());
}

// FSDP2 gathers parameters into new storage for forward and again for backward. A layer re-bound
// (set_weights) between forward_train and backward, with a micro-batch saved, and again before the
// next step, gives the bits of a layer never moved; the old storage is poisoned, so any stale read
// shows. Cases: bias with fp32 main_grad; delayed 16-bit dW (moved after backward_dw).
TEST(MoeLayer, SetWeightsRebindsBetweenForwardAndBackward) {
  for (const LayerCase& c : {kCases[0], kCases[1]}) {
    LayerHarness moved(options_of(c), 11), fixed(options_of(c), 11);
    for (int step = 0; step < 2; ++step) {
      for (LayerHarness* h : {&moved, &fixed}) h->set_inputs(c.max_tokens - 3), h->poison();
      fixed.train_step();
      const MoeLayerIO io = moved.io();
      moved.layer().forward_train(io, moved.stream());
      moved.move_weights();
      moved.layer().backward(io, moved.stream());
      if (c.delay) moved.layer().backward_dw(moved.stream());
      moved.move_weights();
      const LayerOutputs got = moved.read();
      EXPECT_TRUE(got == fixed.read()) << c.name << " step " << step << ": a re-bound layer differs";
      moved.expect_matches_reference(got, detail::concat(c.name, " moved, step ", step));
    }
  }
}

// What set_weights refuses, changing nothing: a weight the layer was built with (or without), and
// gradient buffers moved under a queued delayed weight gradient, which writes where its backward
// said. Moving the weights alone is allowed then.
TEST(MoeLayer, SetWeightsRefusesWhatTheLayerCannotFollow) {
  const auto refused = [](auto&& f, const char* text) {
    const std::string message = thrown_message(f);
    EXPECT_NE(message.find(text), std::string::npos) << "expected \"" << text << "\", got: " << message;
  };
  const LayerCase c = kCases[1];  // no bias, delayed wgrad
  LayerHarness h(options_of(c), 5), fixed(options_of(c), 5);
  MoeLayerWeights w = h.weights();
  w.w2 = nullptr;
  refused([&] { h.layer().set_weights(w); }, "w2 was set at creation and must stay set");
  w = h.weights();
  w.b1 = w.w1;
  refused([&] { h.layer().set_weights(w); }, "b1 was null at creation and must stay null");
  for (LayerHarness* x : {&h, &fixed}) x->set_inputs(20), x->poison();
  fixed.train_step();
  h.layer().forward_train(h.io(), h.stream());
  h.layer().backward(h.io(), h.stream());
  refused([&] { h.move_weights(); }, "delayed weight gradients are queued");
  h.move_weights(/*gradients=*/false);
  h.layer().backward_dw(h.stream());
  EXPECT_TRUE(h.read() == fixed.read()) << "refused or weight-only moves changed the results";
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
  // Micro-batches in flight finish the way they started: the graphs pin each slot's saved tensors
  // and the eager layer keeps its own slot order, so a mix would pair contexts wrongly.
  step.forward_train(b, s);
  EXPECT_THROW(step.run_eager(b, StepPhase::kBackward, s), Error);
  EXPECT_THROW(step.run_eager(b, StepPhase::kForwardTrain, s), Error);
  step.backward(b, s);
  EXPECT_THROW(step.run_eager(b, StepPhase::kWgrad, s), Error);
  step.wgrad(b, s);
  step.run_eager(b, StepPhase::kForwardTrain, s);
  EXPECT_THROW(step.backward(b, s), Error);
  step.run_eager(b, StepPhase::kBackward, s);
  step.run_eager(b, StepPhase::kWgrad, s);
  step.check_device_errors(s);
}

INSTANTIATE_TEST_SUITE_P(Recipes, MoeLayerStep, ::testing::Values(Recipe::kBF16, Recipe::kMXFP8));

}  // namespace
}  // namespace moegraph::test
