// The router (logits by cuBLASLt, or for a small inference batch straight from x in one kernel,
// then scores / top-k / weights on the device) and the auxiliary load-balancing loss. The router's
// backward also finishes dx (dx += d_logits · W_r, on top of the un-permuted expert gradient the
// dispatch wrote) and computes dW_r, at once or queued.
#include <cstdint>
#include <deque>
#include <memory>

#include "kernels/common/alignment.hpp"
#include "kernels/routing/moe_routing.hpp"
#include "moegraph/error.hpp"
#include "src/core/device_buffer.hpp"
#include "src/core/checked.hpp"
#include "src/ops/group_layout.hpp"
#include "src/core/lt_gemm.hpp"
#include "src/ops/moe/op_spec.hpp"

namespace moegraph::layer {
namespace {

// The router's copy of x (declare).
constexpr const char* kX = "router.x";

class RouterOp final : public LayerOp {
 public:
  RouterOp(const MoeLayerOptions& o, const MoeLayerWeights& w) : o_(o), w_(w) {}
  void set_weights(const MoeLayerWeights& w) override { w_ = w; }
  std::string name() const override { return "router"; }
  std::string kernels() const override { return describe_router(o_); }

  void declare(TensorTable& t, bool training) override {
    const std::size_t es = dtype_size(o_.dtype);
    const int64_t tk = o_.max_tokens, e = o_.experts, k = o_.top_k;
    t.declare(tensor::kTokens, sizeof(int32_t), Lifetime::kSaved);
    t.declare("logits", checked_mul("logits", tk, e, sizeof(float)), Lifetime::kStep);
    t.declare(tensor::kScores, checked_mul(tensor::kScores, tk, e, sizeof(float)), Lifetime::kSaved);
    t.declare(tensor::kTopkIds, checked_mul(tensor::kTopkIds, tk, k, sizeof(int32_t)), Lifetime::kSaved);
    t.declare(tensor::kTopkWeights, checked_mul(tensor::kTopkWeights, tk, k, sizeof(float)), Lifetime::kSaved);
    // x's first n rows, zeros past them: the logits GEMM runs over all max_tokens rows, and the
    // caller's x may hold only n (MoeLayerIO). Training keeps it for dW_r, which runs after the
    // caller may have reused its buffer for the next micro-batch.
    t.declare(kX, checked_mul(kX, tk, o_.hidden, es), training ? Lifetime::kSaved : Lifetime::kStep);
    if (!training) return;
    t.declare("d.logits", checked_mul("d.logits", tk, e, es), o_.delay_wgrad ? Lifetime::kSaved : Lifetime::kStep);
  }

  void bind(TensorTable&) override {
    gemm_ = std::make_unique<LtGemm>();
    error_ = DeviceBuffer(sizeof(DeviceErrorRecord));
    zero_now(error_.get(), sizeof(DeviceErrorRecord));
    // Heuristic queries now: they are not capturable.
    gemm_->prepare(logits_gemm(nullptr, nullptr));
    if (!o_.training) return;
    gemm_->prepare(dx_gemm(nullptr, nullptr));
    gemm_->prepare(dw_gemm(nullptr, nullptr));
  }

  void forward(const Phase& p, cudaStream_t stream) override {
    const TensorTable& t = *p.tensors;
    MG_CHECK(p.io->x != nullptr && p.io->num_tokens != nullptr, "MoeLayerIO needs x and num_tokens");
    int32_t* tokens = t.get<int32_t>(tensor::kTokens, p.slot);
    float* logits = t.get<float>("logits");
    // The micro-batch keeps its own token count: the caller may change num_tokens before backward.
    if (router_logits_from_x(o_) && kernels::aligned16(p.io->x) && kernels::aligned16(w_.router) && o_.hidden % 8 == 0) {
      // A small inference batch: one kernel, which also copies the token count (decode latency).
      kernels::RouterLogitsParams l;
      l.x = p.io->x, l.w = w_.router, l.dtype = o_.dtype;
      l.num_tokens = p.io->num_tokens, l.tokens_out = tokens;
      l.max_tokens = o_.max_tokens, l.hidden = o_.hidden, l.experts = o_.experts;
      l.logits = logits, l.error = error_.as<DeviceErrorRecord>();
      kernels::launch_router_logits_small(l, stream);
    } else {
      MG_CUDA_CHECK(cudaMemcpyAsync(tokens, p.io->num_tokens, sizeof(int32_t), cudaMemcpyDeviceToDevice, stream));
      void* x = t.get(kX, p.slot);
      kernels::launch_copy_tokens(p.io->x, x, o_.hidden * dtype_size(o_.dtype), tokens, o_.max_tokens, stream);
      gemm_->run(logits_gemm(x, logits), stream);
    }
    kernels::RouterTopkParams r;
    r.logits = logits;
    r.num_tokens = tokens;
    r.max_tokens = o_.max_tokens;
    r.experts = o_.experts;
    r.top_k = o_.top_k;
    r.score = o_.score;
    r.renormalize = o_.renormalize;
    r.scores = t.get<float>(tensor::kScores, p.slot);
    r.topk_ids = t.get<int32_t>(tensor::kTopkIds, p.slot);
    r.topk_weights = t.get<float>(tensor::kTopkWeights, p.slot);
    r.error = error_.as<DeviceErrorRecord>();
    kernels::launch_router_topk(r, stream);
  }

  void backward(const Phase& p, cudaStream_t stream) override {
    const TensorTable& t = *p.tensors;
    kernels::RouterBackwardParams b;
    b.scores = t.get<float>(tensor::kScores, p.slot);
    b.topk_ids = t.get<int32_t>(tensor::kTopkIds, p.slot);
    b.topk_weights = t.get<float>(tensor::kTopkWeights, p.slot);
    b.d_topk_weights = t.get<float>(tensor::kDTopkWeights);
    b.counts = t.get<int32_t>(tensor::kCounts, p.slot);
    b.num_tokens = t.get<int32_t>(tensor::kTokens, p.slot);
    b.max_tokens = o_.max_tokens;
    b.experts = o_.experts;
    b.top_k = o_.top_k;
    b.score = o_.score;
    b.renormalize = o_.renormalize;
    b.aux_coef = static_cast<float>(o_.aux_loss_coef);
    b.dtype = o_.dtype;
    b.d_logits = t.get("d.logits", p.slot);
    kernels::launch_router_backward(b, stream);
    // The dispatch's backward already wrote the experts' share of dx (and zeros past n).
    gemm_->run(dx_gemm(b.d_logits, p.io->dx), stream);
    if (p.wgrad == WgradMode::kImmediate) run_wgrad(t, p.slot, stream);
    else queue_.push_back({&t, p.slot});
  }

  void wgrad(cudaStream_t stream) override {
    MG_CHECK(!queue_.empty(), "router: no queued weight gradient");
    const auto [t, slot] = queue_.front();
    queue_.pop_front();
    run_wgrad(*t, slot, stream);
  }

  DeviceErrorRecord take_device_error() override { return take_device_error_record(error_); }

 private:
  // logits [T, E] (fp32) = x [T, H] · W_r^T
  RowMajorGemm logits_gemm(const void* x, float* logits) const {
    RowMajorGemm g;
    g.trans_b = true;
    g.m = o_.max_tokens, g.n = o_.experts, g.k = o_.hidden;
    g.a = x, g.lda = o_.hidden;
    g.b = w_.router, g.ldb = o_.hidden;
    g.c = logits, g.ldc = o_.experts;
    g.ab_type = o_.dtype, g.c_type = DType::kFP32;
    return g;
  }
  // dx [T, H] += d_logits [T, E] · W_r [E, H]
  RowMajorGemm dx_gemm(const void* d_logits, void* dx) const {
    RowMajorGemm g;
    g.m = o_.max_tokens, g.n = o_.hidden, g.k = o_.experts;
    g.a = d_logits, g.lda = o_.experts;
    g.b = w_.router, g.ldb = o_.hidden;
    g.c = dx, g.ldc = o_.hidden;
    g.ab_type = g.c_type = o_.dtype;
    g.beta = 1.0f;
    return g;
  }
  // dW_r [E, H] (+)= d_logits^T · x over all max_tokens rows (both are zero past n).
  RowMajorGemm dw_gemm(const void* d_logits, const void* x) const {
    RowMajorGemm g;
    g.trans_a = true;
    g.m = o_.experts, g.n = o_.hidden, g.k = o_.max_tokens;
    g.a = d_logits, g.lda = o_.experts;
    g.b = x, g.ldb = o_.hidden;
    g.ab_type = o_.dtype;
    if (o_.main_grad_fp32) g.c = w_.main_grad_router, g.c_type = DType::kFP32, g.beta = 1.0f;
    else g.c = w_.d_router, g.c_type = o_.dtype;
    g.ldc = o_.hidden;
    return g;
  }
  void run_wgrad(const TensorTable& t, int slot, cudaStream_t stream) {
    const RowMajorGemm g = dw_gemm(t.get("d.logits", slot), t.get(kX, slot));
    MG_CHECK(g.c != nullptr, "router: MoeLayerWeights needs ", o_.main_grad_fp32 ? "main_grad_router" : "d_router");
    gemm_->run(g, stream);
  }

  MoeLayerOptions o_;
  MoeLayerWeights w_;
  std::unique_ptr<LtGemm> gemm_;
  DeviceBuffer error_;
  std::deque<std::pair<const TensorTable*, int>> queue_;
};

class AuxLossOp final : public LayerOp {
 public:
  explicit AuxLossOp(const MoeLayerOptions& o) : o_(o) {}
  std::string name() const override { return "aux_loss"; }
  std::string kernels() const override {
    return "aux loss: per-expert score sums over a fixed grid, partials added in a fixed order (deterministic)";
  }
  void declare(TensorTable&, bool) override {}
  // The kernel's partials and ticket, zeroed here; every launch leaves the ticket zero. The layer's
  // calls are stream-ordered (MoeLayer), so its launches never overlap on it.
  void bind(TensorTable&) override {
    workspace_ = DeviceBuffer(kernels::kRouterAuxLossWorkspaceBytes);
    zero_now(workspace_.get(), workspace_.bytes());
  }
  void forward(const Phase& p, cudaStream_t stream) override {
    // Inference may skip the loss; training needs it, or the gradient would not match the output.
    if (!p.train && p.io->aux_loss == nullptr) return;
    MG_CHECK(p.io->aux_loss != nullptr, "aux_loss_coef is ", o_.aux_loss_coef,
             ": forward_train needs MoeLayerIO::aux_loss");
    const TensorTable& t = *p.tensors;
    kernels::launch_router_aux_loss(t.get<float>(tensor::kScores, p.slot), t.get<int32_t>(tensor::kCounts, p.slot),
                                    t.get<int32_t>(tensor::kTokens, p.slot), o_.max_tokens, o_.experts, o_.top_k,
                                    static_cast<float>(o_.aux_loss_coef), p.io->aux_loss, workspace_.get(), stream);
  }
  // Its gradient is folded into the router's backward (d aux / d scores needs only the counts).
  void backward(const Phase&, cudaStream_t) override {}

 private:
  MoeLayerOptions o_;
  DeviceBuffer workspace_;
};

}  // namespace

std::unique_ptr<LayerOp> make_router_op(const OpSpec&, const MoeLayerOptions& o, const MoeLayerWeights& w) {
  return std::make_unique<RouterOp>(o, w);
}
std::unique_ptr<LayerOp> make_aux_loss_op(const OpSpec&, const MoeLayerOptions& o) {
  return std::make_unique<AuxLossOp>(o);
}

}  // namespace moegraph::layer
