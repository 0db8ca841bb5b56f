// The bf16 recipe (bf16 or fp16 activations): the GEMMs read the 16-bit operands directly; a
// slot keeps a copy of x (and of dy when wgrad is delayed), or with caller_keeps_activations
// pointers to the caller's.
#include <vector>

#include "kernels/elementwise/elementwise.hpp"
#include "src/ops/grouped_linear/linear_backend.hpp"

namespace moegraph::linear {
namespace {

class Bf16Backend final : public LinearBackend {
 public:
  explicit Bf16Backend(const GroupedLinearOptions& o) : o_(o), es_(dtype_size(o.dtype)) {}

  void lay_out_scratch(LayoutWalker&) override {}
  void lay_out_slot(LayoutWalker& walk, int slot, const std::string& prefix) override {
    if (static_cast<int>(slots_.size()) <= slot) slots_.resize(slot + 1);
    if (o_.caller_keeps_activations) return;  // pointers, set per micro-batch
    slots_[slot].own_x = walk.take(prefix + "x", o_.capacity_rows, o_.in_features, es_);
    if (o_.delay_wgrad) slots_[slot].own_dy = walk.take(prefix + "dy", o_.capacity_rows, o_.out_features, es_);
  }

  void prepare(int sm_count) override {
    fprop_ = kernels::prepare_gemm(gemm_config(o_, kernels::GemmPhase::kFprop), sm_count);
    dgrad_ = kernels::prepare_gemm(gemm_config(o_, kernels::GemmPhase::kDgrad), sm_count);
    wgrad_ = prepare_wgrad_plans(gemm_config(o_, kernels::GemmPhase::kWgrad),
                                 gemm_config(o_, kernels::GemmPhase::kWgrad, true), sm_count);
    copy_grid_ = sm_count * 4;
  }
  std::string describe() const override {
    return describe_gemm_configs(fprop_.config, dgrad_.config, wgrad_.into_dweight.config,
                                 wgrad_.into_main_grad.config);
  }

  void weights_changed(const void*, cudaStream_t) override {}

  void fprop(const ForwardArgs& a, Groups g, int save_slot, cudaStream_t stream) override {
    if (save_slot >= 0) save(slots_[save_slot].own_x, slots_[save_slot].x, a.x, o_.in_features, g, stream);
    kernels::RaggedGemmParams p;
    p.a = a.x, p.w = a.weight, p.n = o_.out_features, p.k = o_.in_features;
    p.splits = g.splits, p.offsets = g.offsets, p.num_groups = o_.num_groups;
    p.bias = a.bias, p.bias_scale = a.bias_scale, p.c = a.y, p.capacity_rows = o_.capacity_rows;
    kernels::launch_ragged_gemm(fprop_, p, stream);
  }

  void backward(const BackwardArgs& a, Groups g, int slot, WgradMode mode, cudaStream_t stream) override {
    if (a.dx != nullptr) {
      kernels::RaggedGemmParams p;
      p.a = a.dy, p.w = a.weight, p.n = o_.out_features, p.k = o_.in_features;
      p.splits = g.splits, p.offsets = g.offsets, p.num_groups = o_.num_groups;
      p.c = a.dx, p.capacity_rows = o_.capacity_rows;
      kernels::launch_ragged_gemm(dgrad_, p, stream);
    }
    switch (mode) {
      case WgradMode::kImmediate: return wgrad(a.dy, slots_[slot].x, g, a.dweight, a.main_grad, stream);
      case WgradMode::kDelayed: return save(slots_[slot].own_dy, slots_[slot].dy, a.dy, o_.out_features, g, stream);
    }
  }

  void delayed_wgrad(int slot, Groups g, void* dweight, float* main_grad, cudaStream_t stream) override {
    wgrad(slots_[slot].dy, slots_[slot].x, g, dweight, main_grad, stream);
  }

 private:
  void wgrad(const void* dy, const void* x, Groups g, void* dweight, float* main_grad, cudaStream_t stream) {
    kernels::WgradParams p;
    p.dy = dy, p.x = x, p.n = o_.out_features, p.k = o_.in_features;
    p.splits = g.splits, p.offsets = g.offsets, p.num_groups = o_.num_groups;
    p.dweight = dweight, p.main_grad = main_grad, p.capacity_rows = o_.capacity_rows;
    kernels::launch_grouped_wgrad(wgrad_.for_call(main_grad), p, stream);
  }

  // What wgrad will read of `src` (`width` elements a row): a copy of its used rows in `own`, or
  // the caller's buffer itself (caller_keeps_activations).
  void save(void* own, const void*& saved, const void* src, int64_t width, Groups g, cudaStream_t stream) {
    if (o_.caller_keeps_activations) {
      saved = src;
      return;
    }
    kernels::launch_copy_used_rows(own, src, width * es_, g.offsets, o_.num_groups, copy_grid_, stream);
    saved = own;
  }

  struct Slot {
    void* own_x = nullptr;   // [capacity_rows, K] copy of the forward input
    void* own_dy = nullptr;  // [capacity_rows, N], when wgrad may be delayed
    const void* x = nullptr;   // what wgrad reads: the copies, or the caller's buffers
    const void* dy = nullptr;
  };
  GroupedLinearOptions o_;
  std::size_t es_;
  std::vector<Slot> slots_;
  kernels::GemmPlan fprop_, dgrad_;
  WgradPlans wgrad_;
  int copy_grid_ = 0;
};

}  // namespace

std::string bf16_can_implement(const GroupedLinearOptions&) { return {}; }

std::unique_ptr<LinearBackend> make_bf16_backend(const GroupedLinearOptions& options) {
  return std::make_unique<Bf16Backend>(options);
}

}  // namespace moegraph::linear
