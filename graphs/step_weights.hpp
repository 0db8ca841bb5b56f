// The weights, biases and gradients a step's options need, as one walk: sized for --plan, and
// laid out by callers that keep them in one block (the benchmark, the tests).
#pragma once

#include "moegraph/step_graphs.hpp"
#include "src/core/checked.hpp"
#include "src/core/layout.hpp"

namespace moegraph {

inline StepWeights lay_out_weights(const StepGraphsOptions& options, LayoutWalker& walk) {
  const MoeLayerOptions& l = options.layer;
  const std::size_t es = dtype_size(l.dtype), fp32 = sizeof(float);
  // With expert parallelism a rank holds its own experts' tensors but the whole router.
  const int64_t router_rows = l.experts, g = moe_local_experts(l);
  const int64_t h = l.hidden, f2 = checked_mul("2 * ffn", 2, l.ffn), f = l.ffn;
  StepWeights w;
  const bool layer = options.step == StepKind::kMoeLayer;
  if (layer) w.router = walk.take("router", router_rows, h, es);
  w.w1 = walk.take("w1", g, f2, h, es);
  w.w2 = walk.take("w2", g, h, f, es);
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
