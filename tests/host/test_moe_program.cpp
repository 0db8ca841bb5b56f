// The MoE layer program without a GPU: the operator list, the fusion pass, the option checks and
// the workspace layout (saved tensors once per slot, nothing for backward in inference).
#include <gtest/gtest.h>

#include <algorithm>

#include "moegraph/config.hpp"
#include "moegraph/moe_layer.hpp"
#include "src/ops/moe/op_spec.hpp"

namespace moegraph::test {
namespace {

MoeLayerOptions small() {
  MoeLayerOptions o;
  o.experts = 8, o.hidden = 128, o.ffn = 64, o.top_k = 2, o.max_tokens = 64;
  o.wgrad_slots = 2;
  return o;
}

bool has_buffer(const std::vector<MoeLayer::WorkspaceBuffer>& b, const std::string& name) {
  return std::any_of(b.begin(), b.end(), [&](const auto& e) { return e.name == name; });
}

TEST(MoeProgram, UnfusedLayerOrder) {
  MoeLayerOptions o = small();
  EXPECT_EQ(layer::describe(layer::moe_layer_ops(o)), "router -> dispatch -> fc1 -> swiglu -> fc2 -> combine");
  o.aux_loss_coef = 0.01;
  EXPECT_EQ(layer::describe(layer::moe_layer_ops(o)),
            "router -> dispatch -> aux_loss -> fc1 -> swiglu -> fc2 -> combine");
}

TEST(MoeProgram, FusionMovesTheRoutingWeightsIntoTheSwiglu) {
  auto ops = layer::moe_layer_ops(small());
  ASSERT_EQ(layer::fuse_routing_weights(ops), 1);
  EXPECT_EQ(layer::describe(ops),
            "router -> dispatch -> fc1 -> swiglu_weighted -> fc2(bias x row_weight) -> combine_unweighted");
  const auto fc2 = std::find_if(ops.begin(), ops.end(), [](const auto& s) { return s.name == "fc2"; });
  ASSERT_NE(fc2, ops.end());
  EXPECT_FALSE(fc2->save_out) << "the fused backward does not read the expert output";
  EXPECT_FALSE(ops.back().weighted);
  EXPECT_EQ(layer::fuse_routing_weights(ops), 0) << "a second pass finds nothing left to fuse";
}

TEST(MoeProgram, WorkspaceHoldsSavedTensorsPerSlot) {
  MoeLayerOptions o = small();
  const auto train = MoeLayer::workspace_buffers(o);
  for (const char* name : {"slot0.router.scores", "slot1.router.scores", "slot0.fc1_out", "slot1.expert_out",
                           "slot1.row_of", "x_perm", "d.x_perm", "fc1.workspace"})
    EXPECT_TRUE(has_buffer(train, name)) << name;
  o.fuse_weights = true;
  EXPECT_FALSE(has_buffer(MoeLayer::workspace_buffers(o), "slot0.expert_out"));
  o.training = false;
  const auto infer = MoeLayer::workspace_buffers(o);
  EXPECT_FALSE(has_buffer(infer, "d.x_perm"));
  EXPECT_FALSE(has_buffer(infer, "slot1.router.scores")) << "inference keeps one slot";
  EXPECT_LT(MoeLayer::workspace_bytes(o), MoeLayer::workspace_bytes(small()));
}

TEST(MoeProgram, RowsHoldDroplessRoutingWithPadding) {
  MoeLayerOptions o = small();
  EXPECT_EQ(moe_layer_rows(o), 64 * 2);
  o.row_align = 32;
  EXPECT_EQ(moe_layer_rows(o), (64 * 2 + 8 * 31 + 31) / 32 * 32);
}

TEST(MoeProgram, OptionsAreValidatedWithTheRule) {
  auto message = [](MoeLayerOptions o) {
    try {
      validate(o);
    } catch (const Error& e) {
      return e.message();
    }
    return std::string();
  };
  MoeLayerOptions o = small();
  EXPECT_EQ(message(o), "");
  o.top_k = 9;
  EXPECT_NE(message(o).find("top_k must be in [1, min(8, experts = 8)], got 9"), std::string::npos) << message(o);
  o = small(), o.hidden = 100;
  EXPECT_NE(message(o).find("hidden must be a positive multiple of 16, got 100"), std::string::npos);
  o = small(), o.capacity_factor = -1;
  EXPECT_NE(message(o).find("capacity_factor"), std::string::npos);
  o = small(), o.max_tokens = 0;
  EXPECT_NE(message(o).find("max_tokens must be in [1, 2^24], got 0"), std::string::npos);
  o = small(), o.training = false, o.delay_wgrad = true;
  EXPECT_NE(message(o).find("delay_wgrad needs training"), std::string::npos);
}

TEST(MoeProgram, OptionsFollowTheConfig) {
  Config c = default_config();
  c.router.score = RouterScore::kSigmoid, c.router.fuse_weights = true, c.router.capacity_factor = 1.5;
  const MoeLayerOptions o = moe_layer_options(c, 512);
  EXPECT_EQ(o.score, RouterScore::kSigmoid);
  EXPECT_TRUE(o.fuse_weights);
  EXPECT_EQ(o.capacity_factor, 1.5);
  EXPECT_EQ(o.max_tokens, 512);
  EXPECT_EQ(o.experts, c.layer.experts);
  EXPECT_EQ(o.delay_wgrad, c.training.delay_wgrad);
}

}  // namespace
}  // namespace moegraph::test
