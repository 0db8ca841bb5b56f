#include "src/ops/moe/op_spec.hpp"

#include <string>

#include "kernels/routing/moe_routing.hpp"
#include "moegraph/error.hpp"

namespace moegraph::layer {

bool layer_keeps_linear_activations(const MoeLayerOptions& o) {
  return o.training && o.recipe == Recipe::kBF16 && o.expert_parallel == 1;
}

bool layer_gathers_fc1_input(const MoeLayerOptions& o) {
  return o.recipe == Recipe::kMXFP8 && o.expert_parallel == 1;
}

bool layer_fc2_applies_swiglu(const MoeLayerOptions& o) { return o.recipe == Recipe::kMXFP8; }

bool layer_fc1_applies_swiglu_grad(const MoeLayerOptions& o) {
  return o.recipe == Recipe::kMXFP8 && o.training && !o.bias && !o.fuse_weights;
}

std::string describe_local_dispatch(bool gathers_rows) {
  return std::string("dispatch: stable counting sort by expert (chunk counts, one-block scan, ranked scatter; a "
                     "small batch all in one block) into the group layout (splits, offsets), ") +
         (gathers_rows ? "row gather" : "no row gather (fc1's quantizer reads the tokens through token_of_row)");
}

std::string describe_swiglu(const OpSpec& spec, bool training) {
  const bool weighted = spec.kind == OpKind::kSwigluWeighted;
  const std::string value = weighted ? "w_row * silu(gate) * up" : "silu(gate) * up";
  std::string s = spec.name + ": forward " +
                  (spec.forward_in_next ? "in fc2's MXFP8 quantizer (" + value + " as it reads fc1_out)"
                                        : value + ", 8 x 16-bit per thread, grid-stride over the used rows");
  if (!training) return s;  // inference runs no backward
  if (spec.backward_in_prev) return s + "; backward in fc1's MXFP8 quantizer (dgate | dup as it reads fc1_out and da)";
  return s + (weighted ? "; backward a group of lanes per row, its weight gradient summed in a fixed order"
                       : "; backward 8 x 16-bit per thread, grid-stride over the used rows");
}

bool router_logits_from_x(const MoeLayerOptions& o) {
  return !o.training && o.max_tokens <= kernels::kRouterSmallTokens;
}

std::string describe_router(const MoeLayerOptions& o) {
  return std::string("router: logits ") +
         (router_logits_from_x(o) ? "from x in one kernel, a block per expert (fp32; up to " +
                                        std::to_string(kernels::kRouterSmallTokens) + " tokens, aligned x)"
                                  : "x W_r^T by cuBLASLt (bf16 in, fp32 out)") +
         "; scores + top-k, one warp per token" +
         (o.training ? "; backward: d_logits kernel, dx += d_logits W_r and dW_r by cuBLASLt" : "");
}

std::vector<OpSpec> moe_layer_ops(const MoeLayerOptions& o) {
  const bool keep = layer_keeps_linear_activations(o), keep_grads = keep && o.delay_wgrad;
  const bool gather = layer_gathers_fc1_input(o);
  std::vector<OpSpec> ops;
  ops.push_back({.kind = OpKind::kRouter, .name = "router", .save_out = true});
  ops.push_back(
      {.kind = OpKind::kDispatch, .name = "dispatch", .out = gather ? "" : tensor::kPermutedX, .save_out = keep});
  if (o.aux_loss_coef != 0.0) ops.push_back({.kind = OpKind::kAuxLoss, .name = "aux_loss"});
  ops.push_back({.kind = OpKind::kLinear,
                 .name = "fc1",
                 .in = tensor::kPermutedX,
                 .out = "fc1_out",
                 .save_out = true,
                 .layer = 1,
                 .gather = gather ? tensor::kTokenOfRow : ""});
  ops.push_back({.kind = OpKind::kSwiglu,
                 .name = "swiglu",
                 .in = "fc1_out",
                 .out = "swiglu_out",
                 .save_out = keep,
                 .save_d_in = keep_grads});
  // The combine's backward needs each row's expert output for the weight gradient (with expert
  // parallelism it keeps the copy that came back to this rank instead).
  ops.push_back({.kind = OpKind::kLinear,
                 .name = "fc2",
                 .in = "swiglu_out",
                 .out = "expert_out",
                 .save_out = o.expert_parallel == 1,
                 .layer = 2});
  if (layer_fc2_applies_swiglu(o)) {
    ops[ops.size() - 2].forward_in_next = true;
    ops.back().swiglu_in = "fc1_out";
  }
  if (layer_fc1_applies_swiglu_grad(o)) {
    ops[ops.size() - 2].backward_in_prev = true;
    ops[ops.size() - 3].dy_swiglu_of = "swiglu_out";
  }
  ops.push_back({.kind = OpKind::kCombine, .name = "combine", .in = "expert_out", .save_d_in = keep_grads});
  return ops;
}

int fuse_routing_weights(std::vector<OpSpec>& ops) {
  int rewrites = 0;
  for (std::size_t i = 0; i + 2 < ops.size(); ++i) {
    OpSpec &act = ops[i], &fc2 = ops[i + 1], &combine = ops[i + 2];
    if (act.kind != OpKind::kSwiglu || fc2.kind != OpKind::kLinear || combine.kind != OpKind::kCombine ||
        !combine.weighted || fc2.in != act.out || combine.in != fc2.out)
      continue;
    act.kind = OpKind::kSwigluWeighted;
    act.name = "swiglu_weighted";
    // Its backward also reduces each row's weight gradient: FC1's quantizer does not take it over.
    act.backward_in_prev = false;
    for (OpSpec& fc1 : ops)
      if (fc1.kind == OpKind::kLinear && fc1.out == act.in) fc1.dy_swiglu_of.clear();
    if (!fc2.swiglu_in.empty()) fc2.swiglu_weight = tensor::kRowWeight;  // FC2's quantizer weighs the rows
    fc2.bias_scale = tensor::kRowWeight;
    fc2.save_out = false;  // the weight gradient now comes from the SwiGLU side: no saved expert output
    combine.weighted = false;
    combine.name = "combine_unweighted";
    ++rewrites;
  }
  return rewrites;
}

std::string describe(const std::vector<OpSpec>& ops) {
  std::string s;
  for (const OpSpec& op : ops) {
    s += s.empty() ? "" : " -> ";
    s += op.name;
    if (!op.bias_scale.empty()) s += "(bias x " + op.bias_scale + ")";
    if (!op.gather.empty()) s += "(x by " + op.gather + ")";
    if (!op.swiglu_in.empty())
      s += "(x = " + std::string(op.swiglu_weight.empty() ? "" : op.swiglu_weight + " * ") + "swiglu(" +
           op.swiglu_in + "))";
    if (!op.dy_swiglu_of.empty()) s += "(dy = swiglu'(" + op.out + ") d." + op.dy_swiglu_of + ")";
  }
  return s;
}

std::unique_ptr<LayerOp> make_op(const OpSpec& spec, const MoeLayerOptions& o, const MoeLayerWeights& w,
                                 const std::shared_ptr<EpComm>& comm) {
  const bool ep = o.expert_parallel > 1;
  switch (spec.kind) {
    case OpKind::kRouter: return make_router_op(spec, o, w);
    case OpKind::kDispatch: return ep ? make_ep_dispatch_op(spec, o, comm) : make_dispatch_op(spec, o);
    case OpKind::kAuxLoss: return make_aux_loss_op(spec, o);
    case OpKind::kLinear: return make_linear_op(spec, o, w);
    case OpKind::kSwiglu:
    case OpKind::kSwigluWeighted: return make_swiglu_op(spec, o);
    case OpKind::kCombine: return ep ? make_ep_combine_op(spec, o, comm) : make_combine_op(spec, o);
  }
  MG_FAIL("unknown operator kind for \"", spec.name, "\"");
}

}  // namespace moegraph::layer
