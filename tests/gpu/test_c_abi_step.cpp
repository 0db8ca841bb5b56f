// The C ABI on the GPU: a step created from JSON through mg_step_graphs_* against the C++
// StepGraphs on identical weights (bit for bit, every phase, graphs and eager), its refusals on a
// live and on a destroyed handle, device errors through check_device_errors, and thread-local
// capture. Expert parallelism through the C ABI is in test_c_abi_ep_gpu.cpp, GroupedLinear and
// MXFP8 weights in test_c_abi_linear_gpu.cpp.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "moegraph/config.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/moegraph.h"
#include "moegraph/mxfp8_weights.hpp"
#include "moegraph/step_graphs.hpp"
#include "testing/graph.hpp"
#include "testing/step_weights.hpp"
#include "tests/common/expect.hpp"
#include "tests/gpu/c_abi_gpu_helpers.hpp"

namespace moegraph::test {
namespace {

using namespace c_abi_gpu;

// A small whole layer trained with delayed wgrad on two slots, two buckets.
constexpr const char* kTrainingConfig = R"({
  "name": "c_abi_training",
  "layer": {"experts": 8, "hidden": 256, "ffn": 256, "top_k": 2, "bias": true},
  "router": {"score": "softmax", "renormalize": true, "aux_loss_coef": 0.01},
  "training": {"enabled": true, "delay_wgrad": true, "wgrad_slots": 2, "main_grad_fp32": true},
  "buckets": [64, 128]})";
// Smaller ones, for the refusals: training with wgrad at once, and inference.
constexpr const char* kImmediateConfig = R"({
  "layer": {"experts": 4, "hidden": 128, "ffn": 64, "top_k": 2},
  "training": {"enabled": true, "delay_wgrad": false}, "buckets": [32]})";
constexpr const char* kInferenceConfig = R"({
  "layer": {"experts": 4, "hidden": 128, "ffn": 64, "top_k": 2},
  "training": {"enabled": false}, "buckets": [32]})";

constexpr mg_phase kTrainingPhases[] = {MG_PHASE_FORWARD_TRAIN, MG_PHASE_BACKWARD, MG_PHASE_WGRAD};

// ---- Steps ----------------------------------------------------------------------------------------

mg_step_weights c_weights(const StepWeights& w) {
  mg_step_weights c = sized<mg_step_weights>();
  c.router = w.router, c.main_grad_router = w.main_grad_router, c.d_router = w.d_router;
  c.w1 = w.w1, c.w2 = w.w2, c.b1 = w.b1, c.b2 = w.b2;
  c.main_grad1 = w.main_grad1, c.main_grad2 = w.main_grad2;
  c.dw1 = w.dw1, c.dw2 = w.dw2, c.db1 = w.db1, c.db2 = w.db2;
  return c;
}

// A step made the way a C caller makes one: config text parsed by mg_config_parse, the caller's
// weights (make_step_weights for the same config) handed over in an mg_step_weights.
class CStep {
 public:
  CStep(const char* json, const mg_step_graphs_options* options, cudaStream_t stream)
      : options_(step_graphs_options(parse_config(json, "<test>"))),
        weights_(testing::make_step_weights(options_, stream)) {
    mg_config* config = nullptr;
    ok(mg_config_parse(json, &config));
    const std::unique_ptr<mg_config, void (*)(mg_config*)> owned(config, mg_config_destroy);
    const mg_step_weights w = c_weights(weights_.weights);
    ok(mg_step_graphs_create(config, &w, options, &step_));  // the step keeps no reference to the config
  }
  ~CStep() { mg_step_graphs_destroy(step_); }
  CStep(const CStep&) = delete;
  CStep& operator=(const CStep&) = delete;

  mg_step_graphs* handle() const { return step_; }
  const StepGraphsOptions& options() const { return options_; }
  const MoeLayerOptions& layer() const { return options_.layer; }
  const StepWeights& weights() const { return weights_.weights; }
  mg_bucket_io io(int bucket) const {
    mg_bucket_io io = sized<mg_bucket_io>();
    ok(mg_step_graphs_io(step_, bucket, &io));
    return io;
  }
  // Destroys the step; returns its handle, no longer live.
  mg_step_graphs* destroy() {
    mg_step_graphs_destroy(step_);
    return std::exchange(step_, nullptr);
  }

 private:
  StepGraphsOptions options_;
  testing::OwnedStepWeights weights_;  // outlives the step (destroyed in ~CStep before it)
  mg_step_graphs* step_ = nullptr;
};

// The C++ runtime on its own weights and gradients, made the same way.
struct CppStep {
  CppStep(const StepGraphsOptions& o, cudaStream_t s)
      : weights(testing::make_step_weights(o, s)), step(o, weights.weights) {}
  testing::OwnedStepWeights weights;
  StepGraphs step;
};

struct StepInputs {
  std::vector<uint16_t> x, dy;  // every row of the bucket
  int32_t tokens = 0;
};
StepInputs random_inputs(std::mt19937_64& rng, int64_t capacity, int64_t hidden, int32_t tokens) {
  StepInputs in;
  in.x = random_bf16(rng, capacity * hidden, 1.0);
  in.dy = random_bf16(rng, capacity * hidden, 1.0);
  in.tokens = tokens;
  return in;
}

// IO is mg_bucket_io or BucketIO: the same fields.
template <class IO>
void write_inputs(const IO& io, const StepInputs& in, cudaStream_t s) {
  to_device(io.x, in.x, s);
  if (io.dy != nullptr) to_device(io.dy, in.dy, s);
  to_device(io.num_tokens, std::vector<int32_t>{in.tokens}, s);
}
// NaN in everything a training step writes; fp32 main_grad back to zero (it is accumulated into).
template <class IO>
void reset_outputs(const IO& io, const StepWeights& w, const MoeLayerOptions& l, cudaStream_t s) {
  poison(io.y, io.tokens * l.hidden * 2, s);
  poison(io.dx, io.tokens * l.hidden * 2, s);
  poison(io.aux_loss, 4, s);
  poison(w.db1, l.experts * 2 * l.ffn * 2, s);
  poison(w.db2, l.experts * l.hidden * 2, s);
  MG_CUDA_CHECK(cudaMemsetAsync(w.main_grad_router, 0, l.experts * l.hidden * 4, s));
  MG_CUDA_CHECK(cudaMemsetAsync(w.main_grad1, 0, l.experts * 2 * l.ffn * l.hidden * 4, s));
  MG_CUDA_CHECK(cudaMemsetAsync(w.main_grad2, 0, l.experts * l.hidden * l.ffn * 4, s));
}

// What a training step produces, as bits: y and dx of the step's tokens only.
struct StepResult {
  std::vector<uint16_t> y, dx, db1, db2;
  std::vector<uint32_t> aux, main_grad_router, main_grad1, main_grad2;
};
template <class IO>
StepResult read_result(const IO& io, const StepWeights& w, const MoeLayerOptions& l, int32_t tokens, cudaStream_t s) {
  StepResult r;
  r.y = to_host<uint16_t>(io.y, tokens * l.hidden, s);
  r.dx = to_host<uint16_t>(io.dx, tokens * l.hidden, s);
  r.db1 = to_host<uint16_t>(w.db1, l.experts * 2 * l.ffn, s);
  r.db2 = to_host<uint16_t>(w.db2, l.experts * l.hidden, s);
  r.aux = to_host<uint32_t>(io.aux_loss, 1, s);
  r.main_grad_router = to_host<uint32_t>(w.main_grad_router, l.experts * l.hidden, s);
  r.main_grad1 = to_host<uint32_t>(w.main_grad1, l.experts * 2 * l.ffn * l.hidden, s);
  r.main_grad2 = to_host<uint32_t>(w.main_grad2, l.experts * l.hidden * l.ffn, s);
  return r;
}

void expect_same(const StepResult& a, const StepResult& b, const std::string& where) {
  EXPECT_TRUE(identical(a.y, b.y)) << where << ": y";
  EXPECT_TRUE(identical(a.dx, b.dx)) << where << ": dx";
  EXPECT_TRUE(identical(a.db1, b.db1)) << where << ": db1";
  EXPECT_TRUE(identical(a.db2, b.db2)) << where << ": db2";
  EXPECT_TRUE(identical(a.aux, b.aux)) << where << ": aux_loss";
  EXPECT_TRUE(identical(a.main_grad_router, b.main_grad_router)) << where << ": main_grad_router";
  EXPECT_TRUE(identical(a.main_grad1, b.main_grad1)) << where << ": main_grad1";
  EXPECT_TRUE(identical(a.main_grad2, b.main_grad2)) << where << ": main_grad2";
}

// The step computed something: no poison left, a positive aux loss, gradients accumulated. (Two
// steps that both enqueued nothing would compare equal.)
void expect_written(const StepResult& r) {
  EXPECT_EQ(nan_count(r.y), 0u);
  EXPECT_EQ(nan_count(r.dx), 0u);
  EXPECT_EQ(nan_count(r.db1) + nan_count(r.db2), 0u);
  const float aux = std::bit_cast<float>(r.aux[0]);
  EXPECT_TRUE(std::isfinite(aux) && aux > 0.0f) << "aux_loss " << aux;
  EXPECT_TRUE(any_nonzero(r.main_grad_router) && any_nonzero(r.main_grad1) && any_nonzero(r.main_grad2));
  EXPECT_EQ(nan_count(r.main_grad_router) + nan_count(r.main_grad1) + nan_count(r.main_grad2), 0u);
}

// y of an inference forward of `tokens` tokens (poisoned first), replayed or eager.
std::vector<uint16_t> forward_y(const CStep& c, int bucket, int32_t tokens, bool graph, cudaStream_t s) {
  const mg_bucket_io io = c.io(bucket);
  poison(io.y, io.tokens * c.layer().hidden * 2, s);
  ok(graph ? mg_step_graphs_replay(c.handle(), bucket, MG_PHASE_FORWARD, s)
           : mg_step_graphs_run_eager(c.handle(), bucket, MG_PHASE_FORWARD, s));
  ok(mg_step_graphs_check_device_errors(c.handle(), s));
  return to_host<uint16_t>(io.y, tokens * c.layer().hidden, s);
}

// ---- The C step against the C++ one ----------------------------------------------------------------

TEST(CAbiStepGraphsGpu, TrainingStepMatchesTheCppStepBitForBit) {
  Stream stream;
  const cudaStream_t s = stream.get();
  CStep c(kTrainingConfig, nullptr, s);
  CppStep cpp(c.options(), s);
  const MoeLayerOptions& l = c.layer();
  const std::size_t w1_count = l.experts * 2 * l.ffn * l.hidden;
  ASSERT_TRUE(identical(to_host<uint16_t>(c.weights().w1, w1_count, s),
                        to_host<uint16_t>(cpp.weights.weights.w1, w1_count, s)))
      << "both steps need the same weights for the comparison to mean anything";

  int buckets = 0;
  ok(mg_step_graphs_num_buckets(c.handle(), &buckets));
  ASSERT_EQ(buckets, 2);
  ASSERT_EQ(buckets, cpp.step.num_buckets());
  for (int b = 0; b < buckets; ++b) {
    SCOPED_TRACE(detail::concat("bucket ", b));
    int64_t tokens = 0;
    ok(mg_step_graphs_bucket_tokens(c.handle(), b, &tokens));
    EXPECT_EQ(tokens, c.options().buckets[b]);
    const mg_bucket_io io = c.io(b);
    const BucketIO want = cpp.step.io(b);
    EXPECT_EQ(io.struct_size, sizeof(mg_bucket_io));
    EXPECT_EQ(io.tokens, tokens);
    EXPECT_EQ(io.tokens, want.tokens);
    EXPECT_EQ(io.rows, want.rows);
    EXPECT_GE(io.rows, io.tokens * l.top_k);
    const std::pair<const char*, const void*> buffers[] = {
        {"x", io.x}, {"num_tokens", io.num_tokens}, {"aux_loss", io.aux_loss},
        {"y", io.y}, {"dy", io.dy}, {"dx", io.dx}};
    for (const auto& [name, p] : buffers) EXPECT_NE(p, nullptr) << name;
    EXPECT_EQ(io.splits, nullptr) << "the whole layer's router makes the splits";
    EXPECT_EQ(want.splits, nullptr);
  }

  const int32_t n = 100;  // fewer than the larger bucket's 128 tokens
  int b = -1;
  ok(mg_step_graphs_bucket_for(c.handle(), n, &b));
  ASSERT_EQ(b, 1);
  ASSERT_EQ(b, cpp.step.bucket_for(n));
  const mg_bucket_io cio = c.io(b);
  const BucketIO pio = cpp.step.io(b);
  std::mt19937_64 rng(test_seed("CAbiStepGraphsGpu.TrainingStepMatchesTheCppStepBitForBit"));
  const StepInputs in = random_inputs(rng, cio.tokens, l.hidden, n);
  write_inputs(cio, in, s);
  write_inputs(pio, in, s);

  // forward_train, backward, wgrad: replayed graphs on both sides.
  reset_outputs(cio, c.weights(), l, s);
  reset_outputs(pio, cpp.weights.weights, l, s);
  for (mg_phase phase : kTrainingPhases) ok(mg_step_graphs_replay(c.handle(), b, phase, s));
  cpp.step.forward_train(b, s);
  cpp.step.backward(b, s);
  cpp.step.wgrad(b, s);
  ok(mg_step_graphs_check_device_errors(c.handle(), s));
  cpp.step.check_device_errors(s);
  const StepResult replayed = read_result(cio, c.weights(), l, n, s);
  expect_written(replayed);
  expect_same(replayed, read_result(pio, cpp.weights.weights, l, n, s), "C replay vs C++ replay");

  // Inference forward: the C++ step's y, forward_train's y, and the same eagerly.
  const std::vector<uint16_t> y = forward_y(c, b, n, /*graph=*/true, s);
  poison(pio.y, pio.tokens * l.hidden * 2, s);
  cpp.step.forward(b, s);
  EXPECT_TRUE(identical(y, to_host<uint16_t>(pio.y, n * l.hidden, s))) << "inference forward: C vs C++";
  EXPECT_TRUE(identical(y, replayed.y)) << "inference forward vs forward_train";
  EXPECT_TRUE(identical(forward_y(c, b, n, /*graph=*/false, s), y)) << "inference forward: eager vs replay";

  // The training phases without graphs.
  reset_outputs(cio, c.weights(), l, s);
  for (mg_phase phase : kTrainingPhases) ok(mg_step_graphs_run_eager(c.handle(), b, phase, s));
  ok(mg_step_graphs_check_device_errors(c.handle(), s));
  expect_same(read_result(cio, c.weights(), l, n, s), replayed, "C eager vs C replay");
}

// ---- Refusals --------------------------------------------------------------------------------------

TEST(CAbiStepGraphsGpu, RefusesUnknownBucketsPhasesAndMissingOutputs) {
  Stream stream;
  const cudaStream_t s = stream.get();
  CStep c(kTrainingConfig, nullptr, s);
  mg_step_graphs* h = c.handle();
  for (int bucket : {-1, 2}) {
    const std::string named = detail::concat("bucket index ", bucket, " out of range [0, 2)");
    EXPECT_EQ(mg_step_graphs_replay(h, bucket, MG_PHASE_FORWARD, s), MG_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(last_error_has(named)) << mg_last_error();
    EXPECT_EQ(mg_step_graphs_run_eager(h, bucket, MG_PHASE_FORWARD_TRAIN, s), MG_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(last_error_has(named)) << mg_last_error();
    int64_t tokens = 0;
    EXPECT_EQ(mg_step_graphs_bucket_tokens(h, bucket, &tokens), MG_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(last_error_has(named)) << mg_last_error();
    mg_bucket_io io = sized<mg_bucket_io>();
    EXPECT_EQ(mg_step_graphs_io(h, bucket, &io), MG_ERR_INVALID_ARGUMENT);
  }
  for (int phase : {7, -1}) {
    const std::string named = detail::concat("got ", phase);
    EXPECT_EQ(mg_step_graphs_replay(h, 0, static_cast<mg_phase>(phase), s), MG_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(last_error_has(named)) << mg_last_error();
    EXPECT_EQ(mg_step_graphs_run_eager(h, 0, static_cast<mg_phase>(phase), s), MG_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(last_error_has(named)) << mg_last_error();
  }

  // As StepGraphs::bucket_for: the smallest bucket that holds the count, 0 tokens included.
  int b = -1;
  for (auto [tokens, bucket] : {std::pair<int64_t, int>{0, 0}, {1, 0}, {64, 0}, {65, 1}, {128, 1}}) {
    ok(mg_step_graphs_bucket_for(h, tokens, &b));
    EXPECT_EQ(b, bucket) << tokens << " tokens";
  }
  EXPECT_EQ(mg_step_graphs_bucket_for(h, 129, &b), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("129 tokens exceed the largest bucket (128 tokens)")) << mg_last_error();
  EXPECT_EQ(mg_step_graphs_bucket_for(h, -1, &b), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("token count must be non-negative, got -1")) << mg_last_error();

  EXPECT_EQ(mg_step_graphs_num_buckets(h, nullptr), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_step_graphs_bucket_tokens(h, 0, nullptr), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_step_graphs_bucket_for(h, 1, nullptr), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_step_graphs_io(h, 0, nullptr), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_step_graphs_read_dropped(h, s, nullptr), MG_ERR_INVALID_ARGUMENT);
  mg_bucket_io unsized{};
  EXPECT_EQ(mg_step_graphs_io(h, 0, &unsized), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("mg_bucket_io.struct_size must be sizeof(mg_bucket_io)")) << mg_last_error();
  EXPECT_EQ(unsized.x, nullptr) << "a refused struct is not written";

  // Buckets share one arena: while bucket 1 holds a training context, bucket 0 and inference wait.
  std::mt19937_64 rng(test_seed("CAbiStepGraphsGpu.RefusesUnknownBucketsPhasesAndMissingOutputs"));
  write_inputs(c.io(1), random_inputs(rng, 128, c.layer().hidden, 50), s);
  ok(mg_step_graphs_replay(h, 1, MG_PHASE_FORWARD_TRAIN, s));
  EXPECT_EQ(mg_step_graphs_replay(h, 0, MG_PHASE_FORWARD_TRAIN, s), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("buckets share one arena")) << mg_last_error();
  EXPECT_EQ(mg_step_graphs_replay(h, 1, MG_PHASE_FORWARD, s), MG_ERR_INVALID_ARGUMENT);
  ok(mg_step_graphs_replay(h, 1, MG_PHASE_BACKWARD, s));
  ok(mg_step_graphs_replay(h, 1, MG_PHASE_WGRAD, s));
  EXPECT_EQ(mg_step_graphs_replay(h, 1, MG_PHASE_WGRAD, s), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("without a queued backward")) << mg_last_error();

  // Nothing refused was enqueued or left pending: the step runs on, with no device error. (Bucket 0's
  // inputs are written again: bucket 1 ran over the shared arena.)
  write_inputs(c.io(0), random_inputs(rng, 64, c.layer().hidden, 30), s);
  EXPECT_EQ(nan_count(forward_y(c, 0, 30, /*graph=*/true, s)), 0u);
  uint64_t dropped = 7;
  ok(mg_step_graphs_read_dropped(h, s, &dropped));
  EXPECT_EQ(dropped, 0u) << "dropless";
}

TEST(CAbiStepGraphsGpu, RefusesWgradWithoutDelayAndBackwardWithoutForward) {
  Stream stream;
  const cudaStream_t s = stream.get();
  CStep c(kImmediateConfig, nullptr, s);
  mg_step_graphs* h = c.handle();
  std::mt19937_64 rng(test_seed("CAbiStepGraphsGpu.RefusesWgradWithoutDelayAndBackwardWithoutForward"));
  write_inputs(c.io(0), random_inputs(rng, 32, c.layer().hidden, 20), s);
  EXPECT_EQ(mg_step_graphs_replay(h, 0, MG_PHASE_WGRAD, s), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("wgrad needs training.delay_wgrad")) << mg_last_error();
  EXPECT_EQ(mg_step_graphs_run_eager(h, 0, MG_PHASE_WGRAD, s), MG_ERR_INVALID_ARGUMENT);
  for (bool graph : {true, false}) {
    EXPECT_EQ(graph ? mg_step_graphs_replay(h, 0, MG_PHASE_BACKWARD, s)
                    : mg_step_graphs_run_eager(h, 0, MG_PHASE_BACKWARD, s),
              MG_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(last_error_has("backward of bucket 0 without a forward_train")) << mg_last_error();
  }
  ok(mg_step_graphs_replay(h, 0, MG_PHASE_FORWARD_TRAIN, s));
  ok(mg_step_graphs_replay(h, 0, MG_PHASE_BACKWARD, s));
  EXPECT_EQ(mg_step_graphs_replay(h, 0, MG_PHASE_BACKWARD, s), MG_ERR_INVALID_ARGUMENT) << "one backward per forward";
  EXPECT_EQ(mg_step_graphs_replay(h, 0, MG_PHASE_WGRAD, s), MG_ERR_INVALID_ARGUMENT);
  ok(mg_step_graphs_check_device_errors(h, s));
}

TEST(CAbiStepGraphsGpu, ReportsAnInvalidTokenCountOnceThenRunsAgain) {
  Stream stream;
  const cudaStream_t s = stream.get();
  CStep c(kInferenceConfig, nullptr, s);
  mg_step_graphs* h = c.handle();
  const mg_bucket_io io = c.io(0);
  ASSERT_EQ(io.tokens, 32);
  std::mt19937_64 rng(test_seed("CAbiStepGraphsGpu.ReportsAnInvalidTokenCountOnceThenRunsAgain"));
  const StepInputs in = random_inputs(rng, io.tokens, c.layer().hidden, 20);
  write_inputs(io, in, s);
  for (int32_t bad : {37, -1}) {
    to_device(io.num_tokens, std::vector<int32_t>{bad}, s);
    ok(mg_step_graphs_replay(h, 0, MG_PHASE_FORWARD, s));  // enqueued: the device records the count
    EXPECT_EQ(mg_step_graphs_check_device_errors(h, s), MG_ERR_DEVICE_SPLITS) << bad;
    EXPECT_TRUE(last_error_has(detail::concat("num_tokens = ", bad, " is outside [0, 32]"))) << mg_last_error();
    EXPECT_TRUE(last_error_has("bucket of 32 tokens")) << mg_last_error();
    EXPECT_EQ(mg_step_graphs_check_device_errors(h, s), MG_OK) << "reported once, then cleared: " << mg_last_error();
  }
  to_device(io.num_tokens, std::vector<int32_t>{in.tokens}, s);
  EXPECT_EQ(nan_count(forward_y(c, 0, in.tokens, /*graph=*/true, s)), 0u) << "a valid count runs again";
  EXPECT_EQ(mg_step_graphs_replay(h, 0, MG_PHASE_FORWARD_TRAIN, s), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("needs training.enabled")) << mg_last_error();
}

TEST(CAbiStepGraphsGpu, ADestroyedStepRefusesEveryCall) {
  Stream stream;
  const cudaStream_t s = stream.get();
  CStep c(kInferenceConfig, nullptr, s);
  mg_step_graphs* gone = c.destroy();
  int count = 0;
  int64_t tokens = 0;
  uint64_t dropped = 0;
  mg_bucket_io io = sized<mg_bucket_io>();
  const std::vector<std::pair<const char*, std::function<mg_status()>>> calls = {
      {"num_buckets", [&] { return mg_step_graphs_num_buckets(gone, &count); }},
      {"bucket_tokens", [&] { return mg_step_graphs_bucket_tokens(gone, 0, &tokens); }},
      {"bucket_for", [&] { return mg_step_graphs_bucket_for(gone, 1, &count); }},
      {"io", [&] { return mg_step_graphs_io(gone, 0, &io); }},
      {"replay", [&] { return mg_step_graphs_replay(gone, 0, MG_PHASE_FORWARD, s); }},
      {"run_eager", [&] { return mg_step_graphs_run_eager(gone, 0, MG_PHASE_FORWARD, s); }},
      {"weights_changed", [&] { return mg_step_graphs_weights_changed(gone, s); }},
      {"check_device_errors", [&] { return mg_step_graphs_check_device_errors(gone, s); }},
      {"read_dropped", [&] { return mg_step_graphs_read_dropped(gone, s, &dropped); }},
  };
  for (int round = 0; round < 2; ++round) {
    for (const auto& [name, call] : calls) {
      EXPECT_EQ(call(), MG_ERR_INVALID_HANDLE) << name << (round ? " after a second destroy" : "");
      EXPECT_TRUE(last_error_has("mg_step_graphs handle that is not live")) << name << ": " << mg_last_error();
    }
    mg_step_graphs_destroy(gone);  // again: nothing happens
  }
}

// ---- Thread-local capture --------------------------------------------------------------------------

// In global mode another thread's allocation during the capture is refused (and invalidates it);
// thread-local mode allows it. A helper thread sets up and synchronizes throughout the create, as a
// server's other threads would.
TEST(CAbiStepGraphsGpu, ThreadLocalCaptureLetsAnotherThreadAllocateAndReplaysTheSame) {
  Stream stream;
  const cudaStream_t s = stream.get();
  int device = 0;
  MG_CUDA_CHECK(cudaGetDevice(&device));
  std::atomic<bool> done{false};
  std::atomic<int> rounds{0};
  cudaError_t helper_error = cudaSuccess;
  std::thread helper([&] {
    constexpr std::size_t kBytes = 4096, kMaxKept = 16384;  // at most 64 MiB, freed once the create ends
    std::vector<void*> kept;
    cudaStream_t own = nullptr;
    auto work = [&]() -> cudaError_t {
      if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return e;
      if (cudaError_t e = cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking); e != cudaSuccess) return e;
      for (; !done; ++rounds, std::this_thread::sleep_for(std::chrono::microseconds(100))) {
        if (kept.size() < kMaxKept) {
          void* p = nullptr;
          if (cudaError_t e = cudaMalloc(&p, kBytes); e != cudaSuccess) return e;
          kept.push_back(p);
        }
        if (cudaError_t e = cudaMemsetAsync(kept.back(), 0, kBytes, own); e != cudaSuccess) return e;
        if (cudaError_t e = cudaStreamSynchronize(own); e != cudaSuccess) return e;
      }
      return cudaSuccess;
    };
    helper_error = work();
    ++rounds;  // also when it failed at once, so the wait below ends
    while (!done) std::this_thread::yield();  // frees nothing while the create may be capturing
    for (void* p : kept) cudaFree(p);
    if (own != nullptr) cudaStreamDestroy(own);
  });
  while (rounds == 0) std::this_thread::yield();  // the helper is under way before the create starts
  mg_step_graphs_options options = sized<mg_step_graphs_options>();
  options.thread_local_capture = 1;
  std::unique_ptr<CStep> local;
  std::string create_error;
  try {
    local = std::make_unique<CStep>(kTrainingConfig, &options, s);
  } catch (const std::exception& e) {
    create_error = e.what();
  }
  done = true;
  helper.join();
  EXPECT_EQ(helper_error, cudaSuccess) << "the helper thread's calls failed: " << cudaGetErrorString(helper_error);
  ASSERT_EQ(create_error, "");

  CStep global(kTrainingConfig, nullptr, s);
  std::mt19937_64 rng(test_seed("CAbiStepGraphsGpu.ThreadLocalCaptureLetsAnotherThreadAllocateAndReplaysTheSame"));
  const int32_t n = 90;
  int b = -1;
  ok(mg_step_graphs_bucket_for(local->handle(), n, &b));
  const StepInputs in = random_inputs(rng, local->io(b).tokens, local->layer().hidden, n);
  write_inputs(local->io(b), in, s);
  write_inputs(global.io(b), in, s);
  const std::vector<uint16_t> y = forward_y(*local, b, n, /*graph=*/true, s);
  EXPECT_EQ(nan_count(y), 0u);
  EXPECT_TRUE(identical(y, forward_y(global, b, n, /*graph=*/true, s))) << "thread-local vs global capture";
}

}  // namespace
}  // namespace moegraph::test
