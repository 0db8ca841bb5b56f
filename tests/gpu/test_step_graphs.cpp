// The step-graph runtime: every bucket's captured phases against eager runs (bit-identical) and
// the fp64 reference of the expert MLP, pipelined micro-batches, bucket rules, invalid splits.
#include <gtest/gtest.h>

#include "moegraph/config.hpp"
#include "moegraph/step_graphs.hpp"
#include "testing/data.hpp"
#include "testing/expert_mlp_reference.hpp"
#include "testing/graph.hpp"
#include "testing/step_weights.hpp"
#include "tests/common/expect.hpp"

namespace moegraph::test {
namespace {

Config small_config(bool delay, int row_align, bool main_grad) {
  Config c;
  c.name = "step_test";
  c.step = StepKind::kExperts;
  c.layer.experts = 8;
  c.layer.hidden = 128;
  c.layer.ffn = 64;
  c.layer.top_k = 2;
  c.layer.bias = true;
  c.training.enabled = true;
  c.training.delay_wgrad = delay;
  c.training.wgrad_slots = 2;
  c.training.main_grad_fp32 = main_grad;
  c.buckets = {32, 128};
  c.row_align = row_align;
  return c;
}

Mat download(const void* p, std::size_t n, DType t) {
  std::vector<uint16_t> bits(n);
  MG_CUDA_CHECK(cudaMemcpy(bits.data(), p, n * 2, cudaMemcpyDeviceToHost));
  return from_bits16(bits, t);
}
Mat download(const float* p, std::size_t n) {
  std::vector<float> v(n);
  MG_CUDA_CHECK(cudaMemcpy(v.data(), p, n * 4, cudaMemcpyDeviceToHost));
  return Mat(v.begin(), v.end());
}
void upload(void* p, const Mat& v, DType t) {
  const auto bits = to_device_bits(v, t);
  MG_CUDA_CHECK(cudaMemcpy(p, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
}

// Everything a step produces, read back.
struct StepOutputs {
  Mat y, dx, dw1, dw2, db1, db2;
  bool operator==(const StepOutputs& o) const {
    return same_bits(y, o.y) && same_bits(dx, o.dx) && same_bits(dw1, o.dw1) && same_bits(dw2, o.dw2) &&
           same_bits(db1, o.db1) && same_bits(db2, o.db2);
  }
};

class StepHarness {
 public:
  explicit StepHarness(const Config& c)
      : c_(c),
        weights_(testing::make_step_weights(step_graphs_options(c), nullptr)),
        step_(step_graphs_options(c), weights_.weights),
        rng_(test_seed(c.name)) {
    const auto& l = c.layer;
    const StepWeights& w = step_.weights();
    w1_ = download(w.w1, l.experts * 2 * l.ffn * l.hidden, dt());
    w2_ = download(w.w2, l.experts * l.hidden * l.ffn, dt());
    b1_ = download(w.b1, l.experts * 2 * l.ffn, dt());
    b2_ = download(w.b2, l.experts * l.hidden, dt());
  }
  DType dt() const { return c_.precision.dtype; }
  StepGraphs& step() { return step_; }
  cudaStream_t stream() const { return stream_.get(); }

  // New routing of `tokens` tokens and new inputs in bucket b's buffers.
  void reroute(int b, int64_t tokens) {
    const BucketIO io = step_.io(b);
    const auto splits = random_splits(rng_, c_.layer.experts, tokens * c_.layer.top_k, 1.2);
    layout_ = make_layout(splits, c_.row_align, io.rows);
    x_ = random_values(rng_, io.rows * c_.layer.hidden, 1.0, dt());
    dy_ = random_values(rng_, io.rows * c_.layer.hidden, 1.0, dt());
    upload(io.x, x_, dt());  // gap rows hold garbage on the device on purpose
    upload(io.dy, dy_, dt());
    MG_CUDA_CHECK(cudaMemcpy(io.splits, splits.data(), splits.size() * 4, cudaMemcpyHostToDevice));
    const auto data = data_rows(layout_);
    for (int64_t r = 0; r < io.rows; ++r)
      if (!data[r]) {
        std::fill_n(x_.begin() + r * c_.layer.hidden, c_.layer.hidden, 0.0);
        std::fill_n(dy_.begin() + r * c_.layer.hidden, c_.layer.hidden, 0.0);
      }
  }
  void zero_grads() {
    const StepWeights& w = step_.weights();
    const auto& l = c_.layer;
    const std::size_t n1 = l.experts * 2 * l.ffn * l.hidden, n2 = l.experts * l.hidden * l.ffn;
    if (w.main_grad1) testing::memset_and_wait(w.main_grad1, 0, n1 * 4);
    if (w.main_grad2) testing::memset_and_wait(w.main_grad2, 0, n2 * 4);
    if (w.dw1) testing::memset_and_wait(w.dw1, 0xff, n1 * 2);  // written, so poisoned
    if (w.dw2) testing::memset_and_wait(w.dw2, 0xff, n2 * 2);
    testing::memset_and_wait(w.db1, 0xff, l.experts * 2 * l.ffn * 2);
    testing::memset_and_wait(w.db2, 0xff, l.experts * l.hidden * 2);
  }
  void poison_outputs(int b) {
    const BucketIO io = step_.io(b);
    testing::memset_and_wait(io.y, 0xff, io.rows * c_.layer.hidden * 2);
    testing::memset_and_wait(io.dx, 0xff, io.rows * c_.layer.hidden * 2);
  }
  void train_step(int b, bool graph) {
    poison_outputs(b);
    cudaStream_t s = stream();
    graph ? step_.forward_train(b, s) : step_.run_eager(b, StepPhase::kForwardTrain, s);
    graph ? step_.backward(b, s) : step_.run_eager(b, StepPhase::kBackward, s);
    if (c_.training.delay_wgrad) graph ? step_.wgrad(b, s) : step_.run_eager(b, StepPhase::kWgrad, s);
    step_.check_device_errors(s);
  }
  StepOutputs read(int b) const {
    const BucketIO io = step_.io(b);
    const StepWeights& w = step_.weights();
    const auto& l = c_.layer;
    const std::size_t n1 = l.experts * 2 * l.ffn * l.hidden, n2 = l.experts * l.hidden * l.ffn;
    StepOutputs o;
    o.y = download(io.y, io.rows * l.hidden, dt());
    o.dx = download(io.dx, io.rows * l.hidden, dt());
    o.dw1 = w.main_grad1 ? download(w.main_grad1, n1) : download(w.dw1, n1, dt());
    o.dw2 = w.main_grad2 ? download(w.main_grad2, n2) : download(w.dw2, n2, dt());
    o.db1 = download(w.db1, l.experts * 2 * l.ffn, dt());
    o.db2 = download(w.db2, l.experts * l.hidden, dt());
    return o;
  }
  ExpertMlpReference reference(bool with_backward) const {
    return ref_expert_mlp(layout_, {&x_, &w1_, &b1_, &w2_, &b2_, with_backward ? &dy_ : nullptr, c_.layer.hidden,
                                    c_.layer.ffn, dt()});
  }
  void expect_matches_reference(const StepOutputs& o, const std::string& where) const {
    const ExpertMlpReference ref = reference(true);
    // Intermediates are stored in the activation dtype, so every output (fp32 main_grad too) gets
    // the chain tolerance of that dtype.
    const Tolerance tol = chain_tolerance_for(dt());
    const auto rows = written_rows(layout_);
    EXPECT_TRUE(passed(all_close(where + " y", o.y, ref.y, c_.layer.hidden, rows, tol)));
    EXPECT_TRUE(passed(all_close(where + " dx", o.dx, ref.dx, c_.layer.hidden, rows, tol)));
    EXPECT_TRUE(passed(all_close(where + " dw1", o.dw1, ref.dw1, c_.layer.hidden, {}, tol)));
    EXPECT_TRUE(passed(all_close(where + " dw2", o.dw2, ref.dw2, c_.layer.ffn, {}, tol)));
    EXPECT_TRUE(passed(all_close(where + " db1", o.db1, ref.db1, 2 * c_.layer.ffn, {}, tol)));
    EXPECT_TRUE(passed(all_close(where + " db2", o.db2, ref.db2, c_.layer.hidden, {}, tol)));
  }
  const GroupLayout& layout() const { return layout_; }

 private:
  Config c_;
  testing::OwnedStepWeights weights_;  // the caller's parameters
  StepGraphs step_;
  Stream stream_;
  std::mt19937_64 rng_;
  Mat w1_, w2_, b1_, b2_, x_, dy_;
  GroupLayout layout_;
};

struct StepCase {
  const char* name;
  bool delay;
  int row_align;
  bool main_grad;
};

class StepGraphsCase : public ::testing::TestWithParam<StepCase> {};

TEST_P(StepGraphsCase, ReplaysMatchEagerAndReferenceAtEveryFill) {
  const StepCase p = GetParam();
  Config c = small_config(p.delay, p.row_align, p.main_grad);
  c.name = p.name;
  StepHarness h(c);
  for (int b = 0; b < h.step().num_buckets(); ++b) {
    for (int i = 0; i < 4; ++i) {
      const int64_t tokens = i % 2 == 0 ? c.buckets[b] : std::max<int64_t>(1, c.buckets[b] / 4);
      const std::string where = detail::concat("bucket ", b, " replay ", i, " (", tokens, " tokens)");
      h.reroute(b, tokens);
      h.zero_grads();
      h.train_step(b, /*graph=*/true);
      const StepOutputs graph = h.read(b);
      h.zero_grads();
      h.train_step(b, /*graph=*/false);
      EXPECT_TRUE(graph == h.read(b)) << where << ": graph replay differs from the eager step";
      h.expect_matches_reference(graph, where);
      // Inference forward: the same y.
      const BucketIO io = h.step().io(b);
      testing::memset_and_wait(io.y, 0xff, io.rows * c.layer.hidden * 2);
      h.step().forward(b, h.stream());
      h.step().check_device_errors(h.stream());
      EXPECT_TRUE(same_bits(download(io.y, io.rows * c.layer.hidden, c.precision.dtype), graph.y))
          << where << ": inference forward differs from forward_train";
      if (HasFailure()) return;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, StepGraphsCase,
                         ::testing::Values(StepCase{"delayed_align16_main_grad", true, 16, true},
                                           StepCase{"immediate_align1_bf16_grads", false, 1, false},
                                           StepCase{"delayed_align128_bf16_grads", true, 128, false}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(StepGraphs, PipelinedMicroBatchesMatchSequentialSteps) {
  StepHarness h(small_config(true, 1, true));
  StepGraphs& step = h.step();
  const BucketIO io = step.io(1);
  cudaStream_t s = h.stream();
  const std::size_t xbytes = io.rows * 128 * 2;
  std::vector<std::vector<char>> x(2, std::vector<char>(xbytes)), dy = x, splits(2, std::vector<char>(8 * 4));
  auto save = [&](int mb) {
    MG_CUDA_CHECK(cudaMemcpy(x[mb].data(), io.x, xbytes, cudaMemcpyDeviceToHost));
    MG_CUDA_CHECK(cudaMemcpy(dy[mb].data(), io.dy, xbytes, cudaMemcpyDeviceToHost));
    MG_CUDA_CHECK(cudaMemcpy(splits[mb].data(), io.splits, 8 * 4, cudaMemcpyDeviceToHost));
  };
  // Written on the step's stream, in order with the phases, as a real caller does.
  auto restore = [&](int mb, bool inputs, bool grad) {
    if (inputs) MG_CUDA_CHECK(cudaMemcpyAsync(io.x, x[mb].data(), xbytes, cudaMemcpyHostToDevice, s));
    if (inputs) MG_CUDA_CHECK(cudaMemcpyAsync(io.splits, splits[mb].data(), 8 * 4, cudaMemcpyHostToDevice, s));
    if (grad) MG_CUDA_CHECK(cudaMemcpyAsync(io.dy, dy[mb].data(), xbytes, cudaMemcpyHostToDevice, s));
  };
  h.zero_grads();
  std::vector<Mat> dx_seq(2);
  for (int mb = 0; mb < 2; ++mb) {
    h.reroute(1, 100 - 40 * mb);
    save(mb);
    h.train_step(1, true);
    dx_seq[mb] = h.read(1).dx;
  }
  const StepOutputs sequential = h.read(1);

  // F0 F1 B0 B1 W0 W1, the caller's buffers rewritten between phases.
  h.zero_grads();
  std::vector<Mat> dx_pipe(2);
  for (int mb = 0; mb < 2; ++mb) restore(mb, true, false), step.forward_train(1, s);
  EXPECT_THROW(step.forward_train(1, s), Error) << "a third micro-batch must not fit two slots";
  EXPECT_THROW(step.forward_train(0, s), Error) << "another bucket must wait: buckets share the arena";
  EXPECT_THROW(step.forward(1, s), Error) << "inference would overwrite saved activations";
  for (int mb = 0; mb < 2; ++mb) {
    restore(mb, false, true);
    MG_CUDA_CHECK(cudaMemsetAsync(io.dx, 0xff, xbytes, s));  // as train_step poisons it
    step.backward(1, s);
    MG_CUDA_CHECK(cudaStreamSynchronize(s));
    dx_pipe[mb] = download(io.dx, io.rows * 128, DType::kBF16);
  }
  step.wgrad(1, s);
  step.wgrad(1, s);
  EXPECT_THROW(step.wgrad(1, s), Error);
  step.check_device_errors(s);
  const StepOutputs pipelined = h.read(1);
  for (int mb = 0; mb < 2; ++mb) EXPECT_TRUE(same_bits(dx_pipe[mb], dx_seq[mb])) << "micro-batch " << mb << " dx";
  EXPECT_TRUE(same_bits(pipelined.dw1, sequential.dw1)) << "main_grad1 differs between pipelined and sequential";
  EXPECT_TRUE(same_bits(pipelined.dw2, sequential.dw2)) << "main_grad2 differs between pipelined and sequential";
  step.forward_train(0, s);  // everything finished: other buckets may run again
  step.backward(0, s);
  step.wgrad(0, s);
}

TEST(StepGraphs, DelayedWgradIsBitIdenticalToImmediate) {
  StepHarness delayed(small_config(true, 16, true)), immediate(small_config(false, 16, true));
  for (StepHarness* h : {&delayed, &immediate}) {
    h->reroute(1, 128);  // same seed, so the same routing and data
    h->zero_grads();
    h->train_step(1, true);
  }
  EXPECT_TRUE(delayed.read(1) == immediate.read(1));
}

TEST(StepGraphs, BucketChoiceAndLimits) {
  StepHarness h(small_config(false, 1, true));
  EXPECT_EQ(h.step().bucket_for(0), 0);
  EXPECT_EQ(h.step().bucket_for(32), 0);
  EXPECT_EQ(h.step().bucket_for(33), 1);
  EXPECT_EQ(h.step().bucket_for(128), 1);
  try {
    h.step().bucket_for(129);
    FAIL() << "129 tokens must not fit";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("129 tokens exceed the largest bucket (128 tokens)"), std::string::npos) << e.message();
  }
  EXPECT_THROW(h.step().wgrad(0, h.stream()), Error) << "wgrad without delay_wgrad";
  EXPECT_GE(h.step().plan().sum_of_buckets, h.step().plan().arena_bytes);
  EXPECT_EQ(h.step().plan().arena_bytes, h.step().plan().buckets.back().bytes);
}

TEST(StepGraphs, InvalidSplitsAreReportedWithTheBucket) {
  StepHarness h(small_config(false, 1, true));
  const BucketIO io = h.step().io(0);
  std::vector<int32_t> splits(8, 0);
  splits[5] = static_cast<int32_t>(io.rows) + 1;
  MG_CUDA_CHECK(cudaMemcpy(io.splits, splits.data(), 32, cudaMemcpyHostToDevice));
  h.step().forward(0, h.stream());
  try {
    h.step().check_device_errors(h.stream());
    FAIL() << "splits past capacity must be reported";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kDeviceSplits);
    EXPECT_NE(e.message().find("bucket of 32 tokens"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("capacity_rows is 64"), std::string::npos) << e.message();
  }
  EXPECT_NO_THROW(h.step().check_device_errors(h.stream())) << "records are cleared once reported";
}

}  // namespace
}  // namespace moegraph::test
