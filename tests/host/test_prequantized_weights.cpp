// MXFP8 weights without a GPU: the sizes and argument rules of moegraph/mxfp8_weights.hpp, the
// prequantized_weights and dequantized_weights options at every level (grouped linear, layer,
// config), and what a step plans for them: one shared copy however many buckets, none when the
// caller gives them, and the kept bf16 values counted in it.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moegraph/config.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/mxfp8_weights.hpp"
#include "moegraph/step_graphs.hpp"
#include "tests/common/thrown.hpp"

namespace moegraph::test {
namespace {

// The bf16 defaults of a small expert linear and layer that the mxfp8 recipe could also run
// (K, N multiples of 128, row_align 32): each recipe rule is then the only reason for a refusal.
GroupedLinearOptions small_linear() {
  GroupedLinearOptions g;
  g.num_groups = 2, g.in_features = 128, g.out_features = 128, g.capacity_rows = 256, g.row_align = 32;
  return g;
}
MoeLayerOptions small_layer() {
  MoeLayerOptions l;
  l.experts = 8, l.hidden = 128, l.ffn = 128, l.top_k = 2, l.max_tokens = 64, l.row_align = 32;
  return l;
}

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
  GroupedLinearOptions g = small_linear();
  g.prequantized_weights = true;
  EXPECT_TRUE(has(thrown_message([&] { validate(g); }), "prequantized_weights needs the mxfp8 recipe"));
  g.recipe = Recipe::kMXFP8;
  EXPECT_NO_THROW(validate(g));

  MoeLayerOptions l = small_layer();
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

// dequantized_weights: mxfp8 with bf16 activations only, at every level; its sizes; the quantizer
// writes a dequantized copy only beside its pair.
TEST(DequantizedWeights, NeedMxfp8AndBf16AtEveryLevel) {
  EXPECT_EQ(mxfp8_dequantized_weight_bytes(3, 96, 160), 2u * 3 * 96 * 160);
  GroupedLinearOptions g = small_linear();
  g.dequantized_weights = true;
  EXPECT_TRUE(has(thrown_message([&] { validate(g); }), "dequantized_weights needs the mxfp8 recipe with bf16"));
  g.recipe = Recipe::kMXFP8;
  EXPECT_NO_THROW(validate(g));
  g.dtype = DType::kFP16;
  EXPECT_TRUE(has(thrown_message([&] { validate(g); }), "got recipe mxfp8 and dtype fp16"));

  MoeLayerOptions l = small_layer();
  l.dequantized_weights = true;
  EXPECT_TRUE(has(thrown_message([&] { validate(l); }), "dequantized_weights needs the mxfp8 recipe"));
  l.recipe = Recipe::kMXFP8;
  EXPECT_NO_THROW(validate(l));

  const std::string layer = R"("layer": {"experts": 8, "hidden": 128, "ffn": 128, "top_k": 2}, "buckets": [64],
                               "row_align": 32)";
  EXPECT_TRUE(has(thrown_message([&] {
                    parse_config("{" + layer + R"(, "precision": {"dequantized_weights": true}})", "cfg.json");
                  }),
                  "precision.dequantized_weights needs precision.recipe \"mxfp8\" and dtype \"bf16\""));
  EXPECT_TRUE(has(thrown_message([&] {
                    parse_config("{" + layer + R"(, "precision": {"recipe": "mxfp8", "dtype": "fp16",
                                                                  "dequantized_weights": true}})",
                                 "cfg.json");
                  }),
                  "got recipe \"mxfp8\" and dtype \"fp16\""));
  const Config c =
      parse_config("{" + layer + R"(, "precision": {"recipe": "mxfp8", "dequantized_weights": true}})", "cfg.json");
  EXPECT_TRUE(c.precision.dequantized_weights);
  EXPECT_TRUE(moe_layer_options(c, 64).dequantized_weights);
  EXPECT_TRUE(parse_config(to_json(c), "round trip").precision.dequantized_weights);

  alignas(16) static uint8_t fake[64];
  Mxfp8Weights values_alone;
  values_alone.data_t = fake, values_alone.scales_t = fake, values_alone.dequantized = fake;
  EXPECT_TRUE(has(thrown_message([&] { quantize_mxfp8_weights(DType::kBF16, fake, 1, 32, 32, values_alone, nullptr); }),
                  "dequantized needs data and scales"));
  Mxfp8Weights odd;
  odd.data = fake, odd.scales = fake, odd.dequantized = fake + 8;
  EXPECT_TRUE(has(thrown_message([&] { quantize_mxfp8_weights(DType::kBF16, fake, 1, 32, 32, odd, nullptr); }),
                  "dequantized copies must be 16-byte aligned"));
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
  // Each pair's codes and scales, and its scales again in the swap-AB route's tile order (512 bytes a
  // tile of 128 rows and stage of 128 columns: the same count as the scales here, all sizes multiples of 128).
  const std::size_t both_copies = 2 * (expert_elements + 2 * (expert_elements / 32));
  EXPECT_EQ(mxfp8_tiled_scale_bytes(16, 1024, 256) + mxfp8_tiled_scale_bytes(16, 256, 512),
            static_cast<std::size_t>(expert_elements / 32));
  const StepPlan one = plan_step(mxfp8_step({64})), three = plan_step(mxfp8_step({64, 256, 1024}));
  EXPECT_GE(one.mxfp8_copy_bytes, both_copies);
  EXPECT_LT(one.mxfp8_copy_bytes, both_copies + 12 * 256);  // alignment of the twelve arrays
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
  // The step's own copies also carry their tiled scales; the caller's do not.
  EXPECT_EQ(self.device_bytes() - given.device_bytes(), std::size_t(expert_elements) * 2 + expert_elements / 32);
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

// dequantized_weights adds the bf16 values of both copies to the one shared set (2 + 2 bytes an
// element in training, 2 for inference, which has no dgrad copy); with prequantized_weights they
// are the caller's, in weight_bytes.
TEST(DequantizedWeights, AStepPlansTheirBytesOnce) {
  const int64_t expert_elements = 16 * 3 * 512 * 256;
  StepGraphsOptions values = mxfp8_step({64, 256});
  values.layer.dequantized_weights = true;
  const StepPlan plain = plan_step(mxfp8_step({64, 256})), with = plan_step(values);
  EXPECT_EQ(plain.mxfp8_dequantized_bytes, 0u);
  EXPECT_EQ(with.mxfp8_dequantized_bytes, std::size_t(expert_elements) * 4);
  EXPECT_GE(with.mxfp8_copy_bytes - plain.mxfp8_copy_bytes, std::size_t(expert_elements) * 4);
  EXPECT_LT(with.mxfp8_copy_bytes - plain.mxfp8_copy_bytes, std::size_t(expert_elements) * 4 + 4 * 256);
  EXPECT_TRUE(has(with.to_string(), "of which their bf16 values, dequantized_weights"));
  StepGraphsOptions serve = values;
  serve.layer.training = false;
  EXPECT_EQ(plan_step(serve).mxfp8_dequantized_bytes, std::size_t(expert_elements) * 2);
  StepGraphsOptions given = values;
  given.layer.prequantized_weights = true;
  const StepPlan caller = plan_step(given);
  EXPECT_EQ(caller.mxfp8_copy_bytes, 0u);
  EXPECT_GE(caller.weight_bytes, plan_step([&] {
              StepGraphsOptions o = given;
              o.layer.dequantized_weights = false;
              return o;
            }()).weight_bytes + std::size_t(expert_elements) * 4);
  bool kept = false;
  for (const std::string& k : with.kernels) kept |= has(k, "also kept dequantized to bf16");
  EXPECT_TRUE(kept);
}

// Which buckets' GEMMs read the kept values: fprop and dgrad of groups past the swap-AB bound (64
// expected rows), so here bucket 1024 (159 rows a group) and not bucket 64 (39 rows), for FC1 and
// FC2; the same for the 8-expert, 512-token step of the GPU bit-equality test.
TEST(DequantizedWeights, PlansNameTheBucketsThatReadThem) {
  const auto reading = [](const StepGraphsOptions& o) {
    std::vector<std::string> lines;
    for (const std::string& k : plan_step(o).kernels)
      if (has(k, "kept bf16 values")) lines.push_back(k.substr(0, k.find(':')));
    return lines;
  };
  StepGraphsOptions o = mxfp8_step({64, 1024});
  o.layer.dequantized_weights = true;
  EXPECT_EQ(reading(o), (std::vector<std::string>{"bucket 1024 fc1", "bucket 1024 fc2"}));
  o.layer.dequantized_weights = false;
  EXPECT_TRUE(reading(o).empty());
  StepGraphsOptions gpu_test;  // tests/gpu/step_driver.hpp small_layer_step(8, 2, 512), mxfp8
  gpu_test.step = StepKind::kMoeLayer;
  MoeLayerOptions& l = gpu_test.layer;
  l.experts = 8, l.hidden = 256, l.ffn = 256, l.top_k = 2, l.bias = true, l.row_align = 32;
  l.training = true, l.delay_wgrad = true, l.wgrad_slots = 2, l.recipe = Recipe::kMXFP8;
  l.dequantized_weights = true;
  gpu_test.buckets = {512};
  EXPECT_EQ(reading(gpu_test).size(), 2u);
}

}  // namespace
}  // namespace moegraph::test
