// The whole MoE layer on the mxfp8 recipe (FC1 and FC2 on MXFP8 copies, docs/mxfp8.md) against the
// fp64 layer reference with the same recipe (ref_moe_layer quantizes the same operands at the same
// points): forward and every gradient, eager and graph-replayed (bit-identical), inference against
// forward_train; inference at row_align 1 and 16 (forward only, any group starts); and that the
// check tells the recipes apart: the bf16 reference does not pass the mxfp8 layer's outputs at the
// same tolerance.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "moegraph/grouped_linear.hpp"
#include "moegraph/moe_layer.hpp"
#include "moegraph/mxfp8_weights.hpp"
#include "src/ops/moe/op_spec.hpp"
#include "testing/data.hpp"
#include "testing/graph.hpp"
#include "testing/moe_layer_reference.hpp"
#include "tests/common/expect.hpp"
#include "tests/gpu/moe_layer_harness.hpp"

namespace moegraph::test {
namespace {

// hidden and ffn multiples of 128, row_align 32 or 128: the recipe's shape rules for training.
const LayerCase kMxfp8Cases[] = {
    // name                          E   k  H    F    T   bias  sigm  renorm aux    cf    fuse  align mg    delay
    {"mxfp8_top2_bias_align32", 8, 2, 256, 128, 96, true, false, true, 0.0, 0.0, false, 32, true, false},
    {"mxfp8_e64_top4_align128_delay", 64, 4, 256, 384, 64, false, true, true, 0.01, 0.0, false, 128, false, true},
    {"mxfp8_fused_capacity_align32", 16, 3, 512, 256, 80, true, false, false, 0.001, 0.75, true, 32, true, true},
    // No bias, no fused weights, immediate wgrad: FC1's quantizer computes the SwiGLU's backward.
    {"mxfp8_swiglu_grad_align32", 16, 2, 256, 256, 96, false, false, true, 0.0, 0.0, false, 32, false, false},
};

class MoeLayerMxfp8Case : public ::testing::TestWithParam<LayerCase> {};

// Eager train steps at several token counts, then the inference forward on the same data.
TEST_P(MoeLayerMxfp8Case, TrainStepMatchesReference) {
  expect_train_steps_match(GetParam(), Recipe::kMXFP8, test_seed(GetParam().name));
}

// One capture replayed for other token counts and data (moe_layer_harness.hpp).
TEST_P(MoeLayerMxfp8Case, GraphReplaysMatchEagerAndReference) {
  expect_graph_replays_match(GetParam(), Recipe::kMXFP8, test_seed(GetParam().name) + 1);
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeLayerMxfp8Case, ::testing::ValuesIn(kMxfp8Cases),
                         [](const auto& info) { return std::string(info.param.name); });

// The weights' values kept dequantized to bf16 (dequantized_weights), on layers whose groups pass
// the swap-AB bound, so FC1 and FC2 run the bf16 kernels on those values: every output and
// gradient matches the mxfp8 reference, eager and replayed.
TEST(MoeLayerMxfp8, DequantizedWeightsMatchReference) {
  const LayerCase cases[] = {
      // name                        E   k  H    F    T    bias  sigm  renorm aux   cf   fuse  align mg    delay
      {"mxfp8_dequantized_e4_top2", 4, 2, 256, 256, 256, true, false, true, 0.0, 0.0, false, 32, true, false},
      kMxfp8Cases[1],  // 64 experts, row_align 128, delayed wgrad into dW
  };
  for (const LayerCase& c : cases) {
    MoeLayerOptions o = options_of(c, Recipe::kMXFP8);
    o.dequantized_weights = true;
    {
      LayerHarness h(o, 1);
      const std::string kernels = h.layer().describe();
      EXPECT_NE(kernels.find("kept bf16 values"), std::string::npos) << c.name << ": " << kernels;
    }
    expect_train_steps_match(c, o, test_seed(c.name) + 3);
    expect_graph_replays_match(c, o, test_seed(c.name) + 4);
  }
}

// A layer built for inference serves at row_align 1 and 16: its groups start anywhere, and it
// keeps no column-wise copies (a smaller workspace than the same layer at row_align 32). y against
// the forward-only mxfp8 reference, eagerly and from one capture replayed for other token counts
// (bit-identical to eager); training the same layer is refused, by the layer and by its linears.
TEST(MoeLayerMxfp8, InferenceAtRowAlign1And16MatchesReference) {
  for (int align : {1, 16}) {
    //                name               E   k  H    F    T   bias  sigm   renorm aux  cf   fuse  align  mg    delay
    const LayerCase c{"mxfp8_serving", 16, 3, 256, 384, 80, true, false, true, 0.0, 0.0, false, align, true, false};
    MoeLayerOptions o = options_of(c, Recipe::kMXFP8);
    o.training = false, o.wgrad_slots = 1;
    // No column-wise copy (x_t, dy_t or dy's values) in either expert linear; the same linears of a
    // training layer at row_align 32 keep x's (an inference layer's, forward_only, keep none at any
    // row_align: MoeProgram.InferenceLinearsAreForwardOnly).
    MoeLayerOptions aligned = o;
    aligned.row_align = 32, aligned.training = true;
    const auto copies = [](const MoeLayerOptions& opts) {
      int n = 0;
      for (int fc : {1, 2})
        for (const auto& b : GroupedLinear::workspace_buffers(layer::expert_linear_options(opts, fc, 256)))
          n += b.name.find("x_t") != std::string::npos || b.name.find("dy_t") != std::string::npos ||
               b.name.find("dy_values") != std::string::npos;
      return n;
    };
    EXPECT_EQ(copies(o), 0) << "row_align " << align;
    EXPECT_GT(copies(aligned), 0) << "row_align " << align;
    MoeLayerOptions trains = o;
    trains.training = true;
    try {
      validate(trains);
      ADD_FAILURE() << "mxfp8 training at row_align " << align << " must be refused";
    } catch (const Error& e) {
      EXPECT_NE(e.message().find("trains only at row_align 32 or 128"), std::string::npos) << e.message();
    }

    LayerHarness h(o, test_seed(c.name) + align);
    const auto infer = [&] { h.layer().forward(h.io(), h.stream()); };
    h.set_inputs(c.max_tokens);
    infer();  // warm-up outside capture
    testing::Graph graph(h.stream(), infer);
    for (int64_t n : {c.max_tokens, c.max_tokens / 2 + 1, int64_t{1}}) {
      h.set_inputs(n);
      h.poison();
      infer();
      h.layer().check_device_errors(h.stream());
      const LayerOutputs got = h.read();
      h.expect_matches_reference(got, detail::concat(c.name, " row_align ", align, " n=", n), false);
      h.poison();
      graph.launch(h.stream());
      EXPECT_TRUE(same_bits(h.read().y, got.y)) << "row_align " << align << " n=" << n << ": replay differs";
    }

    // The grouped linear itself refuses forward_train with the reason.
    GroupedLinearOptions g;
    g.num_groups = 4, g.in_features = 128, g.out_features = 256, g.capacity_rows = 112, g.row_align = align;
    g.recipe = Recipe::kMXFP8, g.prequantized_weights = true;
    EXPECT_NE(recipe_can_train(g).find("trains only at row_align 32 or 128"), std::string::npos);
    GroupedLinear linear(g);
    ForwardArgs args;
    DeviceArray<uint16_t> x(112 * 128), y(112 * 256);
    DeviceArray<int32_t> splits(4);
    DeviceArray<uint8_t> w(mxfp8_weight_data_bytes(4, 256, 128)), ws(mxfp8_weight_scale_bytes(4, 256, 128));
    args.x = x.get(), args.splits = splits.get(), args.y = y.get(), args.mxfp8_weights = {w.get(), ws.get()};
    try {
      linear.forward_train(args, h.stream());
      ADD_FAILURE() << "forward_train at row_align " << align << " must be refused";
    } catch (const Error& e) {
      EXPECT_NE(e.message().find("forward_train: the mxfp8 recipe trains only at row_align 32"), std::string::npos)
          << e.message();
    }
  }
}

// The check can fail: the same mxfp8 outputs that pass against the mxfp8 reference fail against
// the bf16 one (which skips the quantization) at the same tolerance, on y, dx and both expert
// weight gradients: they differ by the format's rounding, above the relative Frobenius bound.
TEST(MoeLayerMxfp8, Bf16ReferenceDoesNotPassTheMxfp8Layer) {
  for (const LayerCase& c : kMxfp8Cases) {
    LayerHarness h(options_of(c, Recipe::kMXFP8), test_seed(c.name) + 2);
    h.set_inputs(c.max_tokens);
    h.poison();
    h.train_step();
    h.layer().check_device_errors(h.stream());
    const LayerOutputs got = h.read();
    const MoeLayerRef mxfp8 = h.reference(true), bf16 = h.reference(true, Recipe::kBF16);
    const Tolerance tol = mxfp8_chain_tolerance();
    const int64_t n = c.max_tokens, hidden = c.hidden, ffn = c.ffn;
    const Mat y(got.y.begin(), got.y.begin() + n * hidden), dx(got.dx.begin(), got.dx.begin() + n * hidden);
    const std::vector<std::tuple<const char*, const Mat*, const Mat*, const Mat*, int64_t>> outputs{
        {"y", &y, &mxfp8.y, &bf16.y, hidden},
        {"dx", &dx, &mxfp8.dx, &bf16.dx, hidden},
        {"dw1", &got.dw1, &mxfp8.dw1, &bf16.dw1, hidden},
        {"dw2", &got.dw2, &mxfp8.dw2, &bf16.dw2, ffn}};
    for (const auto& [name, device, right, wrong, cols] : outputs) {
      const std::string where = detail::concat(c.name, " ", name);
      EXPECT_TRUE(passed(all_close(where + " vs the mxfp8 reference", *device, *right, cols, {}, tol)));
      const CompareResult against_bf16 = all_close(where + " vs the bf16 reference", *device, *wrong, cols, {}, tol);
      EXPECT_FALSE(against_bf16.ok) << where << ": the bf16 reference passes too (rel_fro " << against_bf16.rel_fro
                                    << "), so the check cannot tell the recipes apart";
      EXPECT_GT(against_bf16.rel_fro, tol.rel_fro) << where;
    }
  }
}

}  // namespace
}  // namespace moegraph::test
