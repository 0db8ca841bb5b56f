// Prequantized MXFP8 weights (moegraph/mxfp8_weights.hpp): an operator or a step that reads the
// caller's MXFP8 weights computes the same bits as one that quantizes the 16-bit weights itself,
// keeps no weight copy of its own, and a StepGraphs of the mxfp8 recipe quantizes once for all its
// buckets. The quantizer itself is checked bit for bit against the host reference.
#include <gtest/gtest.h>

#include <random>

#include "moegraph/grouped_linear.hpp"
#include "moegraph/mxfp8_weights.hpp"
#include "testing/mxfp8_reference.hpp"
#include "tests/common/expect.hpp"
#include "tests/gpu/step_driver.hpp"

namespace moegraph::test {
namespace {

// The four arrays of W [g, n, k] in one device block.
struct Mxfp8Block {
  DeviceArray<uint8_t> data, scales, data_t, scales_t;
  Mxfp8Block(int g, int64_t n, int64_t k)
      : data(mxfp8_weight_data_bytes(g, n, k)),
        scales(mxfp8_weight_scale_bytes(g, n, k)),
        data_t(data.size()),
        scales_t(scales.size()) {}
  Mxfp8Weights view(bool transposed = true) const {
    return {data.get(), scales.get(), transposed ? data_t.get() : nullptr, transposed ? scales_t.get() : nullptr};
  }
};

TEST(Mxfp8WeightsApi, QuantizerMatchesTheReference) {
  const int g = 3;
  const int64_t n = 96, k = 160;
  std::mt19937_64 rng(test_seed("mxfp8_weights_api"));
  const Mat w = random_values(rng, g * n * k, 1.0, DType::kBF16);
  DeviceArray<uint16_t> dw(w.size());
  dw.upload(to_device_bits(w, DType::kBF16));
  Mxfp8Block q(g, n, k);
  q.data.poison(), q.scales.poison(), q.data_t.poison(), q.scales_t.poison();
  quantize_mxfp8_weights(DType::kBF16, dw.get(), g, n, k, q.view(), nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  MxBuffer row = mx_buffer(g * n, k), col = mx_buffer(g * n, k);
  mx_quantize_weights(w, g, n, k, &row, &col);
  EXPECT_TRUE(q.data.download() == row.data);
  EXPECT_TRUE(q.scales.download() == row.scales);
  EXPECT_TRUE(q.data_t.download() == col.data);
  EXPECT_TRUE(q.scales_t.download() == col.scales);

  // One pair alone leaves the other untouched.
  q.data_t.poison();
  quantize_mxfp8_weights(DType::kBF16, dw.get(), g, n, k, q.view(false), nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  for (uint8_t b : q.data_t.download()) ASSERT_EQ(b, 0xff);
}

// One grouped linear quantizing its own copies and one reading the caller's: the same y, dx and
// main_grad bits; the second holds no weight copy.
TEST(Mxfp8WeightsApi, GroupedLinearFromPrequantizedWeightsGivesTheSameBits) {
  GroupedLinearOptions o;
  o.num_groups = 6, o.in_features = 256, o.out_features = 384, o.row_align = 32, o.bias = true;
  o.recipe = Recipe::kMXFP8;
  const std::vector<int32_t> splits = {40, 0, 97, 5, 64, 31};
  o.capacity_rows = 0;
  for (int32_t s : splits) o.capacity_rows += (s + 31) / 32 * 32;
  o.capacity_rows += 64;  // rows past the last group
  GroupedLinearOptions pre = o;
  pre.prequantized_weights = true;
  GroupedLinear own(o), given(pre);
  const std::size_t copies = 2 * (mxfp8_weight_data_bytes(6, 384, 256) + mxfp8_weight_scale_bytes(6, 384, 256));
  EXPECT_EQ(own.device_bytes(), given.device_bytes() + copies);

  const int64_t rows = o.capacity_rows, K = o.in_features, N = o.out_features, G = o.num_groups;
  std::mt19937_64 rng(test_seed("mxfp8_prequantized_linear"));
  DeviceArray<uint16_t> x(rows * K), dy(rows * N), w(G * N * K), b(G * N);
  x.upload(to_device_bits(random_values(rng, x.size(), 1.0, DType::kBF16), DType::kBF16));
  dy.upload(to_device_bits(random_values(rng, dy.size(), 1.0, DType::kBF16), DType::kBF16));
  w.upload(to_device_bits(random_values(rng, w.size(), 0.1, DType::kBF16), DType::kBF16));
  b.upload(to_device_bits(random_values(rng, b.size(), 0.1, DType::kBF16), DType::kBF16));
  DeviceArray<int32_t> d_splits(G);
  d_splits.upload(splits);
  Mxfp8Block q(G, N, K);
  testing::Stream stream;
  cudaStream_t s = stream.get();
  quantize_mxfp8_weights(DType::kBF16, w.get(), G, N, K, q.view(), s);
  own.weights_changed(w.get(), s);

  struct Out {
    std::vector<uint16_t> y, y_infer, dx;
    std::vector<float> main_grad;
  };
  auto run = [&](GroupedLinear& op, const void* weight, Mxfp8Weights m) {
    DeviceArray<uint16_t> y(rows * N), y_infer(rows * N), dx(rows * K);
    DeviceArray<float> main_grad(G * N * K);
    y.poison(), y_infer.poison(), dx.poison();
    testing::memset_and_wait(main_grad.get(), 0, main_grad.size() * 4);
    op.forward({x.get(), d_splits.get(), weight, b.get(), nullptr, y_infer.get(), nullptr, m}, s);
    op.forward_train({x.get(), d_splits.get(), weight, b.get(), nullptr, y.get(), nullptr, m}, s);
    op.backward({dy.get(), weight, b.get(), dx.get(), nullptr, nullptr, nullptr, main_grad.get(), m},
                WgradMode::kImmediate, s);
    op.check_device_errors(s);
    return Out{y.download(), y_infer.download(), dx.download(), main_grad.download()};
  };
  const Out a = run(own, w.get(), {}), c = run(given, nullptr, q.view());
  EXPECT_TRUE(a.y == c.y);
  EXPECT_TRUE(a.y_infer == c.y_infer);
  EXPECT_TRUE(a.dx == c.dx);
  EXPECT_TRUE(a.main_grad == c.main_grad);
  std::size_t nonzero = 0;
  for (float v : a.main_grad) nonzero += v != 0.0f;
  EXPECT_GT(nonzero, a.main_grad.size() / 2) << "the step computed gradients";

  // What the prequantized operator refuses: its own quantization, and missing MXFP8 weights.
  EXPECT_THROW(given.weights_changed(w.get(), s), Error);
  DeviceArray<uint16_t> y(rows * N);
  EXPECT_THROW(given.forward({x.get(), d_splits.get(), w.get(), b.get(), nullptr, y.get(), nullptr, {}}, s), Error);
}

// A StepGraphs of the mxfp8 recipe from 16-bit weights (one shared quantized copy) and one from the
// same weights prequantized by the caller: every output and gradient of a training step, replayed
// and eager, bit for bit, on two buckets.
TEST(Mxfp8WeightsApi, StepFromPrequantizedWeightsGivesTheSameBits) {
  StepGraphsOptions o = small_layer_step(8, 2, 64);
  o.layer.recipe = Recipe::kMXFP8;
  o.layer.row_align = 32;
  o.buckets = {64, 256};  // the driver runs the first; both read the one shared copy
  StepGraphsOptions pre = o;
  pre.layer.prequantized_weights = true;
  EXPECT_GT(o.buckets.size(), 1u);
  EXPECT_GT(plan_step(o).mxfp8_copy_bytes, 0u);
  EXPECT_EQ(plan_step(pre).mxfp8_copy_bytes, 0u);

  StepDriver self(o), given(pre);
  std::mt19937_64 rng(test_seed("mxfp8_prequantized_step"));
  const int64_t n = self.tokens() * self.hidden();
  for (int32_t tokens : {64, 23}) {
    const auto x = to_device_bits(random_values(rng, n, 1.0, DType::kBF16), DType::kBF16);
    const auto dy = to_device_bits(random_values(rng, n, 1.0, DType::kBF16), DType::kBF16);
    for (bool graph : {false, true}) {
      for (StepDriver* d : {&self, &given}) {
        d->write_inputs(x, dy, tokens);
        d->reset_outputs();
        d->train_step(graph);
      }
      const StepBits a = self.read(), b = given.read();
      EXPECT_TRUE(a.y == b.y) << tokens << " tokens, graph " << graph;
      EXPECT_TRUE(a.dx == b.dx) << tokens << " tokens, graph " << graph;
      EXPECT_TRUE(a.main_grad1 == b.main_grad1 && a.main_grad2 == b.main_grad2 &&
                  a.main_grad_router == b.main_grad_router)
          << tokens << " tokens, graph " << graph;
      std::size_t nan = 0;
      for (int64_t i = 0; i < int64_t{tokens} * self.hidden(); ++i) nan += std::isnan(from_bits(a.y[i], DType::kBF16));
      EXPECT_EQ(nan, 0u);
      self.step().check_device_errors(self.stream());
      given.step().check_device_errors(given.stream());
    }
  }
}

// Serving from an MXFP8 checkpoint: an inference step given only the fprop copies (no 16-bit
// weights, no transposed copies) replays the forward of the step that quantizes for itself.
TEST(Mxfp8WeightsApi, InferenceStepServesFromMxfp8WeightsAlone) {
  StepGraphsOptions o = small_layer_step(8, 2, 32);
  o.layer.recipe = Recipe::kMXFP8, o.layer.row_align = 32;
  o.layer.training = false, o.layer.delay_wgrad = false;
  StepGraphsOptions pre = o;
  pre.layer.prequantized_weights = true;
  const StepPlan plan16 = plan_step(o), plan8 = plan_step(pre);
  // The expert weights shrink from 2 bytes to 1 + 1/32 bytes an element, and no copy is made.
  const std::size_t experts = o.layer.experts * 3 * o.layer.ffn * o.layer.hidden;
  EXPECT_LT(plan8.device_bytes(), plan16.device_bytes());
  EXPECT_GE(plan16.device_bytes() - plan8.device_bytes(), experts * 2 * 99 / 100);

  testing::Stream stream;
  cudaStream_t s = stream.get();
  const testing::OwnedStepWeights w16 = testing::make_step_weights(o, s), w8 = testing::make_step_weights(pre, s);
  EXPECT_EQ(w8.weights.w1, nullptr);
  EXPECT_EQ(w8.weights.w1_mxfp8.data_t, nullptr) << "inference needs no dgrad copy";
  StepGraphs a(o, w16.weights), b(pre, w8.weights);
  std::mt19937_64 rng(test_seed("mxfp8_serving"));
  const int64_t n = 32 * o.layer.hidden;
  for (int32_t tokens : {32, 1, 7}) {
    const auto x = to_device_bits(random_values(rng, n, 1.0, DType::kBF16), DType::kBF16);
    std::vector<uint16_t> y[2];
    int i = 0;
    for (StepGraphs* step : {&a, &b}) {
      const BucketIO io = step->io(0);
      MG_CUDA_CHECK(cudaMemcpyAsync(io.x, x.data(), n * 2, cudaMemcpyHostToDevice, s));
      MG_CUDA_CHECK(cudaMemcpyAsync(io.num_tokens, &tokens, 4, cudaMemcpyHostToDevice, s));
      MG_CUDA_CHECK(cudaMemsetAsync(io.y, 0xff, n * 2, s));
      step->forward(0, s);
      step->check_device_errors(s);
      y[i].resize(n);
      MG_CUDA_CHECK(cudaMemcpy(y[i].data(), io.y, n * 2, cudaMemcpyDeviceToHost));
      ++i;
    }
    EXPECT_TRUE(y[0] == y[1]) << tokens << " tokens";
    for (int64_t e = 0; e < int64_t{tokens} * o.layer.hidden; ++e)
      ASSERT_FALSE(std::isnan(from_bits(y[1][e], DType::kBF16))) << "token row " << e / o.layer.hidden;
  }
}

}  // namespace
}  // namespace moegraph::test
