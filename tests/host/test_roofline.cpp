// The roofline model of moegraph-bench (tools/bench/roofline.hpp): a step's fewest bytes, the
// experts a routing reaches, and which side sets the floor. No GPU: the measured rates are given.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "tools/bench/roofline.hpp"

namespace moegraph::test {
namespace {

using bench::StepTraffic;

// The decode preset's layer: 64 experts, hidden 4096, ffn 1408, bf16.
StepTraffic decode_layer(double active, int64_t tokens) {
  StepTraffic t;
  t.hidden = 4096, t.ffn = 1408, t.experts = 64, t.active_experts = active, t.io_rows = tokens;
  return t;
}

constexpr double kExpertWeights = 3.0 * 4096 * 1408;  // FC1 [2f, h] and FC2 [h, f], elements

TEST(Roofline, InferenceReadsTheActiveExpertsWeightsOnceAndXAndYOnce) {
  EXPECT_DOUBLE_EQ(bench::step_bytes(decode_layer(6, 1)), 6 * kExpertWeights * 2 + 2 * 4096 * 2.0);
  // Each further expert that receives rows adds its weights, nothing else.
  EXPECT_DOUBLE_EQ(bench::step_bytes(decode_layer(7, 1)) - bench::step_bytes(decode_layer(6, 1)), kExpertWeights * 2);
  // MXFP8 reads the quantized copies: one byte per element and a scale per 32.
  StepTraffic mx = decode_layer(6, 1);
  mx.weight_bytes = 1.0 + 1.0 / 32;
  EXPECT_DOUBLE_EQ(bench::step_bytes(mx), 6 * kExpertWeights * (1.0 + 1.0 / 32) + 2 * 4096 * 2.0);
}

TEST(Roofline, TrainingReadsTheWeightsTwiceAndMovesTheGradients) {
  StepTraffic t = decode_layer(40, 256);
  t.training = true;
  const double activations = 4 * 256 * 4096 * 2.0;  // x, y, dy, dx
  t.main_grad_fp32 = true;  // fp32 main_grad of the active experts, read and written
  EXPECT_DOUBLE_EQ(bench::step_bytes(t), 2 * 40 * kExpertWeights * 2 + 40 * kExpertWeights * 8 + activations);
  t.main_grad_fp32 = false;  // every expert's gradient written in bf16, zeros for the empty ones
  EXPECT_DOUBLE_EQ(bench::step_bytes(t), 2 * 40 * kExpertWeights * 2 + 64 * kExpertWeights * 2 + activations);
}

// Against a simulation of the routing it stands for: each token picks top_k distinct experts.
TEST(Roofline, ExpectedActiveExpertsMatchesUniformTopKRouting) {
  EXPECT_DOUBLE_EQ(bench::expected_active_experts(64, 6, 1), 6.0);  // one token: exactly its top_k
  EXPECT_DOUBLE_EQ(bench::expected_active_experts(8, 8, 3), 8.0);
  EXPECT_NEAR(bench::expected_active_experts(128, 8, 4096), 128.0, 1e-9);
  std::mt19937_64 rng(7);
  for (const auto& [experts, top_k, tokens] : {std::tuple{64, 6, 8}, std::tuple{128, 8, 16}, std::tuple{8, 2, 3}}) {
    constexpr int kTrials = 4000;
    double sum = 0;
    std::vector<int> ids(experts);
    for (int trial = 0; trial < kTrials; ++trial) {
      std::vector<bool> hit(experts);
      for (int t = 0; t < tokens; ++t) {
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), rng);
        for (int j = 0; j < top_k; ++j) hit[ids[j]] = true;
      }
      sum += std::count(hit.begin(), hit.end(), true);
    }
    EXPECT_NEAR(bench::expected_active_experts(experts, top_k, tokens), sum / kTrials, 0.01 * experts)
        << experts << " experts, top-" << top_k << ", " << tokens << " tokens";
  }
}

TEST(Roofline, TheSlowerSideSetsTheFloor) {
  bench::Roofline roof;
  roof.dense_tflops = 800, roof.copy_gbps = 3000;
  EXPECT_DOUBLE_EQ(roof.compute_ms(800e9), 1.0);
  EXPECT_DOUBLE_EQ(roof.memory_ms(3e9), 1.0);
  EXPECT_DOUBLE_EQ(roof.floor_ms(1600e9, 3e9), 2.0);
  EXPECT_STREQ(roof.bound(1600e9, 3e9), "compute");
  EXPECT_DOUBLE_EQ(roof.floor_ms(800e9, 6e9), 2.0);
  EXPECT_STREQ(roof.bound(800e9, 6e9), "memory");
}

}  // namespace
}  // namespace moegraph::test
