// The experts: FC1 and FC2 (GroupedLinear on the dispatch's device splits) and the SwiGLU between
// them, optionally with each row's routing weight multiplied in (the fused variant).
#include <memory>

#include "kernels/common/alignment.hpp"
#include "kernels/common/device_query.hpp"
#include "kernels/elementwise/elementwise.hpp"
#include "kernels/routing/moe_routing.hpp"
#include "moegraph/error.hpp"
#include "moegraph/grouped_linear.hpp"
#include "src/core/checked.hpp"
#include "src/ops/moe/op_spec.hpp"

namespace moegraph::layer {
namespace {

// The gradient FC2 gives its per-row bias scale when the routing weights are fused in.
constexpr const char* kDBiasScale = "d.bias_scale";

class LinearOp final : public LayerOp {
 public:
  LinearOp(const OpSpec& spec, const MoeLayerOptions& o, const MoeLayerWeights& w)
      : spec_(spec), o_(o), g_(expert_linear_options(o, spec.layer, moe_expert_rows(o))) {
    MG_CHECK(spec.layer == 1 || spec.layer == 2, "linear operator \"", spec.name, "\" must be FC1 or FC2");
    // The layer saves this operator's input and output gradient per slot (moe_layer_ops).
    g_.caller_keeps_activations = layer_keeps_linear_activations(o);
    set_weights(w);
    scaled_bias_ = o.bias && !spec.bias_scale.empty();
  }
  void set_weights(const MoeLayerWeights& w) override {
    const bool fc1 = spec_.layer == 1;
    weight_ = fc1 ? w.w1 : w.w2;
    bias_ = fc1 ? w.b1 : w.b2;
    dbias_ = fc1 ? w.db1 : w.db2;
    dweight_ = fc1 ? w.dw1 : w.dw2;
    main_grad_ = fc1 ? w.main_grad1 : w.main_grad2;
    mxfp8_ = fc1 ? w.w1_mxfp8 : w.w2_mxfp8;
  }
  std::string name() const override { return spec_.name; }
  std::string kernels() const override {
    return op_ ? spec_.name + ": " + op_->describe() : spec_.name + ": grouped GEMM (GroupedLinear)";
  }

  void declare(TensorTable& t, bool training) override {
    const std::size_t es = dtype_size(o_.dtype);
    t.declare(spec_.out, checked_mul(spec_.out, g_.capacity_rows, g_.out_features, es),
              spec_.save_out ? Lifetime::kSaved : Lifetime::kStep);
    t.declare(spec_.name + ".workspace", GroupedLinear::workspace_bytes(g_), Lifetime::kStep);
    if (!training) return;
    const std::string d_in = tensor::grad(spec_.in);
    t.declare(d_in, checked_mul(d_in, g_.capacity_rows, g_.in_features, es), Lifetime::kStep);
    if (scaled_bias_)
      t.declare(kDBiasScale, checked_mul(kDBiasScale, g_.capacity_rows, sizeof(float)), Lifetime::kStep);
  }

  void bind(TensorTable& t) override { op_ = std::make_unique<GroupedLinear>(g_, t.get(spec_.name + ".workspace")); }
  void require_ready() const override { op_->require_weights_ready(); }
  DeviceErrorRecord take_device_error() override { return op_ ? op_->take_device_error() : DeviceErrorRecord{}; }

  void forward(const Phase& p, cudaStream_t stream) override {
    const TensorTable& t = *p.tensors;
    const int s = p.slot;
    // The dispatch's group layout: planned once per micro-batch, checked there.
    const bool gather = !spec_.gather.empty(), swiglu = !spec_.swiglu_in.empty();
    const void* x = gather ? p.io->x : t.get(swiglu ? spec_.swiglu_in : spec_.in, s);  // gather: the bucket's tokens
    ForwardArgs a{x, t.get<int32_t>(tensor::kSplits, s), weight_, bias_,
                  scaled_bias_ ? t.get<float>(spec_.bias_scale, s) : nullptr, t.get(spec_.out, s),
                  t.get<int64_t>(tensor::kOffsets, s), mxfp8_, gather ? t.get<int32_t>(spec_.gather, s) : nullptr,
                  gather ? o_.max_tokens : 0};
    a.x_swiglu = swiglu;
    a.x_row_weight = spec_.swiglu_weight.empty() ? nullptr : t.get<float>(spec_.swiglu_weight, s);
    if (p.train) op_->forward_train(a, stream);
    else op_->forward(a, stream);
  }

  void backward(const Phase& p, cudaStream_t stream) override {
    const TensorTable& t = *p.tensors;
    const bool fp32 = o_.main_grad_fp32;
    MG_CHECK(fp32 ? main_grad_ != nullptr : dweight_ != nullptr, spec_.name, ": MoeLayerWeights needs ",
             fp32 ? "main_grad" : "dw", spec_.layer);
    MG_CHECK(!o_.bias || dbias_ != nullptr, spec_.name, ": MoeLayerWeights needs db", spec_.layer);
    // dy: the output gradient, or the SwiGLU's output gradient that the quantizer turns into it.
    const bool swiglu_grad = !spec_.dy_swiglu_of.empty();
    BackwardArgs b{t.get(tensor::grad(swiglu_grad ? spec_.dy_swiglu_of : spec_.out), p.slot),
                   weight_,
                   bias_,
                   t.get(tensor::grad(spec_.in)),
                   dbias_,
                   scaled_bias_ ? t.get<float>(kDBiasScale) : nullptr,
                   fp32 ? nullptr : dweight_,
                   fp32 ? main_grad_ : nullptr,
                   mxfp8_};
    if (swiglu_grad) b.dy_swiglu_gate_up = t.get(spec_.out, p.slot);  // gate | up, saved by forward
    op_->backward(b, p.wgrad, stream);
  }

  void wgrad(cudaStream_t stream) override { op_->backward_dw(stream); }
  void weights_changed(cudaStream_t stream) override {
    if (!g_.prequantized_weights) op_->weights_changed(weight_, stream);  // else the caller's copies are current
  }

 private:
  OpSpec spec_;
  MoeLayerOptions o_;
  GroupedLinearOptions g_;
  const void* weight_ = nullptr;
  const void* bias_ = nullptr;
  void* dbias_ = nullptr;
  void* dweight_ = nullptr;
  float* main_grad_ = nullptr;
  Mxfp8Weights mxfp8_;  // options.prequantized_weights
  bool scaled_bias_ = false;
  std::unique_ptr<GroupedLinear> op_;
};

class SwigluOp final : public LayerOp {
 public:
  SwigluOp(const OpSpec& spec, const MoeLayerOptions& o)
      : spec_(spec),
        o_(o),
        rows_(moe_expert_rows(o)),
        groups_(moe_local_experts(o)),
        weighted_(spec.kind == OpKind::kSwigluWeighted) {}
  std::string name() const override { return spec_.name; }
  std::string kernels() const override { return describe_swiglu(spec_, o_.training); }

  void declare(TensorTable& t, bool training) override {
    const std::size_t es = dtype_size(o_.dtype);
    if (!spec_.forward_in_next)
      t.declare(spec_.out, checked_mul(spec_.out, rows_, o_.ffn, es),
                spec_.save_out ? Lifetime::kSaved : Lifetime::kStep);
    if (!training) return;
    const std::string d_in = tensor::grad(spec_.in);
    if (!spec_.backward_in_prev)  // else FC1's quantizer computes it as it reads, and it is never written
      t.declare(d_in, checked_mul(d_in, rows_, 2, o_.ffn, es), spec_.save_d_in ? Lifetime::kSaved : Lifetime::kStep);
    if (weighted_)
      t.declare(tensor::kDRowWeight, checked_mul(tensor::kDRowWeight, rows_, sizeof(float)), Lifetime::kStep);
  }

  void bind(TensorTable&) override {
    forward_grid_ = kernels::swiglu_grid(o_.dtype, false);
    backward_grid_ = kernels::swiglu_grid(o_.dtype, true);
  }

  void forward(const Phase& p, cudaStream_t stream) override {
    if (spec_.forward_in_next) return;  // FC2's quantizer applies it (OpSpec::swiglu_in)
    const TensorTable& t = *p.tensors;
    const int s = p.slot;
    const int64_t* offsets = t.get<int64_t>(tensor::kOffsets, s);
    if (weighted_)
      kernels::launch_swiglu_weighted_forward(o_.dtype, t.get(spec_.in, s), t.get<float>(tensor::kRowWeight, s),
                                              t.get(spec_.out, s), o_.ffn, offsets, groups_, stream);
    else
      kernels::launch_swiglu_forward(o_.dtype, t.get(spec_.in, s), t.get(spec_.out, s), o_.ffn, offsets, groups_,
                                     forward_grid_, stream);
  }

  void backward(const Phase& p, cudaStream_t stream) override {
    if (spec_.backward_in_prev) return;  // FC1's quantizer (OpSpec::dy_swiglu_of)
    const TensorTable& t = *p.tensors;
    const int s = p.slot;
    const int64_t* offsets = t.get<int64_t>(tensor::kOffsets, s);
    if (weighted_)
      kernels::launch_swiglu_weighted_backward(
          o_.dtype, t.get(spec_.in, s), t.get<float>(tensor::kRowWeight, s), t.get(tensor::grad(spec_.out)),
          t.get(tensor::grad(spec_.in), s), t.has(kDBiasScale) ? t.get<float>(kDBiasScale) : nullptr,
          t.get<float>(tensor::kDRowWeight), o_.ffn, offsets, groups_, stream);
    else
      kernels::launch_swiglu_backward(o_.dtype, t.get(spec_.in, s), t.get(tensor::grad(spec_.out)),
                                      t.get(tensor::grad(spec_.in), s), o_.ffn, offsets, groups_, backward_grid_,
                                      stream);
  }

 private:
  OpSpec spec_;
  MoeLayerOptions o_;
  int64_t rows_;
  int groups_;  // this rank's experts: the groups of the dispatch's layout
  bool weighted_;
  int forward_grid_ = 0, backward_grid_ = 0;
};

}  // namespace

GroupedLinearOptions expert_linear_options(const MoeLayerOptions& o, int layer, int64_t capacity_rows) {
  MG_CHECK(layer == 1 || layer == 2, "an expert linear is FC1 or FC2, got ", layer);
  GroupedLinearOptions g;
  g.num_groups = moe_local_experts(o);
  g.in_features = layer == 1 ? o.hidden : o.ffn;
  g.out_features = layer == 1 ? checked_mul("fc1 out_features (2 * ffn)", 2, o.ffn) : o.hidden;
  g.capacity_rows = capacity_rows;
  g.row_align = o.row_align;
  g.dtype = o.dtype;
  g.bias = o.bias;
  g.wgrad_slots = o.training ? o.wgrad_slots : 1;
  g.delay_wgrad = o.training && o.delay_wgrad;
  g.forward_only = !o.training;  // an inference layer's linears lay out no training contexts
  g.recipe = o.recipe;
  g.prequantized_weights = o.prequantized_weights;
  g.dequantized_weights = o.dequantized_weights;
  return g;
}

void require_prequantized_weights(const MoeLayerOptions& o, const Mxfp8Weights& w1, const Mxfp8Weights& w2,
                                  const char* owner) {
  for (const auto& [name, m] : {std::pair{"w1_mxfp8", &w1}, std::pair{"w2_mxfp8", &w2}}) {
    MG_CHECK(m->data != nullptr && m->scales != nullptr, owner, " needs ", name,
             ".data and .scales (prequantized_weights)");
    MG_CHECK(!o.training || (m->data_t != nullptr && m->scales_t != nullptr), owner, " needs ", name,
             ".data_t and .scales_t for training (dgrad reads them)");
    MG_CHECK(!o.dequantized_weights || m->dequantized != nullptr, owner, " needs ", name,
             ".dequantized (prequantized_weights with dequantized_weights)");
    MG_CHECK(!o.dequantized_weights || !o.training || m->dequantized_t != nullptr, owner, " needs ", name,
             ".dequantized_t for training (dgrad reads it; prequantized_weights with dequantized_weights)");
    // Optional: the swap-AB route copies them whole, which needs 16-byte aligned sources (refused
    // here, at creation, rather than by the first launch that reads them).
    MG_CHECK(kernels::aligned16(m->scales_tiled), owner, " needs ", name, ".scales_tiled 16-byte aligned (or null)");
    MG_CHECK(kernels::aligned16(m->scales_t_tiled), owner, " needs ", name,
             ".scales_t_tiled 16-byte aligned (or null)");
  }
}

std::string expert_recipe_refusal(const MoeLayerOptions& o, int layer, int64_t capacity_rows) {
  const GroupedLinearOptions g = expert_linear_options(o, layer, capacity_rows);
  std::string reason = recipe_can_implement(g);
  if (reason.empty() && o.training) reason = recipe_can_train(g);
  return reason;
}

std::unique_ptr<LayerOp> make_linear_op(const OpSpec& spec, const MoeLayerOptions& o, const MoeLayerWeights& w) {
  return std::make_unique<LinearOp>(spec, o, w);
}
std::unique_ptr<LayerOp> make_swiglu_op(const OpSpec& spec, const MoeLayerOptions& o) {
  return std::make_unique<SwigluOp>(spec, o);
}

}  // namespace moegraph::layer
