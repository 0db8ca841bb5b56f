// The C ABI on the GPU: a step created from JSON through mg_step_graphs_* against the C++
// StepGraphs on identical weights (bit for bit, every phase, graphs and eager), its refusals on a
// live and on a destroyed handle, device errors through check_device_errors, thread-local capture,
// a GroupedLinear on a caller's workspace against one on its own, two expert-parallel ranks
// (mg_ep_emulated_group_create, mg_moe_layer_create_ep) against one layer holding every expert, and
// MXFP8 weights the caller quantized (mg_quantize_mxfp8_weights, prequantized_weights) against the
// operators' own quantization.
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

namespace moegraph::test {
namespace {

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

// Throws with the C ABI's last error unless `status` is MG_OK (the test then fails, naming it).
void ok(mg_status status) {
  if (status != MG_OK) throw std::runtime_error(std::string(mg_status_string(status)) + ": " + mg_last_error());
}
bool last_error_has(const std::string& part) { return std::string(mg_last_error()).find(part) != std::string::npos; }

template <class T>
T sized() {
  T t{};
  t.struct_size = sizeof(T);
  return t;
}

// Stream-ordered copies; each waits, so host vectors may go away after it.
template <class T>
void to_device(void* dst, const std::vector<T>& v, cudaStream_t s) {
  MG_CUDA_CHECK(cudaMemcpyAsync(dst, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, s));
  MG_CUDA_CHECK(cudaStreamSynchronize(s));
}
template <class T>
std::vector<T> to_host(const void* src, std::size_t count, cudaStream_t s) {
  std::vector<T> v(count);
  MG_CUDA_CHECK(cudaMemcpyAsync(v.data(), src, count * sizeof(T), cudaMemcpyDeviceToHost, s));
  MG_CUDA_CHECK(cudaStreamSynchronize(s));
  return v;
}
// All-ones bytes: NaN in bf16 and fp32.
void poison(void* p, std::size_t bytes, cudaStream_t s) { MG_CUDA_CHECK(cudaMemsetAsync(p, 0xff, bytes, s)); }

std::vector<uint16_t> random_bf16(std::mt19937_64& rng, std::size_t count, double scale) {
  return to_device_bits(random_values(rng, count, scale, DType::kBF16), DType::kBF16);
}
std::vector<float> random_fp32(std::mt19937_64& rng, std::size_t count, double scale) {
  const auto v = random_values(rng, count, scale, DType::kFP32);
  return std::vector<float>(v.begin(), v.end());
}
std::vector<uint32_t> bits_of(const std::vector<float>& v) {
  std::vector<uint32_t> out(v.size());
  std::transform(v.begin(), v.end(), out.begin(), [](float f) { return std::bit_cast<uint32_t>(f); });
  return out;
}

std::size_t nan_count(const std::vector<uint16_t>& bf16) {
  return std::count_if(bf16.begin(), bf16.end(), [](uint16_t b) { return (b & 0x7fff) > 0x7f80; });
}
std::size_t nan_count(const std::vector<uint32_t>& fp32) {
  return std::count_if(fp32.begin(), fp32.end(), [](uint32_t b) { return (b & 0x7fffffffu) > 0x7f800000u; });
}
template <class T>
bool any_nonzero(const std::vector<T>& v) {
  return std::any_of(v.begin(), v.end(), [](T b) { return b != 0; });
}

// Bit-for-bit equality, naming how many elements differ and the first.
template <class T>
::testing::AssertionResult identical(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << a.size() << " vs " << b.size() << " elements";
  std::size_t first = 0, count = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i] && count++ == 0) first = i;
  if (count == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << count << " of " << a.size() << " elements differ, the first at " << first
                                       << ": 0x" << std::hex << +a[first] << " vs 0x" << +b[first];
}

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

// ---- GroupedLinear on a caller's workspace ---------------------------------------------------------

struct LinearCase {
  mg_grouped_linear_options options;
  std::vector<int32_t> splits;
  int64_t used_rows = 0;
  std::vector<uint16_t> x, weight, bias, dy;
  std::vector<float> bias_scale, main_grad;
};

LinearCase linear_case(std::mt19937_64& rng) {
  LinearCase c;
  mg_grouped_linear_options_init(&c.options);
  mg_grouped_linear_options& o = c.options;
  o.num_groups = 5, o.in_features = 128, o.out_features = 192, o.capacity_rows = 160, o.bias = 1;
  c.splits = {37, 0, 61, 1, 44};  // uneven, an empty group, a single row: 143 of 160 rows
  c.used_rows = 143;
  const int64_t rows = o.capacity_rows, k = o.in_features, n = o.out_features, g = o.num_groups;
  c.x = random_bf16(rng, rows * k, 1.0);
  c.weight = random_bf16(rng, g * n * k, 1.0 / std::sqrt(double(k)));
  c.bias = random_bf16(rng, g * n, 0.1);
  c.dy = random_bf16(rng, rows * n, 1.0);
  c.bias_scale = random_fp32(rng, rows, 1.0);
  c.main_grad = random_fp32(rng, g * n * k, 1.0);  // accumulated into
  return c;
}

struct LinearResult {
  std::vector<uint16_t> y, dx, dbias;            // y and dx: the used rows
  std::vector<uint32_t> dbias_scale, main_grad;  // dbias_scale: the used rows
};

// forward_train, then backward with the wgrad at once, on a new operator over `workspace` (NULL:
// its own); every output poisoned first.
LinearResult run_linear(const LinearCase& c, void* workspace) {
  const mg_grouped_linear_options& o = c.options;
  const std::size_t rows = o.capacity_rows, k = o.in_features, n = o.out_features, g = o.num_groups;
  DeviceArray<int32_t> splits(g);
  DeviceArray<uint16_t> x(rows * k), w(g * n * k), b(g * n), dy(rows * n), y(rows * n), dx(rows * k), db(g * n);
  DeviceArray<float> scale(rows), dscale(rows), main_grad(g * n * k);
  splits.upload(c.splits), x.upload(c.x), w.upload(c.weight), b.upload(c.bias), dy.upload(c.dy);
  scale.upload(c.bias_scale), main_grad.upload(c.main_grad);
  y.poison(), dx.poison(), db.poison(), dscale.poison();

  mg_grouped_linear* op = nullptr;
  ok(mg_grouped_linear_create(&o, workspace, &op));
  const std::unique_ptr<mg_grouped_linear, void (*)(mg_grouped_linear*)> owned(op, mg_grouped_linear_destroy);
  mg_forward_args f = sized<mg_forward_args>();
  f.x = x.get(), f.splits = splits.get(), f.weight = w.get(), f.bias = b.get(), f.bias_scale = scale.get();
  f.y = y.get();
  ok(mg_grouped_linear_forward(op, &f, /*train=*/1, nullptr));
  mg_backward_args bw = sized<mg_backward_args>();
  bw.dy = dy.get(), bw.weight = w.get(), bw.bias = b.get(), bw.dx = dx.get(), bw.dbias = db.get();
  bw.dbias_scale = dscale.get(), bw.main_grad = main_grad.get();
  ok(mg_grouped_linear_backward(op, &bw, /*delay_wgrad=*/0, nullptr));
  ok(mg_grouped_linear_check_device_errors(op, nullptr));

  const std::size_t used = c.used_rows;
  LinearResult r;
  r.y = y.download(), r.y.resize(used * n);
  r.dx = dx.download(), r.dx.resize(used * k);
  r.dbias = db.download();
  r.dbias_scale = bits_of(dscale.download()), r.dbias_scale.resize(used);
  r.main_grad = bits_of(main_grad.download());
  return r;
}

TEST(CAbiGroupedLinearGpu, CallerWorkspaceGivesTheResultsOfItsOwnWorkspace) {
  std::mt19937_64 rng(test_seed("CAbiGroupedLinearGpu.CallerWorkspaceGivesTheResultsOfItsOwnWorkspace"));
  const LinearCase c = linear_case(rng);
  std::size_t bytes = 0;
  ok(mg_grouped_linear_workspace_bytes(&c.options, &bytes));
  ASSERT_GT(bytes, 0u);
  DeviceArray<uint8_t> workspace(bytes);  // cudaMalloc: 256-byte aligned
  workspace.poison();                     // transient memory: the operator writes what it reads

  const LinearResult own = run_linear(c, nullptr);
  const LinearResult caller = run_linear(c, workspace.get());
  EXPECT_EQ(nan_count(own.y) + nan_count(own.dx) + nan_count(own.dbias_scale), 0u) << "outputs left unwritten";
  EXPECT_TRUE(identical(caller.y, own.y)) << "y";
  EXPECT_TRUE(identical(caller.dx, own.dx)) << "dx";
  EXPECT_TRUE(identical(caller.dbias, own.dbias)) << "dbias";
  EXPECT_TRUE(identical(caller.dbias_scale, own.dbias_scale)) << "dbias_scale";
  EXPECT_TRUE(identical(caller.main_grad, own.main_grad)) << "main_grad";
  // main_grad: the empty group 1 is left as it was, group 0 is accumulated into.
  const std::size_t per_group = c.options.out_features * c.options.in_features;
  const std::vector<uint32_t> before = bits_of(c.main_grad);
  EXPECT_TRUE(
      std::equal(before.begin() + per_group, before.begin() + 2 * per_group, own.main_grad.begin() + per_group));
  EXPECT_FALSE(std::equal(before.begin(), before.begin() + per_group, own.main_grad.begin()));

  // The context really lived in the caller's memory: forward_train's copy of the splits is there.
  GroupedLinearOptions cpp;
  cpp.num_groups = c.options.num_groups, cpp.in_features = c.options.in_features;
  cpp.out_features = c.options.out_features, cpp.capacity_rows = c.options.capacity_rows, cpp.bias = true;
  const auto buffers = GroupedLinear::workspace_buffers(cpp);
  const auto slot =
      std::find_if(buffers.begin(), buffers.end(), [](const auto& e) { return e.name == "slot0.splits"; });
  ASSERT_NE(slot, buffers.end());
  const std::vector<uint8_t> memory = workspace.download();
  std::vector<int32_t> saved(c.splits.size());
  std::memcpy(saved.data(), memory.data() + slot->offset, saved.size() * sizeof(int32_t));
  EXPECT_EQ(saved, c.splits);

  // A workspace off the 256-byte alignment is refused before anything is made.
  mg_grouped_linear* op = reinterpret_cast<mg_grouped_linear*>(0x1);
  EXPECT_EQ(mg_grouped_linear_create(&c.options, workspace.get() + 16, &op), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(op, nullptr);
  EXPECT_TRUE(last_error_has("256-byte aligned")) << mg_last_error();
}

// ---- Expert parallelism: emulated ranks through the C ABI -----------------------------------------

// One layer made through the C ABI with its device tensors: a rank's (its experts' slice of the
// weights) or the whole layer's (every expert).
struct CLayer {
  int64_t tokens = 0;  // max_tokens
  DeviceArray<uint16_t> wr, w1, w2, b1, b2, db1, db2, x, y, dy, dx;
  DeviceArray<float> mgr, mg1, mg2;
  DeviceArray<int32_t> num_tokens{1};
  Stream stream;
  mg_moe_layer* layer = nullptr;
  ~CLayer() { mg_moe_layer_destroy(layer); }

  mg_moe_layer_io io() const {
    mg_moe_layer_io io = sized<mg_moe_layer_io>();
    io.x = x.get(), io.num_tokens = num_tokens.get(), io.y = y.get(), io.dy = dy.get(), io.dx = dx.get();
    return io;
  }
  // Inputs of `count` tokens (rows past it hold data the layer must ignore); outputs poisoned,
  // fp32 main_grad zeroed (it is accumulated into).
  void reset(const Mat& x_rows, const Mat& dy_rows, int64_t count) {
    x.upload(to_device_bits(x_rows, DType::kBF16));
    dy.upload(to_device_bits(dy_rows, DType::kBF16));
    num_tokens.upload({static_cast<int32_t>(count)});
    y.poison(), dx.poison(), db1.poison(), db2.poison();
    for (DeviceArray<float>* a : {&mgr, &mg1, &mg2}) memset_and_wait(a->get(), 0, a->size() * sizeof(float));
  }
  // forward (training) and backward, enqueued; the message of the first failure, or "".
  std::string train_step() {
    const mg_moe_layer_io a = io();
    mg_status s = mg_moe_layer_forward(layer, &a, /*train=*/1, stream.get());
    if (s == MG_OK) s = mg_moe_layer_backward(layer, &a, stream.get());
    return s == MG_OK ? std::string() : std::string(mg_status_string(s)) + ": " + mg_last_error();
  }
};

TEST(CAbiExpertParallelGpu, TwoRanksMatchTheWholeLayer) {
  constexpr int kRanks = 2, kExperts = 8, kLocal = kExperts / kRanks, kTopK = 2;
  constexpr int64_t kHidden = 128, kFfn = 64, kTokens = 48;  // kTokens per rank
  const int64_t counts[kRanks] = {kTokens, kTokens - 7};     // the ranks' token counts differ
  const int64_t h = kHidden, f = kFfn;
  const DType bf16 = DType::kBF16;
  std::mt19937_64 rng(test_seed("CAbiExpertParallelGpu.TwoRanksMatchTheWholeLayer"));
  // x and the router on grids: every logit is exact, so the ranks and the whole layer route alike.
  const Mat wr = grid_values(rng, kExperts * h, 64, 1.0 / 256);
  const Mat w1 = random_values(rng, kExperts * 2 * f * h, 1.0 / std::sqrt(double(h)), bf16);
  const Mat w2 = random_values(rng, kExperts * h * f, 1.0 / std::sqrt(double(f)), bf16);
  const Mat b1 = random_values(rng, kExperts * 2 * f, 0.1, bf16), b2 = random_values(rng, kExperts * h, 0.1, bf16);
  const auto slice = [](const Mat& m, std::size_t begin, std::size_t count) {
    return Mat(m.begin() + static_cast<std::ptrdiff_t>(begin), m.begin() + static_cast<std::ptrdiff_t>(begin + count));
  };
  const auto upload = [&](DeviceArray<uint16_t>& a, const Mat& v) {
    a = DeviceArray<uint16_t>(v.size());
    a.upload(to_device_bits(v, bf16));
  };

  mg_moe_layer_options o;
  mg_moe_layer_options_init(&o);
  o.experts = kExperts, o.hidden = kHidden, o.ffn = kFfn, o.top_k = kTopK, o.bias = 1, o.renormalize = 1;
  // Rank r holds experts [r * kLocal, (r + 1) * kLocal); the whole layer (rank -1) all of them.
  const auto make = [&](CLayer& l, int rank, mg_ep_comm* comm) {
    const int64_t first = rank < 0 ? 0 : rank * kLocal, experts = rank < 0 ? kExperts : kLocal;
    mg_moe_layer_options lo = o;
    lo.max_tokens = l.tokens = rank < 0 ? kRanks * kTokens : kTokens;
    lo.expert_parallel = rank < 0 ? 1 : kRanks;
    upload(l.wr, wr);
    upload(l.w1, slice(w1, first * 2 * f * h, experts * 2 * f * h));
    upload(l.w2, slice(w2, first * h * f, experts * h * f));
    upload(l.b1, slice(b1, first * 2 * f, experts * 2 * f));
    upload(l.b2, slice(b2, first * h, experts * h));
    l.db1 = DeviceArray<uint16_t>(experts * 2 * f), l.db2 = DeviceArray<uint16_t>(experts * h);
    l.mgr = DeviceArray<float>(kExperts * h);
    l.mg1 = DeviceArray<float>(experts * 2 * f * h), l.mg2 = DeviceArray<float>(experts * h * f);
    for (auto* a : {&l.x, &l.y, &l.dy, &l.dx}) *a = DeviceArray<uint16_t>(l.tokens * h);
    mg_moe_layer_weights w = sized<mg_moe_layer_weights>();
    w.router = l.wr.get(), w.w1 = l.w1.get(), w.w2 = l.w2.get(), w.b1 = l.b1.get(), w.b2 = l.b2.get();
    w.main_grad_router = l.mgr.get(), w.main_grad1 = l.mg1.get(), w.main_grad2 = l.mg2.get();
    w.db1 = l.db1.get(), w.db2 = l.db2.get();
    ok(rank < 0 ? mg_moe_layer_create(&lo, &w, nullptr, &l.layer)
                : mg_moe_layer_create_ep(&lo, &w, nullptr, comm, &l.layer));
  };

  mg_ep_comm* comms[kRanks] = {};
  ok(mg_ep_emulated_group_create(kRanks, comms));
  for (int r = 0; r < kRanks; ++r) {
    int rank = -1, ranks = -1;
    ok(mg_ep_comm_rank(comms[r], &rank));
    ok(mg_ep_comm_ranks(comms[r], &ranks));
    EXPECT_EQ(rank, r);
    EXPECT_EQ(ranks, kRanks);
  }
  CLayer whole, ranks[kRanks];
  make(whole, -1, nullptr);
  // Collective set-up: emulated ranks may be created one after the other by one thread.
  for (int r = 0; r < kRanks; ++r) make(ranks[r], r, comms[r]);
  {
    mg_moe_layer_options ep = o;
    ep.max_tokens = kTokens, ep.expert_parallel = kRanks;
    std::size_t window = 0;
    ok(mg_moe_layer_window_bytes(&ep, &window));
    EXPECT_GT(window, 0u);
  }
  // The layers keep what they need of their communicators: the handles may go first.
  for (mg_ep_comm* c : comms) mg_ep_comm_destroy(c);
  int gone = 0;
  EXPECT_EQ(mg_ep_comm_rank(comms[0], &gone), MG_ERR_INVALID_HANDLE);

  // The global batch: rank 0's tokens, then rank 1's.
  Mat x_all, dy_all;
  for (int r = 0; r < kRanks; ++r) {
    const Mat x = grid_values(rng, kTokens * h, 4, 0.25), dy = random_values(rng, kTokens * h, 1.0, bf16);
    ranks[r].reset(x, dy, counts[r]);
    x_all.insert(x_all.end(), x.begin(), x.begin() + counts[r] * h);
    dy_all.insert(dy_all.end(), dy.begin(), dy.begin() + counts[r] * h);
  }
  const int64_t n = static_cast<int64_t>(x_all.size()) / h;
  x_all.resize(kRanks * kTokens * h, 0.0), dy_all.resize(kRanks * kTokens * h, 0.0);
  whole.reset(x_all, dy_all, n);

  // Each rank's step enqueued by its own thread on its own stream (they wait for each other on the
  // device), then the whole layer's.
  std::string errors[kRanks];
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) threads.emplace_back([&, r] { errors[r] = ranks[r].train_step(); });
    for (auto& thread : threads) thread.join();
  }
  for (int r = 0; r < kRanks; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  ASSERT_EQ(whole.train_step(), "");
  for (int r = 0; r < kRanks; ++r) ok(mg_moe_layer_check_device_errors(ranks[r].layer, ranks[r].stream.get()));
  ok(mg_moe_layer_check_device_errors(whole.layer, whole.stream.get()));
  uint64_t dropped = 7;
  ok(mg_moe_layer_read_dropped(ranks[0].layer, ranks[0].stream.get(), &dropped));
  EXPECT_EQ(dropped, 0u) << "the worst-case receive buffer drops nothing";

  // The whole layer computes the same rows in the same order (by expert, then token): y and every
  // expert's weight gradient agree to the last bit. dx, the biases' gradients and the router's
  // (summed over the ranks) within the chain tolerance: their sums may round differently.
  const Tolerance tol = chain_tolerance_for(bf16);
  const auto bits16 = [](const DeviceArray<uint16_t>& a, std::size_t begin, std::size_t count) {
    const std::vector<uint16_t> all = a.download();
    return std::vector<uint16_t>(all.begin() + begin, all.begin() + begin + count);
  };
  const auto bits32 = [](const DeviceArray<float>& a, std::size_t begin, std::size_t count) {
    const std::vector<float> all = a.download();
    return bits_of(std::vector<float>(all.begin() + begin, all.begin() + begin + count));
  };
  const auto values = [&](const DeviceArray<uint16_t>& a, std::size_t begin, std::size_t count) {
    return from_bits16(bits16(a, begin, count), bf16);
  };
  Mat router_sum(kExperts * h, 0.0);
  int64_t first = 0;
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(detail::concat("rank ", r));
    const CLayer& l = ranks[r];
    const std::size_t rows = counts[r] * h, at = first * h;
    const std::vector<uint16_t> y = bits16(l.y, 0, rows);
    EXPECT_EQ(nan_count(y), 0u);
    EXPECT_TRUE(identical(y, bits16(whole.y, at, rows))) << "y";
    EXPECT_TRUE(passed(all_close("dx", values(l.dx, 0, rows), values(whole.dx, at, rows), h, {}, tol)));
    const std::vector<uint16_t> dx_past = bits16(l.dx, rows, (kTokens - counts[r]) * h);
    EXPECT_FALSE(any_nonzero(dx_past)) << "dx rows past the rank's tokens are written as zero";
    const std::size_t w1_count = kLocal * 2 * f * h, w2_count = kLocal * h * f;
    EXPECT_TRUE(any_nonzero(bits32(l.mg1, 0, w1_count)));
    EXPECT_TRUE(identical(bits32(l.mg1, 0, w1_count), bits32(whole.mg1, r * w1_count, w1_count))) << "main_grad1";
    EXPECT_TRUE(identical(bits32(l.mg2, 0, w2_count), bits32(whole.mg2, r * w2_count, w2_count))) << "main_grad2";
    EXPECT_TRUE(passed(all_close("db1", values(l.db1, 0, kLocal * 2 * f),
                                 values(whole.db1, r * kLocal * 2 * f, kLocal * 2 * f), 2 * f, {}, tol)));
    EXPECT_TRUE(passed(
        all_close("db2", values(l.db2, 0, kLocal * h), values(whole.db2, r * kLocal * h, kLocal * h), h, {}, tol)));
    const std::vector<float> router = l.mgr.download();
    for (std::size_t i = 0; i < router.size(); ++i) router_sum[i] += router[i];
    first += counts[r];
  }
  const std::vector<float> router_whole = whole.mgr.download();
  EXPECT_TRUE(passed(all_close("main_grad_router (sum over ranks)", router_sum,
                               Mat(router_whole.begin(), router_whole.end()), h, {}, tol)));

  // An inference forward on every rank gives the training forward's y again.
  std::vector<uint16_t> trained[kRanks];
  for (int r = 0; r < kRanks; ++r) trained[r] = bits16(ranks[r].y, 0, counts[r] * h), ranks[r].y.poison();
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r)
      threads.emplace_back([&, r] {
        const mg_moe_layer_io a = ranks[r].io();
        const mg_status s = mg_moe_layer_forward(ranks[r].layer, &a, /*train=*/0, ranks[r].stream.get());
        errors[r] = s == MG_OK ? std::string() : std::string(mg_status_string(s)) + ": " + mg_last_error();
      });
    for (auto& thread : threads) thread.join();
  }
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    ok(mg_moe_layer_check_device_errors(ranks[r].layer, ranks[r].stream.get()));
    EXPECT_TRUE(identical(bits16(ranks[r].y, 0, counts[r] * h), trained[r])) << "rank " << r << ": inference y";
  }
}

// ---- MXFP8 weights given by the caller ----------------------------------------------------------

// The caller's MXFP8 copies of bf16 grouped weights w [g, n, k], sized and made through the C ABI on
// `s` (waited for). Every array is poisoned first, so one the quantizer left unwritten would show.
struct CMxfp8 {
  DeviceArray<uint8_t> data, scales, data_t, scales_t;
  CMxfp8(const void* w, int g, int64_t n, int64_t k, cudaStream_t s) {
    std::size_t data_bytes = 0, scale_bytes = 0;
    ok(mg_mxfp8_weight_bytes(g, n, k, &data_bytes, &scale_bytes));
    data = DeviceArray<uint8_t>(data_bytes), data_t = DeviceArray<uint8_t>(data_bytes);
    scales = DeviceArray<uint8_t>(scale_bytes), scales_t = DeviceArray<uint8_t>(scale_bytes);
    data.poison(), scales.poison(), data_t.poison(), scales_t.poison();
    ok(mg_quantize_mxfp8_weights(MG_DTYPE_BF16, w, g, n, k, data.get(), scales.get(), data_t.get(), scales_t.get(),
                                 s));
    MG_CUDA_CHECK(cudaStreamSynchronize(s));
  }
};

// No byte is left at the poison: 0xFF is NaN as an E4M3 element and as an E8M0 scale, which finite
// weights never give.
std::size_t poison_bytes(const DeviceArray<uint8_t>& a) {
  const std::vector<uint8_t> bytes = a.download();
  return std::count(bytes.begin(), bytes.end(), uint8_t{0xff});
}

// mg_quantize_mxfp8_weights passes every argument where the C++ quantizer expects it (n != k here, so
// a swap would show): the same four arrays, every byte written; one pair alone leaves the other.
TEST(CAbiMxfp8Gpu, QuantizerWritesWhatTheCppQuantizerWrites) {
  const int g = 3;
  const int64_t n = 96, k = 160;
  std::mt19937_64 rng(test_seed("CAbiMxfp8Gpu.QuantizerWritesWhatTheCppQuantizerWrites"));
  DeviceArray<uint16_t> w(g * n * k);
  w.upload(random_bf16(rng, w.size(), 1.0));
  Stream stream;
  const cudaStream_t s = stream.get();
  CMxfp8 c(w.get(), g, n, k, s);
  DeviceArray<uint8_t> data(g * n * k), scales(g * n * k / 32), data_t(g * n * k), scales_t(g * n * k / 32);
  data.poison(), scales.poison(), data_t.poison(), scales_t.poison();
  quantize_mxfp8_weights(DType::kBF16, w.get(), g, n, k, {data.get(), scales.get(), data_t.get(), scales_t.get()}, s);
  MG_CUDA_CHECK(cudaStreamSynchronize(s));
  EXPECT_TRUE(identical(c.data.download(), data.download())) << "data";
  EXPECT_TRUE(identical(c.scales.download(), scales.download())) << "scales";
  EXPECT_TRUE(identical(c.data_t.download(), data_t.download())) << "data_t";
  EXPECT_TRUE(identical(c.scales_t.download(), scales_t.download())) << "scales_t";
  for (const DeviceArray<uint8_t>* a : {&c.data, &c.scales, &c.data_t, &c.scales_t}) EXPECT_EQ(poison_bytes(*a), 0u);

  c.data_t.poison(), c.scales_t.poison();
  ok(mg_quantize_mxfp8_weights(MG_DTYPE_BF16, w.get(), g, n, k, c.data.get(), c.scales.get(), nullptr, nullptr, s));
  MG_CUDA_CHECK(cudaStreamSynchronize(s));
  EXPECT_EQ(poison_bytes(c.data_t) + poison_bytes(c.scales_t), c.data_t.size() + c.scales_t.size())
      << "the transposed pair was not given: left as it was";
  EXPECT_TRUE(identical(c.data.download(), data.download())) << "data, quantized again";
}

// A grouped linear of the mxfp8 recipe made through the C ABI twice: quantizing its own copies
// (mg_grouped_linear_weights_changed), and reading the caller's through the mxfp8_* fields of its
// arguments with no 16-bit weight given (the forward gets the row-wise pair only, the backward the
// transposed pair only). An inference forward, forward_train and backward (dx, dbias, main_grad)
// give the same bits.
TEST(CAbiMxfp8Gpu, GroupedLinearFromPrequantizedWeightsGivesTheSameBits) {
  constexpr int kGroups = 5;
  constexpr int64_t kIn = 256, kOut = 384;
  const std::vector<int32_t> splits = {37, 0, 61, 1, 44};  // uneven, an empty group, a single row
  std::vector<int64_t> starts;                             // row_align 32: groups start on multiples of 32
  int64_t rows = 0;
  for (int32_t n : splits) starts.push_back(rows), rows += (n + 31) / 32 * 32;
  rows += 32;  // rows past the last group
  mg_grouped_linear_options o;
  mg_grouped_linear_options_init(&o);
  o.num_groups = kGroups, o.in_features = kIn, o.out_features = kOut, o.capacity_rows = rows, o.row_align = 32;
  o.bias = 1, o.recipe = MG_RECIPE_MXFP8;
  mg_grouped_linear_options pre = o;
  pre.prequantized_weights = 1;

  std::mt19937_64 rng(test_seed("CAbiMxfp8Gpu.GroupedLinearFromPrequantizedWeightsGivesTheSameBits"));
  DeviceArray<int32_t> d_splits(kGroups);
  DeviceArray<uint16_t> x(rows * kIn), w(kGroups * kOut * kIn), b(kGroups * kOut), dy(rows * kOut);
  d_splits.upload(splits);
  x.upload(random_bf16(rng, x.size(), 1.0));
  w.upload(random_bf16(rng, w.size(), 1.0 / std::sqrt(double(kIn))));
  b.upload(random_bf16(rng, b.size(), 0.1));
  dy.upload(random_bf16(rng, dy.size(), 1.0));
  Stream stream;
  const cudaStream_t s = stream.get();
  const CMxfp8 q(w.get(), kGroups, kOut, kIn, s);

  struct Out {
    std::vector<uint16_t> y, y_infer, dx, dbias;
    std::vector<uint32_t> main_grad;
  };
  const auto run = [&](const mg_grouped_linear_options& options, bool given) {
    mg_grouped_linear* op = nullptr;
    ok(mg_grouped_linear_create(&options, nullptr, &op));
    const std::unique_ptr<mg_grouped_linear, void (*)(mg_grouped_linear*)> owned(op, mg_grouped_linear_destroy);
    if (!given) ok(mg_grouped_linear_weights_changed(op, w.get(), s));
    DeviceArray<uint16_t> y(rows * kOut), y_infer(rows * kOut), dx(rows * kIn), db(kGroups * kOut);
    DeviceArray<float> main_grad(kGroups * kOut * kIn);
    y.poison(), y_infer.poison(), dx.poison(), db.poison();
    memset_and_wait(main_grad.get(), 0, main_grad.size() * sizeof(float));
    mg_forward_args f = sized<mg_forward_args>();
    f.x = x.get(), f.splits = d_splits.get(), f.bias = b.get();
    if (given) f.mxfp8_data = q.data.get(), f.mxfp8_scales = q.scales.get();
    else f.weight = w.get();
    f.y = y_infer.get();
    ok(mg_grouped_linear_forward(op, &f, /*train=*/0, s));
    f.y = y.get();
    ok(mg_grouped_linear_forward(op, &f, /*train=*/1, s));
    mg_backward_args bw = sized<mg_backward_args>();
    bw.dy = dy.get(), bw.bias = b.get(), bw.dx = dx.get(), bw.dbias = db.get(), bw.main_grad = main_grad.get();
    if (given) bw.mxfp8_data_t = q.data_t.get(), bw.mxfp8_scales_t = q.scales_t.get();
    else bw.weight = w.get();
    ok(mg_grouped_linear_backward(op, &bw, /*delay_wgrad=*/0, s));
    ok(mg_grouped_linear_check_device_errors(op, s));
    return Out{y.download(), y_infer.download(), dx.download(), db.download(), bits_of(main_grad.download())};
  };
  const Out own = run(o, false), given = run(pre, true);
  EXPECT_TRUE(identical(given.y, own.y)) << "y";
  EXPECT_TRUE(identical(given.y_infer, own.y_infer)) << "inference y";
  EXPECT_TRUE(identical(given.dx, own.dx)) << "dx";
  EXPECT_TRUE(identical(given.dbias, own.dbias)) << "dbias";
  EXPECT_TRUE(identical(given.main_grad, own.main_grad)) << "main_grad";
  EXPECT_TRUE(identical(own.y_infer, own.y)) << "inference vs training forward";
  // The groups' rows were computed (two runs that both wrote nothing would compare equal).
  for (int e = 0; e < kGroups; ++e) {
    SCOPED_TRACE(detail::concat("group ", e));
    const auto rows_of = [&](const std::vector<uint16_t>& v, int64_t cols) {
      return std::vector<uint16_t>(v.begin() + starts[e] * cols, v.begin() + (starts[e] + splits[e]) * cols);
    };
    EXPECT_EQ(nan_count(rows_of(own.y, kOut)), 0u);
    EXPECT_EQ(nan_count(rows_of(own.dx, kIn)), 0u);
    if (splits[e] > 0) {
      EXPECT_TRUE(any_nonzero(rows_of(own.y, kOut)));
    }
  }
  EXPECT_EQ(nan_count(own.main_grad), 0u);
  EXPECT_TRUE(any_nonzero(own.main_grad));

  // What the prequantized operator refuses, before enqueuing anything: its own quantization, and a
  // forward without the MXFP8 weights (an older mg_forward_args size carries none).
  mg_grouped_linear* op = nullptr;
  ok(mg_grouped_linear_create(&pre, nullptr, &op));
  const std::unique_ptr<mg_grouped_linear, void (*)(mg_grouped_linear*)> owned(op, mg_grouped_linear_destroy);
  EXPECT_EQ(mg_grouped_linear_weights_changed(op, w.get(), s), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("re-quantize them with quantize_mxfp8_weights instead")) << mg_last_error();
  DeviceArray<uint16_t> y(rows * kOut);
  y.poison();
  mg_forward_args f = sized<mg_forward_args>();
  f.x = x.get(), f.splits = d_splits.get(), f.weight = w.get(), f.bias = b.get(), f.y = y.get();
  EXPECT_EQ(mg_grouped_linear_forward(op, &f, /*train=*/0, s), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("forward needs mxfp8_weights.data and .scales (prequantized_weights)")) << mg_last_error();
  f.mxfp8_data = q.data.get(), f.mxfp8_scales = q.scales.get();
  f.struct_size = offsetof(mg_forward_args, mxfp8_data);
  EXPECT_EQ(mg_grouped_linear_forward(op, &f, /*train=*/0, s), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("forward needs mxfp8_weights.data and .scales")) << mg_last_error();
  f.struct_size = sizeof f;
  ok(mg_grouped_linear_forward(op, &f, /*train=*/0, s));
  ok(mg_grouped_linear_check_device_errors(op, s));
  EXPECT_TRUE(identical(y.download(), own.y_infer)) << "the refusals left nothing behind";
}

// A MoE layer of the mxfp8 recipe made through the C ABI from the 16-bit weights (it quantizes them
// itself: mg_moe_layer_weights_changed) and the same layer made from copies the caller quantized with
// mg_quantize_mxfp8_weights (prequantized_weights: no 16-bit w1 or w2 handed over at all). A
// training step (y, dx and every gradient) and an inference forward give the same bits.
TEST(CAbiMxfp8Gpu, MoeLayerFromPrequantizedWeightsMatchesTheSelfQuantizingLayer) {
  constexpr int kExperts = 8, kTopK = 2;
  constexpr int64_t kHidden = 256, kFfn = 128, kTokens = 64;  // hidden and ffn multiples of 128 (mxfp8)
  const int64_t h = kHidden, f = kFfn, count = kTokens - 9;   // rows past count hold data to be ignored
  const DType bf16 = DType::kBF16;
  std::mt19937_64 rng(test_seed("CAbiMxfp8Gpu.MoeLayerFromPrequantizedWeightsMatchesTheSelfQuantizingLayer"));
  const Mat wr = random_values(rng, kExperts * h, 1.0 / std::sqrt(double(h)), bf16);
  const Mat w1 = random_values(rng, kExperts * 2 * f * h, 1.0 / std::sqrt(double(h)), bf16);
  const Mat w2 = random_values(rng, kExperts * h * f, 1.0 / std::sqrt(double(f)), bf16);
  const Mat b1 = random_values(rng, kExperts * 2 * f, 0.1, bf16), b2 = random_values(rng, kExperts * h, 0.1, bf16);
  const Mat x = random_values(rng, kTokens * h, 1.0, bf16), dy = random_values(rng, kTokens * h, 1.0, bf16);
  const auto upload = [&](DeviceArray<uint16_t>& a, const Mat& v) {
    a = DeviceArray<uint16_t>(v.size());
    a.upload(to_device_bits(v, bf16));
  };

  mg_moe_layer_options o;
  mg_moe_layer_options_init(&o);
  o.experts = kExperts, o.hidden = kHidden, o.ffn = kFfn, o.top_k = kTopK, o.bias = 1, o.renormalize = 1;
  o.max_tokens = kTokens, o.row_align = 32, o.recipe = MG_RECIPE_MXFP8;
  // With the caller's copies of w1 and w2, or (null) from the 16-bit weights, which the layer quantizes.
  const auto make = [&](CLayer& l, const CMxfp8* mxfp8_w1, const CMxfp8* mxfp8_w2) {
    const bool given = mxfp8_w1 != nullptr;
    l.tokens = kTokens;
    upload(l.wr, wr), upload(l.b1, b1), upload(l.b2, b2);
    l.db1 = DeviceArray<uint16_t>(kExperts * 2 * f), l.db2 = DeviceArray<uint16_t>(kExperts * h);
    l.mgr = DeviceArray<float>(kExperts * h);
    l.mg1 = DeviceArray<float>(kExperts * 2 * f * h), l.mg2 = DeviceArray<float>(kExperts * h * f);
    for (auto* a : {&l.x, &l.y, &l.dy, &l.dx}) *a = DeviceArray<uint16_t>(kTokens * h);
    mg_moe_layer_options lo = o;
    lo.prequantized_weights = given;
    mg_moe_layer_weights w = sized<mg_moe_layer_weights>();
    w.router = l.wr.get(), w.b1 = l.b1.get(), w.b2 = l.b2.get();
    w.main_grad_router = l.mgr.get(), w.main_grad1 = l.mg1.get(), w.main_grad2 = l.mg2.get();
    w.db1 = l.db1.get(), w.db2 = l.db2.get();
    if (given) {
      w.w1_mxfp8_data = mxfp8_w1->data.get(), w.w1_mxfp8_scales = mxfp8_w1->scales.get();
      w.w1_mxfp8_data_t = mxfp8_w1->data_t.get(), w.w1_mxfp8_scales_t = mxfp8_w1->scales_t.get();
      w.w2_mxfp8_data = mxfp8_w2->data.get(), w.w2_mxfp8_scales = mxfp8_w2->scales.get();
      w.w2_mxfp8_data_t = mxfp8_w2->data_t.get(), w.w2_mxfp8_scales_t = mxfp8_w2->scales_t.get();
    } else {
      upload(l.w1, w1), upload(l.w2, w2);
      w.w1 = l.w1.get(), w.w2 = l.w2.get();
    }
    ok(mg_moe_layer_create(&lo, &w, nullptr, &l.layer));
    ok(mg_moe_layer_weights_changed(l.layer, l.stream.get()));  // given: nothing to do, and accepted
  };

  CLayer own;
  make(own, nullptr, nullptr);
  // The caller's copies, from the same 16-bit values (own's device weights).
  const cudaStream_t s = own.stream.get();
  const CMxfp8 q1(own.w1.get(), kExperts, 2 * f, h, s), q2(own.w2.get(), kExperts, h, f, s);
  CLayer given;
  make(given, &q1, &q2);

  for (CLayer* l : {&own, &given}) l->reset(x, dy, count);
  ASSERT_EQ(own.train_step(), "");
  ASSERT_EQ(given.train_step(), "");
  for (CLayer* l : {&own, &given}) ok(mg_moe_layer_check_device_errors(l->layer, l->stream.get()));

  const auto bits16 = [](const DeviceArray<uint16_t>& a, std::size_t count16) {
    std::vector<uint16_t> all = a.download();
    all.resize(count16);
    return all;
  };
  const std::size_t used = count * h, all_rows = kTokens * h;
  const std::vector<uint16_t> y = bits16(own.y, used);
  EXPECT_EQ(nan_count(y), 0u);
  EXPECT_TRUE(any_nonzero(y));
  EXPECT_TRUE(identical(bits16(given.y, used), y)) << "y";
  EXPECT_EQ(nan_count(bits16(own.dx, all_rows)), 0u) << "dx, rows past the tokens written as zero";
  EXPECT_TRUE(identical(bits16(given.dx, all_rows), bits16(own.dx, all_rows))) << "dx";
  EXPECT_EQ(nan_count(bits16(own.db1, own.db1.size())) + nan_count(bits16(own.db2, own.db2.size())), 0u);
  EXPECT_TRUE(identical(given.db1.download(), own.db1.download())) << "db1";
  EXPECT_TRUE(identical(given.db2.download(), own.db2.download())) << "db2";
  const std::pair<const char*, DeviceArray<float> CLayer::*> grads[] = {
      {"main_grad_router", &CLayer::mgr}, {"main_grad1", &CLayer::mg1}, {"main_grad2", &CLayer::mg2}};
  for (const auto& [name, grad] : grads) {
    const std::vector<uint32_t> want = bits_of((own.*grad).download());
    EXPECT_TRUE(any_nonzero(want)) << name;
    EXPECT_EQ(nan_count(want), 0u) << name;
    EXPECT_TRUE(identical(bits_of((given.*grad).download()), want)) << name;
  }

  // Inference: the training forward's y again, on both.
  for (CLayer* l : {&own, &given}) {
    l->y.poison();
    const mg_moe_layer_io io = l->io();
    ok(mg_moe_layer_forward(l->layer, &io, /*train=*/0, l->stream.get()));
    ok(mg_moe_layer_check_device_errors(l->layer, l->stream.get()));
    EXPECT_TRUE(identical(bits16(l->y, used), y)) << (l == &own ? "own" : "given") << ": inference y";
  }
}

}  // namespace
}  // namespace moegraph::test
