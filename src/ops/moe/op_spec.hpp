// The MoE layer as a list of operator declarations, and the fusion pass that rewrites it. The
// program (layer_program.hpp) instantiates one LayerOp per declaration; the tensors named here
// are declared by their producers in the TensorTable.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "moegraph/grouped_linear.hpp"
#include "moegraph/moe_layer.hpp"
#include "src/ops/moe/layer_op.hpp"

namespace moegraph::layer {

enum class OpKind {
  kRouter,          // logits (cuBLASLt) -> scores, top-k, weights
  kDispatch,        // top-k -> expert-contiguous rows (splits, offsets, maps), permuted x (unless FC1 gathers)
  kAuxLoss,         // load-balancing loss from the scores and the counts
  kLinear,          // a GroupedLinear (FC1 or FC2)
  kSwiglu,          // a = silu(gate) * up
  kSwigluWeighted,  // a = w_row * silu(gate) * up: the routing weight fused in
  kCombine,         // y[t] = sum_j (w_tj) * out[row_of(t, j)]
};

struct OpSpec {
  OpKind kind{};
  std::string name{};           // unique: "router", "fc1", ...
  std::string in{}, out{};      // the tensor read and the tensor produced ("" where the io is used)
  bool save_out = false;        // the output is saved per slot (backward or wgrad reads it)
  bool save_d_in = false;       // the input gradient is saved per slot (a delayed wgrad reads it)
  bool weighted = true;         // kCombine: apply the top-k weights
  std::string bias_scale{};     // kLinear: tensor scaling the bias per row ("" none)
  int layer = 0;                // kLinear: 1 (hidden -> 2 ffn) or 2 (ffn -> hidden)
  // kLinear: `in` is never made; its rows are read from the layer's input x through this map
  // (ForwardArgs::x_rows; `in` still names the input gradient). kDispatch with out "": makes no
  // permuted copy of x.
  std::string gather{};
  // kLinear: `in` is never made; the operator reads this tensor (FC1's output, gate | up) and its
  // quantizer applies SwiGLU on the way in (ForwardArgs::x_swiglu), times the per-row tensor
  // `swiglu_weight` where that is not "". kSwiglu / kSwigluWeighted with forward_in_next: no forward
  // kernel and no `out` (it still names the gradient the next operator's backward gives).
  std::string swiglu_in{}, swiglu_weight{};
  bool forward_in_next = false;
  // kLinear: the output gradient is never made; backward reads the gradient of this tensor (the
  // SwiGLU's output: da) and the operator's saved output (gate | up), and its quantizer computes the
  // SwiGLU's input gradient as it reads (BackwardArgs::dy_swiglu_gate_up). kSwiglu with
  // backward_in_prev: no backward kernel and no input gradient.
  std::string dy_swiglu_of{};
  bool backward_in_prev = false;
};

// The unfused layer: router, dispatch, [aux loss], FC1, SwiGLU, FC2, weighted combine.
std::vector<OpSpec> moe_layer_ops(const MoeLayerOptions& options);
// Replaces SwiGLU + weighted combine by a SwiGLU that multiplies in each row's routing weight and
// an unweighted combine; FC2's bias (if any) is then scaled by the same weight, so the result is
// the same function. Returns the number of rewrites (0 when the pattern is absent).
int fuse_routing_weights(std::vector<OpSpec>& ops);
std::string describe(const std::vector<OpSpec>& ops);

// Whether the layer saves the expert linears' inputs (x_perm, swiglu_out) per slot, and with delayed
// wgrad their output gradients (d.fc1_out, d.expert_out), where the producers write them, so that
// FC1 and FC2 keep pointers instead of copies (GroupedLinearOptions::caller_keeps_activations):
// bf16 training on one GPU. The mxfp8 recipe saves quantized copies instead; with expert
// parallelism x_perm is the receive buffer that backward reuses for FC2's output gradient.
bool layer_keeps_linear_activations(const MoeLayerOptions& options);

// Whether FC1 reads the tokens through the dispatch's token_of_row instead of a permuted copy
// (ForwardArgs::x_rows): the mxfp8 recipe on one GPU, whose quantizer reads FC1's input once anyway.
// With expert parallelism FC1 reads the rows received from the other ranks.
bool layer_gathers_fc1_input(const MoeLayerOptions& options);
// Whether FC2's quantizer applies the SwiGLU to FC1's output as it reads it, so that no SwiGLU
// forward kernel runs and its output is never written (ForwardArgs::x_swiglu): the mxfp8 recipe,
// whose quantizer reads FC2's input once anyway.
bool layer_fc2_applies_swiglu(const MoeLayerOptions& options);
// Whether FC1's output-gradient quantizer computes the SwiGLU's backward from FC1's saved output
// and the SwiGLU's output gradient as it reads them, so that no SwiGLU backward kernel runs and FC1's
// output gradient is never written (BackwardArgs::dy_swiglu_gate_up): mxfp8 training without bias
// (FC1's bias gradient would read that gradient) and without the routing weights fused into the
// SwiGLU (whose backward also reduces each row's weight gradient).
bool layer_fc1_applies_swiglu_grad(const MoeLayerOptions& options);
// The one-GPU dispatch's kernels in words, for --plan and the operator's kernels(): whether it
// writes the permuted rows (`gathers_rows`) or FC1 reads the tokens through token_of_row.
std::string describe_local_dispatch(bool gathers_rows);
// The SwiGLU operator of a declaration (kSwiglu or kSwigluWeighted) in words, for its kernels() and
// --plan: the kernel of each direction, or the expert linear's quantizer that does its work
// (forward_in_next, backward_in_prev); the backward only when `training`.
std::string describe_swiglu(const OpSpec& spec, bool training);
// Whether the router computes a bucket's logits in one kernel straight from x (inference of at most
// 4 tokens, where it measured faster) rather than by cuBLASLt over a copy of x; and its description.
bool router_logits_from_x(const MoeLayerOptions& o);
std::string describe_router(const MoeLayerOptions& o);

// FC1 (layer 1: hidden -> 2 * ffn) or FC2 (layer 2: ffn -> hidden) of the experts, on
// `capacity_rows` grouped rows: the one translation of layer options into GroupedLinearOptions
// (the layer's operators and the expert-MLP step both use it; the layer's operators then set
// caller_keeps_activations where layer_keeps_linear_activations, which changes what a slot holds,
// not the kernels).
GroupedLinearOptions expert_linear_options(const MoeLayerOptions& options, int layer, int64_t capacity_rows);
// Why the recipe cannot run that expert linear as the layer would use it ("" when it can): its shape
// rules, and its training rules when options.training.
std::string expert_recipe_refusal(const MoeLayerOptions& options, int layer, int64_t capacity_rows);
// Throws (naming `owner`'s fields, e.g. "MoeLayerWeights") unless w1's and w2's MXFP8 tensors that
// options.prequantized_weights makes the layer read are set: data and scales, the transposed ones
// for training, the dequantized values with dequantized_weights.
void require_prequantized_weights(const MoeLayerOptions& options, const Mxfp8Weights& w1, const Mxfp8Weights& w2,
                                  const char* owner);

// The operator of a declaration (set-up only: may allocate). With expert parallelism the dispatch
// and the combine are the cross-rank ones (src/ops/moe/ep_ops.cpp), on `comm` (null: sizing only).
std::unique_ptr<LayerOp> make_op(const OpSpec& spec, const MoeLayerOptions& options, const MoeLayerWeights& weights,
                                 const std::shared_ptr<EpComm>& comm);
// Per kind, in their own files.
std::unique_ptr<LayerOp> make_router_op(const OpSpec&, const MoeLayerOptions&, const MoeLayerWeights&);
std::unique_ptr<LayerOp> make_aux_loss_op(const OpSpec&, const MoeLayerOptions&);
std::unique_ptr<LayerOp> make_dispatch_op(const OpSpec&, const MoeLayerOptions&);
std::unique_ptr<LayerOp> make_combine_op(const OpSpec&, const MoeLayerOptions&);
std::unique_ptr<LayerOp> make_linear_op(const OpSpec&, const MoeLayerOptions&, const MoeLayerWeights&);
std::unique_ptr<LayerOp> make_swiglu_op(const OpSpec&, const MoeLayerOptions&);
std::unique_ptr<LayerOp> make_ep_dispatch_op(const OpSpec&, const MoeLayerOptions&, std::shared_ptr<EpComm>);
std::unique_ptr<LayerOp> make_ep_combine_op(const OpSpec&, const MoeLayerOptions&, std::shared_ptr<EpComm>);

// Shared names of the routing tensors (declared by router and dispatch, read by the others).
namespace tensor {
inline constexpr const char* kTokens = "tokens";              // saved int32: n of the micro-batch
inline constexpr const char* kScores = "router.scores";       // saved [T, E] f32
inline constexpr const char* kTopkIds = "router.topk_ids";    // saved [T, k] i32
inline constexpr const char* kTopkWeights = "router.topk_w";  // saved [T, k] f32
inline constexpr const char* kDTopkWeights = "d.topk_w";      // [T, k] f32
inline constexpr const char* kCounts = "counts";              // saved [E] i32 (before dropping)
inline constexpr const char* kSplits = "splits";              // saved [E] i32
inline constexpr const char* kOffsets = "offsets";            // saved [E + 1] i64
inline constexpr const char* kRowOf = "row_of";               // saved [T, k] i32
inline constexpr const char* kTokenOfRow = "token_of_row";    // saved [rows] i32
inline constexpr const char* kRowWeight = "row_weight";       // saved [rows] f32
inline constexpr const char* kDRowWeight = "d.row_weight";    // [rows] f32
inline constexpr const char* kPermutedX = "x_perm";           // [rows, hidden]
inline std::string grad(const std::string& name) { return "d." + name; }
}  // namespace tensor

}  // namespace moegraph::layer
