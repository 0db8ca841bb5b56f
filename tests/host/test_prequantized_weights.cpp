// MXFP8 weights without a GPU: the sizes and argument rules of moegraph/mxfp8_weights.hpp, the
// prequantized_weights option at every level (grouped linear, layer, config), and what a step plans
// for them: one shared copy however many buckets, none when the caller gives them.
#include <gtest/gtest.h>

#include <string>

#include "moegraph/config.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/mxfp8_weights.hpp"
#include "moegraph/step_graphs.hpp"
#include "tests/common/thrown.hpp"

namespace moegraph::test {
namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(PrequantizedWeights, SizesFollowTheLayout) {
  EXPECT_EQ(mxfp8_weight_data_bytes(3, 96, 160), 3u * 96 * 160);
  EXPECT_EQ(mxfp8_weight_scale_bytes(3, 96, 160), 3u * 96 * 160 / 32);
  EXPECT_TRUE(has(thrown_message([] { mxfp8_weight_data_bytes(0, 32, 32); }), "groups must be in [1, 1024], got 0"));
  EXPECT_TRUE(has(thrown_message([] { mxfp8_weight_data_bytes(1, 48, 32); }), "n must be a multiple of 32"));
  EXPECT_TRUE(has(thrown_message([] { mxfp8_weight_scale_bytes(1, 32, int64_t{1} << 22); }), "k must be a multiple of 32"));
}

// Every refusal comes before the quantizer touches a device (the pointer below is never read).
TEST(PrequantizedWeights, QuantizerArgumentsAreChecked) {
  alignas(16) static uint8_t fake[64];
  const Mxfp8Weights none;
  Mxfp8Weights half;
  half.data = fake;
  Mxfp8Weights odd;
  odd.data = fake + 1, odd.scales = fake;
  EXPECT_TRUE(has(thrown_message([&] { quantize_mxfp8_weights(DType::kBF16, fake, 1, 32, 32, none, nullptr); }),
                  "nothing to write"));
  EXPECT_TRUE(has(thrown_message([&] { quantize_mxfp8_weights(DType::kBF16, fake, 1, 32, 32, half, nullptr); }),
                  "data and its scales come together"));
  EXPECT_TRUE(has(thrown_message([&] { quantize_mxfp8_weights(DType::kBF16, fake, 1, 32, 32, odd, nullptr); }),
                  "must be 16-byte aligned"));
  Mxfp8Weights ok;
  ok.data = fake, ok.scales = fake;
  EXPECT_TRUE(has(thrown_message([&] { quantize_mxfp8_weights(DType::kBF16, nullptr, 1, 32, 32, ok, nullptr); }),
                  "w must be a 16-byte aligned device pointer"));
  EXPECT_TRUE(has(thrown_message([&] { quantize_mxfp8_weights(DType::kFP32, fake, 1, 32, 32, ok, nullptr); }),
                  "w must be bf16 or fp16"));
}

TEST(PrequantizedWeights, NeedTheMxfp8RecipeAtEveryLevel) {
  GroupedLinearOptions g;
  g.num_groups = 2, g.in_features = 128, g.out_features = 128, g.capacity_rows = 256, g.row_align = 32;
  g.prequantized_weights = true;
  EXPECT_TRUE(has(thrown_message([&] { validate(g); }), "prequantized_weights needs the mxfp8 recipe"));
  g.recipe = Recipe::kMXFP8;
  EXPECT_NO_THROW(validate(g));

  MoeLayerOptions l;
  l.experts = 8, l.hidden = 128, l.ffn = 128, l.top_k = 2, l.max_tokens = 64, l.row_align = 32;
  l.prequantized_weights = true;
  EXPECT_TRUE(has(thrown_message([&] { validate(l); }), "prequantized_weights needs the mxfp8 recipe"));
  l.recipe = Recipe::kMXFP8;
  EXPECT_NO_THROW(validate(l));

  const std::string bad = R"({"layer": {"experts": 8, "hidden": 128, "ffn": 128, "top_k": 2},
                              "precision": {"prequantized_weights": true}, "buckets": [64], "row_align": 32})";
  EXPECT_TRUE(has(thrown_message([&] { parse_config(bad, "cfg.json"); }),
                  "precision.prequantized_weights needs precision.recipe \"mxfp8\""));
  const std::string good = R"({"layer": {"experts": 8, "hidden": 128, "ffn": 128, "top_k": 2},
                               "precision": {"recipe": "mxfp8", "prequantized_weights": true}, "buckets": [64],
                               "row_align": 32})";
  const Config c = parse_config(good, "cfg.json");
  EXPECT_TRUE(c.precision.prequantized_weights);
  EXPECT_TRUE(moe_layer_options(c, 64).prequantized_weights);
  EXPECT_TRUE(parse_config(to_json(c), "round trip").precision.prequantized_weights);
}

StepGraphsOptions mxfp8_step(std::vector<int64_t> buckets) {
  StepGraphsOptions o;
  MoeLayerOptions& l = o.layer;
  l.experts = 16, l.hidden = 256, l.ffn = 512, l.top_k = 2, l.row_align = 32, l.recipe = Recipe::kMXFP8;
  o.buckets = std::move(buckets);
  return o;
}

TEST(PrequantizedWeights, AStepPlansOneSharedCopy) {
  const int64_t expert_elements = 16 * 3 * 512 * 256;  // w1 [16, 1024, 256] and w2 [16, 256, 512]
  const std::size_t both_copies = 2 * (expert_elements + expert_elements / 32);
  const StepPlan one = plan_step(mxfp8_step({64})), three = plan_step(mxfp8_step({64, 256, 1024}));
  EXPECT_GE(one.mxfp8_copy_bytes, both_copies);
  EXPECT_LT(one.mxfp8_copy_bytes, both_copies + 8 * 256);  // alignment of the eight arrays
  EXPECT_EQ(three.mxfp8_copy_bytes, one.mxfp8_copy_bytes) << "buckets share the copies";
  EXPECT_EQ(one.device_bytes(), one.arena_bytes + one.weight_bytes + one.mxfp8_copy_bytes);
  EXPECT_TRUE(has(one.to_string(), "mxfp8 weight copies (outside the arena, shared by all buckets)"));

  // Inference from the caller's MXFP8 weights: no copies, and the weights themselves are MXFP8
  // (fprop's copy alone).
  StepGraphsOptions serve = mxfp8_step({64});
  serve.layer.training = false;
  StepGraphsOptions serve_pre = serve;
  serve_pre.layer.prequantized_weights = true;
  const StepPlan self = plan_step(serve), given = plan_step(serve_pre);
  EXPECT_EQ(given.mxfp8_copy_bytes, 0u);
  EXPECT_EQ(self.weight_bytes - given.weight_bytes,
            std::size_t(expert_elements) * 2 - (std::size_t(expert_elements) + expert_elements / 32))
      << "16-bit w1, w2 replaced by their fprop copies";
  EXPECT_EQ(self.device_bytes() - given.device_bytes(), std::size_t(expert_elements) * 2);
  EXPECT_FALSE(has(given.to_string(), "mxfp8 weight copies"));
  // Training from them also lays out the transposed copies dgrad reads.
  StepGraphsOptions train_pre = mxfp8_step({64});
  train_pre.layer.prequantized_weights = true;
  EXPECT_EQ(plan_step(train_pre).mxfp8_copy_bytes, 0u);
  EXPECT_GT(plan_step(train_pre).weight_bytes, given.weight_bytes + std::size_t(expert_elements));
  // The kernels line says where the weights come from.
  bool caller = false;
  for (const std::string& k : given.kernels) caller |= has(k, "mxfp8 weights: the caller's");
  EXPECT_TRUE(caller);
}

}  // namespace
}  // namespace moegraph::test
