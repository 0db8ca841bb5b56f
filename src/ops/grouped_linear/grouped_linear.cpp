// GroupedLinear: the saved-context slots and their FIFO queues, the group offsets and the bias
// gradients; the recipe's backend (linear_backend.hpp) does the GEMMs and keeps its operand copies.
#include "moegraph/grouped_linear.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "kernels/elementwise/elementwise.hpp"
#include "kernels/routing/offsets.hpp"
#include "moegraph/error.hpp"
#include "src/core/checked.hpp"
#include "src/core/device_buffer.hpp"
#include "src/core/device_info.hpp"
#include "src/core/device_scope.hpp"
#include "src/core/layout.hpp"
#include "src/ops/group_layout.hpp"
#include "src/ops/grouped_linear/linear_backend.hpp"

namespace moegraph {

// The recipe-independent part of a forward_train context; the backend keeps the rest per slot.
struct GroupedLinear::Slot {
  int32_t* own_splits = nullptr;   // [G] in the workspace: a copy when the caller gave no offsets
  int64_t* own_offsets = nullptr;  // [G + 1]
  const int32_t* splits = nullptr;   // what backward and wgrad read: the copies or the caller's
  const int64_t* offsets = nullptr;
  float* own_scale = nullptr;      // [capacity_rows] copy of the bias scale (bias, unless the caller keeps it)
  const float* scale = nullptr;    // what backward reads: the copy or the caller's
  bool has_scale = false;
};

struct GroupedLinear::Scratch {
  int64_t* offsets = nullptr;        // inference forward
  float* bias_partials = nullptr;    // bias-gradient workspace
  DeviceBuffer error;                // DeviceErrorRecord: outside the workspace, which callers may share
  DeviceBuffer owned_workspace;      // when the operator allocated its workspace itself
  std::size_t workspace_bytes = 0;
  int sm_count = 0;
  int device = -1;  // set up on; made current for every call (DeviceScope)
};

namespace linear {

kernels::GemmConfig gemm_config(const GroupedLinearOptions& o, kernels::GemmPhase phase, bool into_main_grad) {
  kernels::GemmProblem p;
  p.phase = phase;
  p.into_main_grad = into_main_grad;
  p.recipe = o.recipe;
  p.dtype = o.dtype;
  p.groups = o.num_groups;
  p.capacity_rows = o.capacity_rows;
  p.expected_rows_per_group = o.capacity_rows / o.num_groups;
  p.n = o.out_features;
  p.k = o.in_features;
  p.dequantized_weights = o.dequantized_weights;
  kernels::GemmOverrides forced;
  forced.reference = o.reference_kernels;
  forced.tile_n = o.tile_n;
  forced.pipeline = o.pipeline;
  forced.wgrad_ping_pong = o.wgrad_ping_pong;
  return kernels::choose_gemm_config(p, kernels::with_environment(forced));
}

std::string describe_gemm_configs(const kernels::GemmConfig& fprop, const kernels::GemmConfig& dgrad,
                                  const kernels::GemmConfig& wgrad, const kernels::GemmConfig& wgrad_main_grad) {
  const std::string into_dw = wgrad.to_string(), into_mg = wgrad_main_grad.to_string();
  return "fprop: " + fprop.to_string() + " | dgrad: " + dgrad.to_string() + " | wgrad: " + into_dw +
         (into_mg != into_dw ? " | wgrad into main_grad: " + into_mg : "");
}

const kernels::GemmPlan& WgradPlans::for_call(const float* main_grad) const {
  return main_grad != nullptr ? into_main_grad : into_dweight;
}

WgradPlans prepare_wgrad_plans(const kernels::GemmConfig& into_dweight, const kernels::GemmConfig& into_main_grad,
                                int sm_count) {
  return {kernels::prepare_gemm(into_dweight, sm_count), kernels::prepare_gemm(into_main_grad, sm_count)};
}

std::unique_ptr<LinearBackend> make_linear_backend(const GroupedLinearOptions& o) {
  switch (o.recipe) {
    case Recipe::kBF16: return make_bf16_backend(o);
    case Recipe::kMXFP8: return make_mxfp8_backend(o);
  }
  MG_FAIL("unknown recipe ", static_cast<int>(o.recipe));
}

}  // namespace linear

std::string recipe_can_implement(const GroupedLinearOptions& o) {
  switch (o.recipe) {
    case Recipe::kBF16: return linear::bf16_can_implement(o);
    case Recipe::kMXFP8: return linear::mxfp8_can_implement(o);
  }
  return detail::concat("unknown recipe ", static_cast<int>(o.recipe));
}

std::string recipe_can_train(const GroupedLinearOptions& o) {
  if (o.forward_only) return "the operator was built forward_only (it keeps no forward_train contexts)";
  switch (o.recipe) {
    case Recipe::kBF16: return {};  // trains wherever it runs
    case Recipe::kMXFP8: return linear::mxfp8_can_train(o);
  }
  return detail::concat("unknown recipe ", static_cast<int>(o.recipe));
}

void validate(const GroupedLinearOptions& o) {
  MG_CHECK(o.num_groups >= 1 && o.num_groups <= kMaxGroups, "num_groups must be in [1, ", kMaxGroups, "], got ",
           o.num_groups);
  MG_CHECK(o.in_features >= 16 && o.in_features % 16 == 0,
           "in_features (K) must be a positive multiple of 16, got ", o.in_features);
  MG_CHECK(o.out_features >= 16 && o.out_features % 16 == 0,
           "out_features (N) must be a positive multiple of 16, got ", o.out_features);
  MG_CHECK(o.in_features <= kMaxFeatures, "in_features (K) must be at most ", kMaxFeatures, ", got ", o.in_features);
  MG_CHECK(o.out_features <= kMaxFeatures, "out_features (N) must be at most ", kMaxFeatures, ", got ",
           o.out_features);
  MG_CHECK(o.capacity_rows >= 1, "capacity_rows must be at least 1, got ", o.capacity_rows);
  MG_CHECK(o.capacity_rows <= kMaxCapacityRows, "capacity_rows must be below 2^31, got ", o.capacity_rows);
  MG_CHECK(o.row_align == 1 || o.row_align == 16 || o.row_align == 32 || o.row_align == 128,
           "row_align must be 1, 16, 32 or 128, got ", o.row_align);
  MG_CHECK(o.capacity_rows % o.row_align == 0, "capacity_rows must be a multiple of row_align (", o.row_align,
           "), got ", o.capacity_rows);
  MG_CHECK(o.dtype == DType::kBF16 || o.dtype == DType::kFP16, "dtype must be bf16 or fp16, got ",
           dtype_name(o.dtype));
  // Each field is bounded above, so these products are exact; what they may not pass is one layout.
  const std::size_t es = dtype_size(o.dtype), max_bytes = LayoutWalker::kMaxBytes;
  const int64_t widest = std::max(o.in_features, o.out_features);
  const std::size_t row_buffer = checked_mul("row buffer bytes", o.capacity_rows, widest, es);
  MG_CHECK(row_buffer <= max_bytes, "capacity_rows * max(in_features, out_features) * ", es,
           " bytes (the largest row buffer) must be at most ", max_bytes, ", got ", o.capacity_rows, " * ", widest,
           " * ", es, " = ", row_buffer);
  const std::size_t main_grad = checked_mul("main_grad bytes", o.num_groups, o.out_features, o.in_features, 4);
  MG_CHECK(main_grad <= max_bytes, "num_groups * out_features * in_features * 4 bytes (an fp32 main_grad) must be ",
           "at most ", max_bytes, ", got ", o.num_groups, " * ", o.out_features, " * ", o.in_features, " * 4 = ",
           main_grad);
  MG_CHECK(o.wgrad_slots >= 1 && o.wgrad_slots <= 64, "wgrad_slots must be in [1, 64], got ", o.wgrad_slots);
  MG_CHECK(o.tile_n == 0 || o.tile_n == 128 || o.tile_n == 256, "tile_n must be 0 (automatic), 128 or 256, got ",
           o.tile_n);
  MG_CHECK(o.pipeline == GemmPipeline::kAuto || o.pipeline == GemmPipeline::kCpAsync ||
               o.pipeline == GemmPipeline::kTma,
           "pipeline: unknown value ", static_cast<int>(o.pipeline), " (auto, cp_async or tma)");
  MG_CHECK(o.wgrad_ping_pong >= -1 && o.wgrad_ping_pong <= 1,
           "wgrad_ping_pong must be -1 (automatic), 0 or 1, got ", o.wgrad_ping_pong);
  MG_CHECK(!o.prequantized_weights || o.recipe == Recipe::kMXFP8,
           "prequantized_weights needs the mxfp8 recipe (the weights it reads are MXFP8), got recipe ",
           recipe_name(o.recipe));
  MG_CHECK(!o.dequantized_weights || (o.recipe == Recipe::kMXFP8 && o.dtype == DType::kBF16),
           "dequantized_weights needs the mxfp8 recipe with bf16 activations (the kept values are bf16 and the "
           "bf16 kernels read them), got recipe ", recipe_name(o.recipe), " and dtype ", dtype_name(o.dtype));
  MG_CHECK(!o.caller_keeps_activations || o.recipe == Recipe::kBF16,
           "caller_keeps_activations needs the bf16 recipe (the mxfp8 recipe saves quantized copies), got recipe ",
           recipe_name(o.recipe));
  MG_CHECK(!o.forward_only || (!o.delay_wgrad && !o.caller_keeps_activations),
           "forward_only cannot be combined with delay_wgrad or caller_keeps_activations (both are for training)");
  const std::string recipe = recipe_can_implement(o);
  MG_CHECK(recipe.empty(), recipe);
}

void GroupedLinear::lay_out(const GroupedLinearOptions& o, LayoutWalker& walk, linear::LinearBackend& backend,
                            std::vector<Slot>& slots, Scratch& scratch) {
  const int64_t g = o.num_groups;
  scratch.offsets = walk.take<int64_t>("offsets", g + 1, sizeof(int64_t));
  if (o.bias && !o.forward_only)
    scratch.bias_partials = walk.take<float>(
        "bias_grad_partials", kernels::bias_grad_workspace_floats(o.capacity_rows, g, o.out_features), sizeof(float));
  backend.lay_out_scratch(walk);
  const int slot_count = o.forward_only ? 0 : o.wgrad_slots;  // forward() saves nothing
  slots.assign(slot_count, Slot{});
  for (int s = 0; s < slot_count; ++s) {
    const std::string prefix = detail::concat("slot", s, ".");
    backend.lay_out_slot(walk, s, prefix);
    slots[s].own_splits = walk.take<int32_t>(prefix + "splits", g, sizeof(int32_t));
    slots[s].own_offsets = walk.take<int64_t>(prefix + "offsets", g + 1, sizeof(int64_t));
    if (o.bias && !o.caller_keeps_activations)
      slots[s].own_scale = walk.take<float>(prefix + "bias_scale", o.capacity_rows, sizeof(float));
  }
}

LayoutWalker GroupedLinear::sizing_walk(const GroupedLinearOptions& options) {
  validate(options);
  LayoutWalker walk;
  std::vector<Slot> slots;
  Scratch scratch;
  lay_out(options, walk, *linear::make_linear_backend(options), slots, scratch);
  return walk;
}

std::size_t GroupedLinear::workspace_bytes(const GroupedLinearOptions& options) {
  return sizing_walk(options).bytes();
}

std::vector<GroupedLinear::WorkspaceBuffer> GroupedLinear::workspace_buffers(const GroupedLinearOptions& options) {
  const LayoutWalker walk = sizing_walk(options);  // named: a range-for would not keep the temporary alive
  std::vector<WorkspaceBuffer> out;
  for (const auto& e : walk.entries()) out.push_back({e.name, e.offset, e.bytes});
  return out;
}

std::string GroupedLinear::describe_kernels(const GroupedLinearOptions& options) {
  validate(options);
  using kernels::GemmPhase;
  return linear::describe_gemm_configs(
      linear::gemm_config(options, GemmPhase::kFprop), linear::gemm_config(options, GemmPhase::kDgrad),
      linear::gemm_config(options, GemmPhase::kWgrad), linear::gemm_config(options, GemmPhase::kWgrad, true));
}

GroupedLinear::GroupedLinear(const GroupedLinearOptions& options) : GroupedLinear(options, nullptr) {}

GroupedLinear::GroupedLinear(const GroupedLinearOptions& options, void* workspace) : options_(options) {
  validate(options_);
  scratch_ = std::make_unique<Scratch>();
  // Sized before the device is looked at: a workspace too large to lay out fails the same without a GPU.
  scratch_->workspace_bytes = workspace_bytes(options_);
  const DeviceInfo device = require_supported_device();
  scratch_->sm_count = device.sm_count;
  scratch_->device = device.device;
  if (workspace == nullptr) {
    scratch_->owned_workspace = DeviceBuffer(scratch_->workspace_bytes);
    workspace = scratch_->owned_workspace.get();
  }
  MG_CHECK(reinterpret_cast<std::uintptr_t>(workspace) % LayoutWalker::kAlignment == 0,
           "GroupedLinear workspace must be ", LayoutWalker::kAlignment, "-byte aligned");
  backend_ = linear::make_linear_backend(options_);
  LayoutWalker walk(static_cast<std::byte*>(workspace));
  lay_out(options_, walk, *backend_, slots_, *scratch_);
  backend_->prepare(scratch_->sm_count);
  for (int s = static_cast<int>(slots_.size()) - 1; s >= 0; --s) free_slots_.push_back(s);  // slot 0 first
  scratch_->error = DeviceBuffer(sizeof(DeviceErrorRecord));
  zero_now(scratch_->error.get(), sizeof(DeviceErrorRecord));
  if (const char* env = std::getenv("MOEGRAPH_PRINT_CONFIG"); env != nullptr && env[0] == '1')
    std::fprintf(stderr, "moegraph: %s\n", describe().c_str());
}

GroupedLinear::~GroupedLinear() = default;

std::string GroupedLinear::describe() const {
  const auto& o = options_;
  return detail::concat("GroupedLinear G=", o.num_groups, " K=", o.in_features, " N=", o.out_features,
                        " dtype=", dtype_name(o.dtype), " recipe=", recipe_name(o.recipe),
                        " capacity_rows=", o.capacity_rows, " row_align=", o.row_align,
                        o.forward_only ? std::string(" forward-only") : detail::concat(" slots=", o.wgrad_slots),
                        " | ", backend_->describe(), " | persistent over ", scratch_->sm_count, " SMs");
}

std::size_t GroupedLinear::device_bytes() const {
  return scratch_->workspace_bytes + scratch_->error.bytes() + backend_->weight_copy_bytes();
}

namespace {
void check_forward_args(const GroupedLinearOptions& o, const ForwardArgs& a) {
  MG_CHECK(a.x != nullptr && a.splits != nullptr && a.y != nullptr, "forward needs x, splits and y");
  if (o.prequantized_weights)
    MG_CHECK(a.mxfp8_weights.data != nullptr && a.mxfp8_weights.scales != nullptr,
             "forward needs mxfp8_weights.data and .scales (prequantized_weights)");
  if (o.prequantized_weights && o.dequantized_weights)
    MG_CHECK(a.mxfp8_weights.dequantized != nullptr,
             "forward needs mxfp8_weights.dequantized (prequantized_weights with dequantized_weights)");
  if (!o.prequantized_weights)
    MG_CHECK(a.weight != nullptr, "forward needs the weight");
  MG_CHECK(a.bias == nullptr || o.bias, "a bias was given but the layer was built without bias");
  MG_CHECK(a.bias_scale == nullptr || a.bias != nullptr, "bias_scale needs a bias");
  MG_CHECK(a.x_rows == nullptr || o.recipe == Recipe::kMXFP8,
           "ForwardArgs::x_rows (input rows gathered from x) needs the mxfp8 recipe, whose quantizer reads the "
           "rows; the ", recipe_name(o.recipe), " recipe's GEMMs read x as grouped rows");
  MG_CHECK(a.x_rows == nullptr || (a.x_rows_bound >= 1 && a.x_rows_bound < (int64_t{1} << 31)),
           "ForwardArgs::x_rows needs x_rows_bound, the rows of x, in [1, 2^31), got ", a.x_rows_bound);
  MG_CHECK(!a.x_swiglu || o.recipe == Recipe::kMXFP8,
           "ForwardArgs::x_swiglu (SwiGLU applied to x as it is read) needs the mxfp8 recipe, whose quantizer reads "
           "x; the ", recipe_name(o.recipe), " recipe's GEMMs read x as it is");
  MG_CHECK(!a.x_swiglu || a.x_rows == nullptr, "ForwardArgs::x_swiglu and x_rows cannot be combined");
  MG_CHECK(a.x_row_weight == nullptr || a.x_swiglu,
           "ForwardArgs::x_row_weight scales the SwiGLU of x: it needs x_swiglu");
}
}  // namespace

const int64_t* GroupedLinear::group_offsets(const ForwardArgs& args, int64_t* computed, cudaStream_t stream) {
  if (args.offsets != nullptr) return args.offsets;
  kernels::launch_group_offsets(args.splits, options_.num_groups, options_.row_align, options_.capacity_rows,
                                computed, scratch_->error.as<DeviceErrorRecord>(), stream);
  return computed;
}

void GroupedLinear::forward(const ForwardArgs& args, cudaStream_t stream) {
  const DeviceScope on_device(scratch_->device);
  check_forward_args(options_, args);
  backend_->require_weights_ready();
  const linear::Groups groups{args.splits, group_offsets(args, scratch_->offsets, stream),
                              scratch_->error.as<DeviceErrorRecord>()};
  backend_->fprop(args, groups, -1, stream);
}

void GroupedLinear::require_weights_ready() const { backend_->require_weights_ready(); }

void GroupedLinear::weights_changed(const void* weight, cudaStream_t stream) {
  const DeviceScope on_device(scratch_->device);
  backend_->weights_changed(weight, stream);
}

void GroupedLinear::forward_train(const ForwardArgs& args, cudaStream_t stream) {
  const DeviceScope on_device(scratch_->device);
  check_forward_args(options_, args);
  const std::string cannot_train = recipe_can_train(options_);
  MG_CHECK(cannot_train.empty(), "forward_train: ", cannot_train);
  MG_CHECK(!free_slots_.empty(), "all ", options_.wgrad_slots,
           " wgrad_slots hold forward contexts: run backward / backward_dw before the next forward_train");
  backend_->require_weights_ready();
  const int index = free_slots_.back();
  Slot& slot = slots_[index];
  if (args.offsets != nullptr) {
    slot.splits = args.splits, slot.offsets = args.offsets;  // the caller keeps them (ForwardArgs::offsets)
  } else {
    const int g = options_.num_groups;
    MG_CUDA_CHECK(cudaMemcpyAsync(slot.own_splits, args.splits, g * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream));
    kernels::launch_group_offsets(slot.own_splits, g, options_.row_align, options_.capacity_rows, slot.own_offsets,
                                  scratch_->error.as<DeviceErrorRecord>(), stream);
    slot.splits = slot.own_splits, slot.offsets = slot.own_offsets;
  }
  slot.has_scale = args.bias_scale != nullptr;
  slot.scale = options_.caller_keeps_activations ? args.bias_scale : slot.own_scale;
  if (slot.has_scale && !options_.caller_keeps_activations)
    kernels::launch_copy_used_rows(slot.own_scale, args.bias_scale, sizeof(float), slot.offsets, options_.num_groups,
                                   scratch_->sm_count * 4, stream);
  backend_->fprop(args, {slot.splits, slot.offsets, scratch_->error.as<DeviceErrorRecord>()}, index, stream);
  free_slots_.pop_back();
  backward_queue_.push_back(index);
}

void GroupedLinear::backward(const BackwardArgs& args, WgradMode mode, cudaStream_t stream) {
  const DeviceScope on_device(scratch_->device);
  MG_CHECK(!backward_queue_.empty(), "backward without a pending forward_train");
  MG_CHECK(args.dy != nullptr, "backward needs dy");
  if (options_.prequantized_weights)
    MG_CHECK(args.dx == nullptr || (args.mxfp8_weights.data_t != nullptr && args.mxfp8_weights.scales_t != nullptr),
             "dx needs mxfp8_weights.data_t and .scales_t (prequantized_weights)");
  if (options_.prequantized_weights && options_.dequantized_weights)
    MG_CHECK(args.dx == nullptr || args.mxfp8_weights.dequantized_t != nullptr,
             "dx needs mxfp8_weights.dequantized_t (prequantized_weights with dequantized_weights)");
  if (!options_.prequantized_weights)
    MG_CHECK(args.dx == nullptr || args.weight != nullptr, "dx needs the weight");
  MG_CHECK((args.dweight == nullptr) != (args.main_grad == nullptr),
           "backward needs exactly one of dweight (written) and main_grad (accumulated)");
  MG_CHECK((args.dbias == nullptr && args.dbias_scale == nullptr) || options_.bias,
           "bias gradients were asked for but the layer has no bias");
  MG_CHECK(args.dbias_scale == nullptr || args.bias != nullptr, "dbias_scale needs the bias");
  MG_CHECK(mode == WgradMode::kImmediate || options_.delay_wgrad,
           "a delayed wgrad needs options.delay_wgrad (room to save dy)");
  if (args.dy_swiglu_gate_up != nullptr) {
    MG_CHECK(options_.recipe == Recipe::kMXFP8,
             "BackwardArgs::dy_swiglu_gate_up (dy made from the SwiGLU's gradient as it is read) needs the mxfp8 "
             "recipe, whose quantizer reads dy; the ", recipe_name(options_.recipe), " recipe's GEMMs read dy as it is");
    MG_CHECK(options_.out_features % 256 == 0,
             "BackwardArgs::dy_swiglu_gate_up needs out_features (N = 2 * ffn) to be a multiple of 256, got ",
             options_.out_features);
    MG_CHECK(args.dbias == nullptr && args.dbias_scale == nullptr,
             "BackwardArgs::dy_swiglu_gate_up cannot give bias gradients: they read dy itself, which is never made");
  }
  if (args.dx != nullptr) backend_->require_weights_ready();
  const int index = backward_queue_.front();
  const Slot& slot = slots_[index];
  MG_CHECK(args.dbias_scale == nullptr || slot.has_scale, "dbias_scale asked for, but forward had no bias_scale");
  const linear::Groups groups{slot.splits, slot.offsets, scratch_->error.as<DeviceErrorRecord>()};
  backend_->backward(args, groups, index, mode, stream);
  if (args.dbias != nullptr || args.dbias_scale != nullptr) {
    kernels::BiasGradParams p;
    p.dy = args.dy;
    p.bias_scale = slot.has_scale ? slot.scale : nullptr;
    p.bias = args.bias;
    p.n = options_.out_features;
    p.splits = groups.splits;
    p.offsets = groups.offsets;
    p.num_groups = options_.num_groups;
    p.dbias = args.dbias;
    p.dbias_scale = args.dbias_scale;
    p.partials = scratch_->bias_partials;
    kernels::launch_bias_grad(options_.dtype, p, scratch_->sm_count * 4, stream);
  }
  backward_queue_.pop_front();
  if (mode == WgradMode::kImmediate) free_slots_.push_back(index);
  else wgrad_queue_.push_back({index, args.dweight, args.main_grad});
}

void GroupedLinear::backward_dw(cudaStream_t stream) {
  const DeviceScope on_device(scratch_->device);
  MG_CHECK(!wgrad_queue_.empty(), "backward_dw without a queued wgrad");
  const QueuedWgrad q = wgrad_queue_.front();
  const Slot& slot = slots_[q.slot];
  backend_->delayed_wgrad(q.slot, {slot.splits, slot.offsets}, q.dweight, q.main_grad, stream);
  wgrad_queue_.pop_front();
  free_slots_.push_back(q.slot);
}

DeviceErrorRecord GroupedLinear::take_device_error() {
  const DeviceScope on_device(scratch_->device);
  return take_device_error_record(scratch_->error);
}

void GroupedLinear::check_device_errors(cudaStream_t stream) {
  const DeviceScope on_device(scratch_->device);
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));
  const DeviceErrorRecord record = take_device_error();
  if (record.code == kDeviceErrorNone) return;
  const char* what = record.code == kDeviceErrorSourceRow ? "invalid device inputs: " : "invalid device splits: ";
  detail::throw_error(__FILE__, __LINE__, detail::concat(what, describe_device_error(record, options_.row_align)),
                      ErrorKind::kDeviceSplits);
}

}  // namespace moegraph
