// The mxfp8 recipe (docs/mxfp8.md): x (or the rows gathered through ForwardArgs::x_rows, or the
// SwiGLU of x: ForwardArgs::x_swiglu) and dy (or the SwiGLU's input gradient of dy:
// BackwardArgs::dy_swiglu_gate_up) are quantized on the fly into MXFP8 copies (row-wise
// for fprop and dgrad, column-wise for wgrad; where fprop or dgrad takes the staged route, the
// row-wise copy is written as its bf16 values into the staging instead, and where an immediate
// wgrad takes it, dy's column-wise copy is its bf16 values: dy_values_); a slot keeps the
// column-wise copies instead of a 16-bit x; the weights are quantized once per update into copies
// outside the workspace, or arrive already quantized from the caller (prequantized_weights).
#include <algorithm>
#include <vector>

#include "kernels/quantize/mxfp8.hpp"
#include "moegraph/error.hpp"
#include "moegraph/mxfp8_weights.hpp"
#include "src/core/checked.hpp"
#include "src/core/device_buffer.hpp"
#include "src/ops/grouped_linear/linear_backend.hpp"

namespace moegraph::linear {
namespace {

class Mxfp8Backend final : public LinearBackend {
 public:
  // The GEMM configs are chosen once (no GPU): the scratch layout and set-up both follow them.
  explicit Mxfp8Backend(const GroupedLinearOptions& o)
      : o_(o),
        trains_(!o.forward_only && mxfp8_can_train(o).empty()),
        fprop_config_(gemm_config(o, kernels::GemmPhase::kFprop)),
        dgrad_config_(gemm_config(o, kernels::GemmPhase::kDgrad)),
        wgrad_config_(gemm_config(o, kernels::GemmPhase::kWgrad)),
        wgrad_main_grad_config_(gemm_config(o, kernels::GemmPhase::kWgrad, true)),
        dy_values_(trains_ && !o.delay_wgrad && staged(wgrad_config_) && staged(wgrad_main_grad_config_)) {}

  void lay_out_scratch(LayoutWalker& walk) override {
    // The row-wise codes of x (fprop) or dy (dgrad), for the GEMM routes that read codes; a staged
    // route gets A's bf16 values in its staging instead (operand_for).
    int64_t widest = 0;
    if (!staged(fprop_config_)) widest = o_.in_features;
    if (trains_ && !staged(dgrad_config_)) widest = std::max(widest, o_.out_features);
    if (widest > 0)
      operand_ = {walk.take<uint8_t>("mxfp8.operand", o_.capacity_rows, widest),
                  walk.take<uint8_t>("mxfp8.operand.scales", o_.capacity_rows, widest / kernels::kMxBlock)};
    // The swap-AB route reads A's scales as floats too (Mxfp8Rowwise::scale_floats).
    if (widest > 0 && (swap_ab(fprop_config_) || (trains_ && swap_ab(dgrad_config_))))
      operand_.scale_floats =  // stage-major (mxfp8_scale_float_index): 4 floats a row and stage
          walk.take<float>("mxfp8.operand.scale_floats", (widest + kernels::kMxStageCols - 1) / kernels::kMxStageCols,
                           o_.capacity_rows, kernels::kMxStageBlocks, sizeof(float));
    // An operator that cannot train (forward_only, or row_align under 32) keeps no column-wise copies.
    // With delay_wgrad every slot keeps its own column-wise dy; the shared one serves immediate wgrad.
    if (trains_ && !o_.delay_wgrad) dy_t_ = dy_copy(walk);
    // The staged route's bf16 operands: one buffer for every phase (they run one after another). It
    // also carries A's values from the quantizer to the GEMM that reads them next (operand_for).
    staging_bytes_ = staging_bytes();
    staging_ = walk.take("mxfp8.staging", staging_bytes_);
  }
  void lay_out_slot(LayoutWalker& walk, int slot, const std::string& prefix) override {
    if (static_cast<int>(slots_.size()) <= slot) slots_.resize(slot + 1);
    if (!trains_) return;
    slots_[slot].x_t = colwise(walk, prefix + "x_t", o_.in_features);
    if (o_.delay_wgrad) slots_[slot].dy_t = colwise(walk, prefix + "dy_t", o_.out_features);  // codes (dy_values_)
  }

  void prepare(int sm_count) override {
    fprop_ = kernels::prepare_gemm(fprop_config_, sm_count);
    dgrad_ = kernels::prepare_gemm(dgrad_config_, sm_count);
    wgrad_ = prepare_wgrad_plans(wgrad_config_, wgrad_main_grad_config_, sm_count);
    if (o_.prequantized_weights) return;  // the caller's MXFP8 weights arrive with each call
    const std::size_t data = mxfp8_weight_data_bytes(o_.num_groups, o_.out_features, o_.in_features);
    const std::size_t scales = mxfp8_weight_scale_bytes(o_.num_groups, o_.out_features, o_.in_features);
    w_data_ = DeviceBuffer(data), w_scales_ = DeviceBuffer(scales);
    own_.data = w_data_.as<uint8_t>(), own_.scales = w_scales_.as<uint8_t>();
    if (trains_) {  // W_e^T, dgrad's B: only where dgrad may run
      wt_data_ = DeviceBuffer(data), wt_scales_ = DeviceBuffer(scales);
      own_.data_t = wt_data_.as<uint8_t>(), own_.scales_t = wt_scales_.as<uint8_t>();
    }
    // The swap-AB route's tiled scales, for each GEMM that takes it.
    const std::size_t tiled = mxfp8_tiled_scale_bytes(o_.num_groups, o_.out_features, o_.in_features);
    if (swap_ab(fprop_config_)) w_tiled_ = DeviceBuffer(tiled), own_.scales_tiled = w_tiled_.as<uint8_t>();
    if (trains_ && swap_ab(dgrad_config_)) wt_tiled_ = DeviceBuffer(tiled), own_.scales_t_tiled = wt_tiled_.as<uint8_t>();
    if (!o_.dequantized_weights) return;
    // dgrad's copy only where dgrad may run.
    const std::size_t values = mxfp8_dequantized_weight_bytes(o_.num_groups, o_.out_features, o_.in_features);
    w_values_ = DeviceBuffer(values);
    own_.dequantized = w_values_.get();
    if (!trains_) return;
    wt_values_ = DeviceBuffer(values);
    own_.dequantized_t = wt_values_.get();
  }
  std::string describe() const override {
    return describe_gemm_configs(fprop_.config, dgrad_.config, wgrad_config_, wgrad_main_grad_config_) +
           " | quantize: row-wise (codes, or bf16 values for a staged GEMM) + column-wise (codes" +
           (dy_values_ ? "; dy's as bf16 values for the staged wgrad" : "") + ") from one read" +
           (o_.prequantized_weights ? " | weights: the caller's MXFP8" : " | weights: own MXFP8 copies") +
           (o_.dequantized_weights ? ", also kept dequantized to bf16" : "");
  }
  std::size_t weight_copy_bytes() const override {
    return w_data_.bytes() + w_scales_.bytes() + wt_data_.bytes() + wt_scales_.bytes() + w_values_.bytes() +
           wt_values_.bytes() + w_tiled_.bytes() + wt_tiled_.bytes();
  }

  void weights_changed(const void* weight, cudaStream_t stream) override {
    MG_CHECK(!o_.prequantized_weights, "weights_changed: this operator reads the caller's MXFP8 weights "
             "(prequantized_weights); re-quantize them with quantize_mxfp8_weights instead");
    MG_CHECK(weight != nullptr, "weights_changed needs the weight");
    quantize_mxfp8_weights(o_.dtype, weight, o_.num_groups, o_.out_features, o_.in_features, own_, stream);
    weights_quantized_ = true;
  }

  void require_weights_ready() const override {
    MG_CHECK(o_.prequantized_weights || weights_quantized_,
             "the mxfp8 recipe needs weights_changed() before the first forward or dgrad");
  }

  void fprop(const ForwardArgs& a, Groups g, int save_slot, cudaStream_t stream) override {
    const Mxfp8Weights& w = weights(a.mxfp8_weights);
    // The saved activation is the column-wise copy, quantized in the same read as fprop's operand.
    const kernels::Mxfp8Rowwise operand = operand_for(fprop_);
    const kernels::Mxfp8Colwise* saved = save_slot >= 0 ? &slots_[save_slot].x_t : nullptr;
    if (a.x_swiglu)
      kernels::launch_quantize_mxfp8_swiglu(o_.dtype, a.x, a.x_row_weight, o_.capacity_rows, o_.in_features, g.offsets,
                                            g.splits, o_.num_groups, &operand, saved, stream);
    else if (a.x_rows != nullptr)
      kernels::launch_quantize_mxfp8_gathered(o_.dtype, a.x, {a.x_rows, a.x_rows_bound, g.error}, o_.capacity_rows,
                                              o_.in_features, g.offsets, g.splits, o_.num_groups, &operand, saved,
                                              stream);
    else
      kernels::launch_quantize_mxfp8(o_.dtype, a.x, o_.capacity_rows, o_.in_features, g.offsets, g.splits,
                                     o_.num_groups, &operand, saved, stream);
    kernels::Mxfp8RaggedGemmParams p;
    p.a = operand.data, p.a_scales = operand.scales, p.a_scale_floats = operand.scale_floats;
    p.a_staged = operand.values != nullptr;
    p.b = w.data, p.b_scales = w.scales, p.b_dequantized = w.dequantized, p.b_scales_tiled = w.scales_tiled;
    p.n = o_.out_features, p.k = o_.in_features;
    p.splits = g.splits, p.offsets = g.offsets, p.num_groups = o_.num_groups;
    p.bias = a.bias, p.bias_scale = a.bias_scale, p.c = a.y, p.capacity_rows = o_.capacity_rows;
    p.staging = staging_, p.staging_bytes = staging_bytes_;
    kernels::launch_mxfp8_ragged_gemm(fprop_, p, stream);
  }

  void backward(const BackwardArgs& a, Groups g, int slot, WgradMode mode, cudaStream_t stream) override {
    // dy quantized once: row-wise along N for dgrad (codes, or values: operand_for), column-wise
    // for wgrad (kept in the slot when the wgrad is delayed; with delay_wgrad the slot holds it
    // either way).
    kernels::Mxfp8Colwise* dy_t = o_.delay_wgrad ? &slots_[slot].dy_t : &dy_t_;
    const kernels::Mxfp8Rowwise operand = operand_for(dgrad_);
    const kernels::Mxfp8Rowwise* rowwise = a.dx != nullptr ? &operand : nullptr;
    if (a.dy_swiglu_gate_up != nullptr)  // dy = the SwiGLU's input gradient of a.dy (checked by GroupedLinear)
      kernels::launch_quantize_mxfp8_swiglu_grad(o_.dtype, a.dy_swiglu_gate_up, a.dy, o_.capacity_rows,
                                                 o_.out_features, g.offsets, g.splits, o_.num_groups, rowwise, dy_t,
                                                 stream);
    else
      kernels::launch_quantize_mxfp8(o_.dtype, a.dy, o_.capacity_rows, o_.out_features, g.offsets, g.splits,
                                     o_.num_groups, rowwise, dy_t, stream);
    if (a.dx != nullptr) {
      const Mxfp8Weights& w = weights(a.mxfp8_weights);
      kernels::Mxfp8RaggedGemmParams p;
      p.a = operand.data, p.a_scales = operand.scales, p.a_scale_floats = operand.scale_floats;
      p.a_staged = operand.values != nullptr;
      p.b = w.data_t, p.b_scales = w.scales_t, p.b_dequantized = w.dequantized_t, p.b_scales_tiled = w.scales_t_tiled;
      p.n = o_.in_features, p.k = o_.out_features;
      p.splits = g.splits, p.offsets = g.offsets, p.num_groups = o_.num_groups, p.c = a.dx;
      p.capacity_rows = o_.capacity_rows;
      p.staging = staging_, p.staging_bytes = staging_bytes_;
      kernels::launch_mxfp8_ragged_gemm(dgrad_, p, stream);
    }
    switch (mode) {
      case WgradMode::kImmediate: return wgrad(*dy_t, slots_[slot].x_t, g, a.dweight, a.main_grad, stream);
      case WgradMode::kDelayed: return;  // the slot holds dy_t
    }
  }

  void delayed_wgrad(int slot, Groups g, void* dweight, float* main_grad, cudaStream_t stream) override {
    wgrad(slots_[slot].dy_t, slots_[slot].x_t, g, dweight, main_grad, stream);
  }

 private:
  // The weights a GEMM reads: the caller's (prequantized_weights, checked by GroupedLinear) or
  // the operator's own copies, which must have been made.
  const Mxfp8Weights& weights(const Mxfp8Weights& given) const {
    if (o_.prequantized_weights) return given;
    MG_CHECK(weights_quantized_, "the mxfp8 recipe needs weights_changed() before the first forward or dgrad");
    return own_;
  }
  // Where the quantizer puts a GEMM's operand: the staged route reads only A's bf16 values, so they
  // are written straight to the start of the staging (its A) instead of codes read back there.
  // The swap-AB route also reads A's scales as floats; the others are not given them to write.
  kernels::Mxfp8Rowwise operand_for(const kernels::GemmPlan& plan) const {
    if (staged(plan.config)) return {nullptr, nullptr, static_cast<uint16_t*>(staging_)};
    kernels::Mxfp8Rowwise operand = operand_;
    if (!swap_ab(plan.config)) operand.scale_floats = nullptr;
    return operand;
  }
  static bool staged(const kernels::GemmConfig& c) { return c.family == kernels::GemmFamily::kMxfp8Staged; }
  static bool swap_ab(const kernels::GemmConfig& c) { return c.family == kernels::GemmFamily::kMxfp8SwapAb; }
  kernels::Mxfp8Colwise colwise(LayoutWalker& walk, const std::string& name, int64_t cols) {
    return {walk.take<uint8_t>(name, o_.capacity_rows, cols),
            walk.take<uint8_t>(name + ".scales", o_.capacity_rows / kernels::kMxBlock, cols)};
  }
  // What an immediate wgrad reads of dy: its column-wise codes, or (dy_values_) its bf16 values alone.
  kernels::Mxfp8Colwise dy_copy(LayoutWalker& walk) {
    if (!dy_values_) return colwise(walk, "mxfp8.dy_t", o_.out_features);
    return {nullptr, nullptr,
            walk.take<uint16_t>("mxfp8.dy_values", o_.capacity_rows, o_.out_features, sizeof(uint16_t))};
  }
  void wgrad(const kernels::Mxfp8Colwise& dy_t, const kernels::Mxfp8Colwise& x_t, Groups g, void* dweight,
             float* main_grad, cudaStream_t stream) {
    kernels::Mxfp8WgradParams p;
    p.dy_t = dy_t.data, p.dy_t_scales = dy_t.scales, p.dy_values = dy_t.values, p.x_t = x_t.data;
    p.x_t_scales = x_t.scales;
    p.n = o_.out_features, p.k = o_.in_features, p.capacity_rows = o_.capacity_rows;
    p.splits = g.splits, p.offsets = g.offsets, p.num_groups = o_.num_groups;
    p.dweight = dweight, p.main_grad = main_grad;
    p.staging = staging_, p.staging_bytes = staging_bytes_;
    kernels::launch_mxfp8_wgrad(wgrad_.for_call(main_grad), p, stream);
  }
  // The most scratch any phase's route needs (0 unless one is staged); a forward-only operator
  // never runs wgrad.
  std::size_t staging_bytes() const {
    const int g = o_.num_groups;
    const int64_t rows = o_.capacity_rows, n = o_.out_features, k = o_.in_features;
    std::size_t bytes = kernels::mxfp8_staging_bytes(fprop_config_, g, rows, n, k);
    if (!trains_) return bytes;
    bytes = std::max(bytes, kernels::mxfp8_staging_bytes(dgrad_config_, g, rows, k, n));
    if (dy_values_) return std::max(bytes, kernels::mxfp8_staged_wgrad_bytes(rows, n, k, true));
    for (const auto* wgrad : {&wgrad_config_, &wgrad_main_grad_config_})
      bytes = std::max(bytes, kernels::mxfp8_staging_bytes(*wgrad, g, rows, n, k));
    return bytes;
  }

  struct Slot {
    kernels::Mxfp8Colwise x_t;   // [K, capacity_rows], scales [capacity_rows / 32, K]
    kernels::Mxfp8Colwise dy_t;  // [N, capacity_rows], scales [capacity_rows / 32, N] (delayed wgrad: codes)
  };
  GroupedLinearOptions o_;
  bool trains_;  // recipe_can_train's rule: forward_train may run (GroupedLinear refuses it otherwise)
  std::vector<Slot> slots_;
  kernels::Mxfp8Rowwise operand_;  // x [rows, K] or dy [rows, N]: codes, for the routes that read them
  kernels::Mxfp8Colwise dy_t_;     // immediate wgrad's dy copy (dy_copy)
  void* staging_ = nullptr;        // the staged route's bf16 operands (kernels::mxfp8_staging_bytes)
  std::size_t staging_bytes_ = 0;
  // The quantized weights live outside the workspace: they persist across steps until the weights change.
  // Without prequantized_weights only: the layouts of moegraph/mxfp8_weights.hpp.
  DeviceBuffer w_data_, w_scales_, wt_data_, wt_scales_;  // [G, N, K] along K; W_e^T [G, K, N] along N
  DeviceBuffer w_values_, wt_values_;  // dequantized_weights: their bf16 values (wt_: training only)
  DeviceBuffer w_tiled_, wt_tiled_;    // the scales in the swap-AB route's tile order, where it runs
  Mxfp8Weights own_;                   // views of those buffers
  bool weights_quantized_ = false;                        // host: weights_changed() was enqueued
  kernels::GemmConfig fprop_config_, dgrad_config_, wgrad_config_, wgrad_main_grad_config_;
  // Immediate wgrad on the staged route (both plans): dy's column-wise copy is its bf16 values,
  // written by dy's quantizer (kernels::Mxfp8Colwise::values) instead of codes the wgrad would
  // dequantize into its staging: 2 bytes per element instead of 1 + 1/32, while the staging no
  // longer holds dy's values (2), so the workspace shrinks where the wgrad sized the staging (else it
  // grows by 31/32 of a byte per element of dy). A delayed wgrad keeps codes in its slots:
  // values there cost 31/32 of a byte per element in every slot; measured on the Qwen3-like and
  // Mixtral-like presets (two slots), the saved tensors went from 0.52 of bf16's to 0.79-0.83 and
  // the arena grew 4-10% (docs/PERF.md, "MXFP8: dy's quantizer writes the staged wgrad's dy").
  bool dy_values_;
  kernels::GemmPlan fprop_, dgrad_;
  WgradPlans wgrad_;
};

}  // namespace

// The MXFP8 GEMMs stage 128 K elements at a time (fprop reduces K, dgrad N). Row-wise copies (all
// that fprop reads) take any group starts.
std::string mxfp8_can_implement(const GroupedLinearOptions& o) {
  if (o.in_features % 128 != 0 || o.out_features % 128 != 0)
    return detail::concat("the mxfp8 recipe needs in_features (K) and out_features (N) multiples of 128, got K ",
                          o.in_features, " and N ", o.out_features);
  if (o.reference_kernels) return "the mxfp8 recipe has no reference (WMMA) kernels";
  return {};
}

// The column-wise copies that wgrad reads need every group to start on a multiple of 32 rows.
std::string mxfp8_can_train(const GroupedLinearOptions& o) {
  if (o.row_align != 32 && o.row_align != 128)
    return detail::concat("the mxfp8 recipe trains only at row_align 32 or 128 (a column-wise block of 32 rows "
                          "must not straddle two groups), got ", o.row_align, "; at row_align 1 or 16 it serves "
                          "forward only");
  return {};
}

std::unique_ptr<LinearBackend> make_mxfp8_backend(const GroupedLinearOptions& options) {
  return std::make_unique<Mxfp8Backend>(options);
}

}  // namespace moegraph::linear
