// The weights, biases and gradients a step's options need, as one walk: sized for --plan, and
// laid out by callers that keep them in one block (the benchmark, the tests); and the MXFP8 weight
// copies a StepGraphs shares among its buckets.
#pragma once

#include <string>
#include <string_view>

#include "moegraph/mxfp8_weights.hpp"
#include "moegraph/step_graphs.hpp"
#include "src/core/checked.hpp"
#include "src/core/layout.hpp"

namespace moegraph {

// The name ending of the laid-out bf16 values (dequantized_weights): the plan sums them by it.
inline constexpr std::string_view kMxfp8ValuesSuffix = ".mxfp8.bf16";

// MXFP8 weights [g, n, k] in the layouts of moegraph/mxfp8_weights.hpp: data and scales, and with
// `transposed` (training: dgrad reads W_e^T) data_t and scales_t; with `dequantized` (options'
// dequantized_weights) the bf16 values of each pair laid out; with `tiled` each pair's tiled scales.
inline Mxfp8Weights lay_out_mxfp8_weights(LayoutWalker& walk, const std::string& name, int64_t g, int64_t n,
                                          int64_t k, bool transposed, bool dequantized, bool tiled) {
  const int groups = static_cast<int>(g);  // validated options: at most kMaxGroups
  const std::size_t data = mxfp8_weight_data_bytes(groups, n, k), scales = mxfp8_weight_scale_bytes(groups, n, k);
  const std::size_t values = dequantized ? mxfp8_dequantized_weight_bytes(groups, n, k) : 0;
  const std::size_t tiled_scales = tiled ? mxfp8_tiled_scale_bytes(groups, n, k) : 0;
  Mxfp8Weights w;
  w.data = walk.take<uint8_t>(name + ".mxfp8", data);
  w.scales = walk.take<uint8_t>(name + ".mxfp8.scales", scales);
  if (dequantized) w.dequantized = walk.take(name + std::string(kMxfp8ValuesSuffix), values);
  if (tiled) w.scales_tiled = walk.take<uint8_t>(name + ".mxfp8.tiled_scales", tiled_scales);
  if (!transposed) return w;
  w.data_t = walk.take<uint8_t>(name + "_t.mxfp8", data);
  w.scales_t = walk.take<uint8_t>(name + "_t.mxfp8.scales", scales);
  if (dequantized) w.dequantized_t = walk.take(name + "_t" + std::string(kMxfp8ValuesSuffix), values);
  if (tiled) w.scales_t_tiled = walk.take<uint8_t>(name + "_t.mxfp8.tiled_scales", tiled_scales);
  return w;
}

// The MXFP8 copies of w1 and w2 that a StepGraphs of the mxfp8 recipe quantizes once per weight
// update and shares with all its buckets (none when the caller gives them: prequantized_weights).
inline bool step_owns_mxfp8_weights(const MoeLayerOptions& l) {
  return l.recipe == Recipe::kMXFP8 && !l.prequantized_weights;
}
// The copies a StepGraphs owns (step_owns_mxfp8_weights) carry the tiled scales of the route of
// few rows a group (its decode and small buckets); the caller's (prequantized_weights) do not, since
// a caller filling this layout from a checkpoint would not know to write them.
inline void lay_out_mxfp8_pair(const StepGraphsOptions& options, LayoutWalker& walk, StepWeights& w) {
  const MoeLayerOptions& l = options.layer;
  const int64_t g = moe_local_experts(l), f2 = checked_mul("2 * ffn", 2, l.ffn);
  const bool tiled = step_owns_mxfp8_weights(l);
  w.w1_mxfp8 = lay_out_mxfp8_weights(walk, "w1", g, f2, l.hidden, l.training, l.dequantized_weights, tiled);
  w.w2_mxfp8 = lay_out_mxfp8_weights(walk, "w2", g, l.hidden, l.ffn, l.training, l.dequantized_weights, tiled);
}

// The caller's parameters: with prequantized_weights the expert weights are MXFP8 (no 16-bit w1, w2).
inline StepWeights lay_out_weights(const StepGraphsOptions& options, LayoutWalker& walk) {
  const MoeLayerOptions& l = options.layer;
  const std::size_t es = dtype_size(l.dtype), fp32 = sizeof(float);
  // With expert parallelism a rank holds its own experts' tensors but the whole router.
  const int64_t router_rows = l.experts, g = moe_local_experts(l);
  const int64_t h = l.hidden, f2 = checked_mul("2 * ffn", 2, l.ffn), f = l.ffn;
  StepWeights w;
  const bool layer = options.step == StepKind::kMoeLayer;
  if (layer) w.router = walk.take("router", router_rows, h, es);
  if (l.prequantized_weights) {
    lay_out_mxfp8_pair(options, walk, w);
  } else {
    w.w1 = walk.take("w1", g, f2, h, es);
    w.w2 = walk.take("w2", g, h, f, es);
  }
  if (l.bias) {
    w.b1 = walk.take("b1", g, f2, es);
    w.b2 = walk.take("b2", g, h, es);
  }
  if (!l.training) return w;
  if (l.main_grad_fp32) {
    if (layer) w.main_grad_router = walk.take<float>("main_grad_router", router_rows, h, fp32);
    w.main_grad1 = walk.take<float>("main_grad1", g, f2, h, fp32);
    w.main_grad2 = walk.take<float>("main_grad2", g, h, f, fp32);
  } else {
    if (layer) w.d_router = walk.take("d_router", router_rows, h, es);
    w.dw1 = walk.take("dw1", g, f2, h, es);
    w.dw2 = walk.take("dw2", g, h, f, es);
  }
  if (l.bias) {
    w.db1 = walk.take("db1", g, f2, es);
    w.db2 = walk.take("db2", g, h, es);
  }
  return w;
}

}  // namespace moegraph
