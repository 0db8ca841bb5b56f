// The MoE layer program without a GPU: the operator list, the fusion pass, the option checks and
// the workspace layout (saved tensors once per slot, nothing for backward in inference).
#include <gtest/gtest.h>

#include <algorithm>

#include "moegraph/config.hpp"
#include "moegraph/error.hpp"
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
                           "slot1.row_of", "slot0.x_perm", "d.x_perm", "fc1.workspace"})
    EXPECT_TRUE(has_buffer(train, name)) << name;
  o.fuse_weights = true;
  EXPECT_FALSE(has_buffer(MoeLayer::workspace_buffers(o), "slot0.expert_out"));
  o.training = false;
  const auto infer = MoeLayer::workspace_buffers(o);
  EXPECT_FALSE(has_buffer(infer, "d.x_perm"));
  EXPECT_FALSE(has_buffer(infer, "slot1.router.scores")) << "inference keeps one slot";
  EXPECT_LT(MoeLayer::workspace_bytes(o), MoeLayer::workspace_bytes(small()));
}

// The mxfp8 recipe on one GPU: FC1's quantizer reads the tokens through the dispatch's
// token_of_row, so the dispatch makes no permuted copy of x (for training or inference); the input
// gradient keeps its name. bf16, and expert parallelism (FC1 reads the received rows), keep it.
TEST(MoeProgram, Mxfp8Fc1GathersTheTokensInsteadOfAPermutedCopy) {
  MoeLayerOptions o = small();
  o.recipe = Recipe::kMXFP8, o.hidden = 128, o.ffn = 128, o.row_align = 32;
  ASSERT_TRUE(layer::layer_gathers_fc1_input(o));
  EXPECT_EQ(layer::describe(layer::moe_layer_ops(o)),
            "router -> dispatch -> fc1(x by token_of_row)(dy = swiglu'(fc1_out) d.swiglu_out) -> swiglu -> "
            "fc2(x = swiglu(fc1_out)) -> combine");
  const auto train = MoeLayer::workspace_buffers(o);
  EXPECT_TRUE(has_buffer(train, "d.x_perm"));
  for (const char* name : {"x_perm", "slot0.x_perm", "slot1.x_perm"}) EXPECT_FALSE(has_buffer(train, name)) << name;
  MoeLayerOptions bf16 = o;
  bf16.recipe = Recipe::kBF16;
  EXPECT_FALSE(layer::layer_gathers_fc1_input(bf16));
  EXPECT_TRUE(has_buffer(MoeLayer::workspace_buffers(bf16), "slot0.x_perm"));
  o.training = false, o.wgrad_slots = 1;
  EXPECT_FALSE(has_buffer(MoeLayer::workspace_buffers(o), "x_perm")) << "inference gathers too";
  o.expert_parallel = 2;
  EXPECT_FALSE(layer::layer_gathers_fc1_input(o));
  const auto window = MoeLayer::window_buffers(o);
  EXPECT_TRUE(std::any_of(window.begin(), window.end(), [](const auto& b) { return b.name == "x_perm"; }))
      << "with expert parallelism FC1 reads the received rows";
  EXPECT_EQ(layer::describe(layer::moe_layer_ops(o)),
            "router -> dispatch -> fc1 -> swiglu -> fc2(x = swiglu(fc1_out)) -> combine");
}

// The mxfp8 recipe: FC2's quantizer applies the SwiGLU to FC1's output as it reads it (also with
// expert parallelism, and with the routing weights fused in, where it weighs the rows too), so no
// SwiGLU forward runs and swiglu_out is never declared; its gradient keeps its name. bf16 keeps the
// SwiGLU kernel.
TEST(MoeProgram, Mxfp8Fc2QuantizerAppliesTheSwiglu) {
  MoeLayerOptions o = small();
  o.recipe = Recipe::kMXFP8, o.hidden = 128, o.ffn = 128, o.row_align = 32;
  ASSERT_TRUE(layer::layer_fc2_applies_swiglu(o));
  auto ops = layer::moe_layer_ops(o);
  const auto named = [&](const char* name) {
    return *std::find_if(ops.begin(), ops.end(), [&](const auto& s) { return s.name == name; });
  };
  EXPECT_TRUE(named("swiglu").forward_in_next);
  EXPECT_EQ(named("fc2").swiglu_in, "fc1_out");
  EXPECT_EQ(named("fc2").in, "swiglu_out") << "the input gradient keeps its name";
  ASSERT_EQ(layer::fuse_routing_weights(ops), 1);
  EXPECT_EQ(layer::describe(ops), "router -> dispatch -> fc1(x by token_of_row) -> swiglu_weighted -> "
                                  "fc2(bias x row_weight)(x = row_weight * swiglu(fc1_out)) -> combine_unweighted");
  for (bool fused : {false, true})
    for (bool training : {true, false}) {
      MoeLayerOptions t = o;
      t.fuse_weights = fused, t.training = training, t.wgrad_slots = training ? 2 : 1;
      const auto buffers = MoeLayer::workspace_buffers(t);
      EXPECT_FALSE(has_buffer(buffers, "swiglu_out")) << training << fused;
      EXPECT_EQ(has_buffer(buffers, "d.swiglu_out"), training) << fused;
    }
  MoeLayerOptions ep = o;
  ep.expert_parallel = 2;
  ASSERT_TRUE(layer::layer_fc2_applies_swiglu(ep));
  const auto ep_ops = layer::moe_layer_ops(ep);
  EXPECT_TRUE(std::any_of(ep_ops.begin(), ep_ops.end(), [](const auto& s) { return s.swiglu_in == "fc1_out"; }))
      << "with expert parallelism too";
  MoeLayerOptions bf16 = small();
  EXPECT_FALSE(layer::layer_fc2_applies_swiglu(bf16));
  for (const auto& spec : layer::moe_layer_ops(bf16)) EXPECT_FALSE(spec.forward_in_next || !spec.swiglu_in.empty());
}

// bf16 training: FC1 and FC2 keep pointers to their inputs and (delayed wgrad) output gradients,
// so the layer saves those per slot where dispatch, SwiGLU, combine and the SwiGLU backward write
// them, and the linears' workspaces hold no copies. The mxfp8 recipe saves quantized copies
// instead, and then the layer's tensors stay per step.
TEST(MoeProgram, Bf16TrainingSavesTheLinearsActivationsWhereTheyAreWritten) {
  MoeLayerOptions o = small();
  o.delay_wgrad = true;
  ASSERT_TRUE(layer::layer_keeps_linear_activations(o));
  const auto saved = MoeLayer::workspace_buffers(o);
  for (const char* name : {"slot0.x_perm", "slot1.x_perm", "slot0.swiglu_out", "slot1.swiglu_out",
                           "slot0.d.fc1_out", "slot1.d.fc1_out", "slot0.d.expert_out", "slot1.d.expert_out"})
    EXPECT_TRUE(has_buffer(saved, name)) << name;
  for (const char* name : {"x_perm", "swiglu_out", "d.fc1_out", "d.expert_out"})
    EXPECT_FALSE(has_buffer(saved, name)) << name << " is saved per slot, not per step";
  for (int layer : {1, 2}) {
    GroupedLinearOptions g = layer::expert_linear_options(o, layer, moe_expert_rows(o));
    const std::size_t copies = GroupedLinear::workspace_bytes(g);
    g.caller_keeps_activations = true;
    for (const auto& b : GroupedLinear::workspace_buffers(g))
      EXPECT_TRUE(b.name.find(".x") == std::string::npos && b.name.find(".dy") == std::string::npos)
          << "fc" << layer << " keeps " << b.name;
    // Two slots of x [rows, K] and dy [rows, N], 2 bytes each, at least.
    EXPECT_GE(copies - GroupedLinear::workspace_bytes(g),
              std::size_t(2 * moe_expert_rows(o) * (g.in_features + g.out_features) * 2));
  }

  o.delay_wgrad = false;  // the gradients are read in the backward that writes them
  const auto immediate = MoeLayer::workspace_buffers(o);
  EXPECT_TRUE(has_buffer(immediate, "slot1.x_perm"));
  EXPECT_TRUE(has_buffer(immediate, "d.expert_out"));
  EXPECT_FALSE(has_buffer(immediate, "slot0.d.expert_out"));

  o.recipe = Recipe::kMXFP8, o.hidden = 128, o.ffn = 128, o.row_align = 32, o.delay_wgrad = true;
  ASSERT_FALSE(layer::layer_keeps_linear_activations(o));
  const auto mxfp8 = MoeLayer::workspace_buffers(o);
  for (const char* name : {"d.swiglu_out", "d.expert_out"}) EXPECT_TRUE(has_buffer(mxfp8, name)) << name;
  EXPECT_FALSE(has_buffer(mxfp8, "swiglu_out")) << "fc2's quantizer applies the SwiGLU: its output is never made";
  EXPECT_FALSE(has_buffer(mxfp8, "d.fc1_out")) << "fc1's quantizer applies the SwiGLU's backward";
  GroupedLinearOptions g = layer::expert_linear_options(o, 1, moe_expert_rows(o));
  g.caller_keeps_activations = true;
  std::string refusal;
  try {
    validate(g);
  } catch (const Error& e) {
    refusal = e.what();
  }
  EXPECT_NE(refusal.find("caller_keeps_activations needs the bf16 recipe"), std::string::npos) << refusal;
  o.recipe = Recipe::kBF16, o.training = false;
  EXPECT_FALSE(layer::layer_keeps_linear_activations(o));
}

// The mxfp8 recipe, training: FC1's output-gradient quantizer computes the SwiGLU's backward from
// fc1_out and d.swiglu_out as it reads them, so no SwiGLU backward runs and d.fc1_out is never
// declared (with expert parallelism too). Not with a bias (FC1's bias gradient reads d.fc1_out), nor
// with the routing weights fused into the SwiGLU (its backward reduces each row's weight gradient),
// nor in bf16; inference has no backward.
TEST(MoeProgram, Mxfp8Fc1QuantizerAppliesTheSwigluBackward) {
  MoeLayerOptions o = small();
  o.recipe = Recipe::kMXFP8, o.hidden = 128, o.ffn = 128, o.row_align = 32;
  const auto named = [](const std::vector<layer::OpSpec>& ops, const char* name) {
    return *std::find_if(ops.begin(), ops.end(), [&](const auto& s) { return s.name == name; });
  };
  for (int ep : {1, 2}) {
    MoeLayerOptions t = o;
    t.expert_parallel = ep;
    ASSERT_TRUE(layer::layer_fc1_applies_swiglu_grad(t));
    const auto ops = layer::moe_layer_ops(t);
    EXPECT_TRUE(named(ops, "swiglu").backward_in_prev);
    EXPECT_EQ(named(ops, "fc1").dy_swiglu_of, "swiglu_out");
    EXPECT_EQ(named(ops, "fc1").out, "fc1_out");
    EXPECT_TRUE(named(ops, "fc1").save_out) << "backward reads fc1_out";
  }
  const auto buffers = MoeLayer::workspace_buffers(o);
  EXPECT_FALSE(has_buffer(buffers, "d.fc1_out"));
  EXPECT_TRUE(has_buffer(buffers, "d.swiglu_out"));
  EXPECT_TRUE(has_buffer(buffers, "slot0.fc1_out"));

  // Where it does not apply, the SwiGLU's backward runs and writes d.fc1_out.
  MoeLayerOptions bias = o, fused = o, bf16 = o, serving = o;
  bias.bias = true;
  fused.fuse_weights = true;
  bf16.recipe = Recipe::kBF16;
  serving.training = false, serving.wgrad_slots = 1;
  for (const MoeLayerOptions* other : {&bias, &fused, &bf16}) {
    EXPECT_FALSE(layer::layer_fc1_applies_swiglu_grad(*other));
    auto ops = layer::moe_layer_ops(*other);
    if (other->fuse_weights) layer::fuse_routing_weights(ops);
    for (const auto& spec : ops) EXPECT_TRUE(spec.dy_swiglu_of.empty() && !spec.backward_in_prev) << spec.name;
    EXPECT_TRUE(has_buffer(MoeLayer::workspace_buffers(*other), "d.fc1_out"));
  }
  EXPECT_FALSE(layer::layer_fc1_applies_swiglu_grad(serving));
  // The fusion pass undoes it where it weighs the rows into the SwiGLU.
  auto ops = layer::moe_layer_ops(o);
  ASSERT_EQ(layer::fuse_routing_weights(ops), 1);
  for (const auto& spec : ops) EXPECT_TRUE(spec.dy_swiglu_of.empty() && !spec.backward_in_prev) << spec.name;
}

// A layer built for inference builds its expert linears forward_only: they lay out no slots (x or
// its MXFP8 column-wise copies, splits, offsets, bias scale) and no training scratch, in either
// recipe, at any row_align (mxfp8 at 32 used to keep x_t, dy_t and a wgrad staging), so the
// linears' workspaces are smaller than the training layer's single-slot ones; the operator itself
// refuses to train, with the reason, and the combinations only training uses.
TEST(MoeProgram, InferenceLinearsAreForwardOnly) {
  const auto slot_buffers = [](const GroupedLinearOptions& g) {
    std::vector<std::string> names;
    for (const auto& b : GroupedLinear::workspace_buffers(g))
      if (b.name.rfind("slot", 0) == 0 || b.name.find("dy") != std::string::npos ||
          b.name.find("x_t") != std::string::npos || b.name.find("bias_grad") != std::string::npos)
        names.push_back(b.name);
    return names;
  };
  for (Recipe recipe : {Recipe::kBF16, Recipe::kMXFP8})
    for (int align : {1, 32, 128}) {
      MoeLayerOptions o = small();
      o.recipe = recipe, o.hidden = 128, o.ffn = 128, o.row_align = align, o.bias = true;
      o.training = false, o.wgrad_slots = 1;
      MoeLayerOptions trains = o;
      trains.training = true, trains.delay_wgrad = false;
      const bool can_train = recipe == Recipe::kBF16 || align >= 32;
      for (int fc : {1, 2}) {
        SCOPED_TRACE(detail::concat(recipe_name(recipe), " row_align ", align, " fc", fc));
        const GroupedLinearOptions g = layer::expert_linear_options(o, fc, moe_expert_rows(o));
        EXPECT_TRUE(g.forward_only);
        EXPECT_EQ(slot_buffers(g), std::vector<std::string>{});
        EXPECT_NE(recipe_can_train(g).find("built forward_only"), std::string::npos) << recipe_can_train(g);
        if (!can_train) continue;
        const GroupedLinearOptions t = layer::expert_linear_options(trains, fc, moe_expert_rows(trains));
        EXPECT_FALSE(t.forward_only);
        EXPECT_FALSE(slot_buffers(t).empty());
        EXPECT_LT(GroupedLinear::workspace_bytes(g), GroupedLinear::workspace_bytes(t));
      }
      if (can_train) {
        EXPECT_LT(MoeLayer::workspace_bytes(o), MoeLayer::workspace_bytes(trains));
      }
    }
  GroupedLinearOptions g;
  g.num_groups = 4, g.in_features = 128, g.out_features = 128, g.capacity_rows = 128, g.forward_only = true;
  for (int which : {0, 1}) {
    GroupedLinearOptions bad = g;
    (which == 0 ? bad.delay_wgrad : bad.caller_keeps_activations) = true;
    std::string refusal;
    try {
      validate(bad);
    } catch (const Error& e) {
      refusal = e.message();
    }
    EXPECT_NE(refusal.find("forward_only cannot be combined with delay_wgrad or caller_keeps_activations"),
              std::string::npos)
        << refusal;
  }
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
