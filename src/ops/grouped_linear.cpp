#include "moegraph/grouped_linear.hpp"

#include <cstdio>
#include <cstdlib>

#include "kernels/elementwise/elementwise.hpp"
#include "kernels/grouped_gemm/grouped_gemm.hpp"
#include "kernels/quantize/mxfp8.hpp"
#include "kernels/routing/offsets.hpp"
#include "moegraph/error.hpp"
#include "src/common/device_buffer.hpp"
#include "src/common/layout.hpp"
#include "src/ops/shape_rules.hpp"

namespace moegraph {

namespace {
kernels::GemmPipeline pipeline(GroupedLinearOptions::Loads loads) {
  return loads == GroupedLinearOptions::Loads::kCpAsync ? kernels::GemmPipeline::kCpAsync : kernels::GemmPipeline::kTma;
}
}  // namespace

// A forward_train context: what backward and the (possibly delayed) wgrad read. The memory lives
// in the operator's workspace.
struct GroupedLinear::Slot {
  void* x = nullptr;           // [capacity_rows, K] copy of the forward input
  int32_t* splits = nullptr;   // [G]
  int64_t* offsets = nullptr;  // [G + 1]
  float* scale = nullptr;      // [capacity_rows] bias scale, when the layer has a bias
  void* dy = nullptr;          // [capacity_rows, N], when wgrad may be delayed
  bool has_scale = false;
  // MXFP8 recipe: the column-wise copies wgrad reads, instead of x and dy above.
  kernels::Mxfp8Colwise x_t;   // [K, capacity_rows], scales [capacity_rows / 32, K]
  kernels::Mxfp8Colwise dy_t;  // [N, capacity_rows], scales [capacity_rows / 32, N] (delayed wgrad)
};

// MXFP8 recipe: the quantized weights (outside the workspace: they live until the weights
// change, across steps) and the per-call row-wise operand.
struct GroupedLinear::Mxfp8State {
  DeviceBuffer w_data, w_scales, wt_data, wt_scales;  // [G, N, K] along K; W_e^T [G, K, N] along N
  kernels::Mxfp8Rowwise operand;                      // x [rows, K] or dy [rows, N] (workspace)
  kernels::Mxfp8Colwise dy_t;                         // immediate wgrad's dy copy (workspace)
  bool weights_quantized = false;                     // host: quantize_weights() was enqueued
};

struct GroupedLinear::Scratch {
  int64_t* offsets = nullptr;        // inference forward
  float* bias_partials = nullptr;    // bias-gradient workspace
  DeviceBuffer error;                // DeviceErrorRecord: outside the workspace, which callers may share
  DeviceBuffer owned_workspace;      // when the operator allocated its workspace itself
  std::size_t workspace_bytes = 0;
  int sm_count = 0;
};

void GroupedLinear::lay_out(const GroupedLinearOptions& o, LayoutWalker& walk, std::vector<std::unique_ptr<Slot>>* slots,
                            Scratch* scratch, Mxfp8State* mx_state) {
  const int64_t rows = o.capacity_rows, g = o.num_groups;
  const std::size_t es = dtype_size(o.dtype);
  int64_t* offsets = walk.take<int64_t>("offsets", (g + 1) * sizeof(int64_t));
  float* partials = o.bias ? walk.take<float>("bias_grad_partials",
                                              kernels::bias_grad_workspace_floats(rows, g, o.out_features) * sizeof(float))
                           : nullptr;
  if (scratch != nullptr) scratch->offsets = offsets, scratch->bias_partials = partials;
  const bool mx = o.recipe == Recipe::kMXFP8;
  const int64_t k = o.in_features, n = o.out_features, blocks = rows / kernels::kMxBlock;
  auto colwise = [&](const std::string& name, int64_t cols) {
    return kernels::Mxfp8Colwise{walk.take<uint8_t>(name, rows * cols), walk.take<uint8_t>(name + ".scales", blocks * cols)};
  };
  if (mx) {
    const int64_t widest = std::max(k, n);
    kernels::Mxfp8Rowwise operand{walk.take<uint8_t>("mxfp8.operand", rows * widest),
                                  walk.take<uint8_t>("mxfp8.operand.scales", rows * widest / kernels::kMxBlock)};
    const kernels::Mxfp8Colwise dy_t = o.delay_wgrad ? kernels::Mxfp8Colwise{} : colwise("mxfp8.dy_t", n);
    if (mx_state != nullptr) mx_state->operand = operand, mx_state->dy_t = dy_t;
  }
  for (int s = 0; s < o.wgrad_slots; ++s) {
    const std::string prefix = detail::concat("slot", s, ".");
    auto slot = std::make_unique<Slot>();
    // The saved activation: a 16-bit copy, or (mxfp8) the column-wise copy wgrad reads.
    if (mx) slot->x_t = colwise(prefix + "x_t", k);
    else slot->x = walk.take(prefix + "x", rows * k * es);
    slot->splits = walk.take<int32_t>(prefix + "splits", g * sizeof(int32_t));
    slot->offsets = walk.take<int64_t>(prefix + "offsets", (g + 1) * sizeof(int64_t));
    if (o.bias) slot->scale = walk.take<float>(prefix + "bias_scale", rows * sizeof(float));
    if (o.delay_wgrad) {
      if (mx) slot->dy_t = colwise(prefix + "dy_t", n);
      else slot->dy = walk.take(prefix + "dy", rows * n * es);
    }
    if (slots != nullptr) slots->push_back(std::move(slot));
  }
}

std::size_t GroupedLinear::workspace_bytes(const GroupedLinearOptions& options) {
  validate(options);
  LayoutWalker walk;
  lay_out(options, walk, nullptr, nullptr, nullptr);
  return walk.bytes();
}

std::vector<GroupedLinear::WorkspaceBuffer> GroupedLinear::workspace_buffers(const GroupedLinearOptions& options) {
  validate(options);
  LayoutWalker walk;
  lay_out(options, walk, nullptr, nullptr, nullptr);
  std::vector<WorkspaceBuffer> out;
  for (const auto& e : walk.entries()) out.push_back({e.name, e.offset, e.bytes});
  return out;
}

GroupedLinear::GroupedLinear(const GroupedLinearOptions& options) : GroupedLinear(options, nullptr) {}

GroupedLinear::GroupedLinear(const GroupedLinearOptions& options, void* workspace) : options_(options) {
  validate(options_);
  scratch_ = std::make_unique<Scratch>();
  scratch_->workspace_bytes = workspace_bytes(options_);
  if (workspace == nullptr) {
    scratch_->owned_workspace = DeviceBuffer(scratch_->workspace_bytes);
    workspace = scratch_->owned_workspace.get();
  }
  MG_CHECK(reinterpret_cast<std::uintptr_t>(workspace) % LayoutWalker::kAlignment == 0,
           "GroupedLinear workspace must be ", LayoutWalker::kAlignment, "-byte aligned");
  if (options_.recipe == Recipe::kMXFP8) {
    mx_ = std::make_unique<Mxfp8State>();
    const std::size_t weight = static_cast<std::size_t>(options_.num_groups) * options_.out_features * options_.in_features;
    mx_->w_data = DeviceBuffer(weight), mx_->w_scales = DeviceBuffer(weight / kernels::kMxBlock);
    mx_->wt_data = DeviceBuffer(weight), mx_->wt_scales = DeviceBuffer(weight / kernels::kMxBlock);
    kernels::prepare_mxfp8_gemm();
  }
  LayoutWalker walk(static_cast<std::byte*>(workspace));
  lay_out(options_, walk, &slots_, scratch_.get(), mx_.get());
  for (int s = options_.wgrad_slots - 1; s >= 0; --s) free_slots_.push_back(s);  // hand out slot 0 first
  int device = 0;
  MG_CUDA_CHECK(cudaGetDevice(&device));
  MG_CUDA_CHECK(cudaDeviceGetAttribute(&scratch_->sm_count, cudaDevAttrMultiProcessorCount, device));
  kernels::prepare_grouped_gemm(options_.dtype);
  const auto& o = options_;
  auto choose = [&](kernels::GemmPhase phase) {
    return o.tile_n != 0 ? o.tile_n
                         : kernels::choose_tile_n(phase, o.num_groups, o.capacity_rows, o.out_features, o.in_features);
  };
  tile_n_fprop_ = choose(kernels::GemmPhase::kFprop);
  tile_n_dgrad_ = choose(kernels::GemmPhase::kDgrad);
  tile_n_wgrad_ = choose(kernels::GemmPhase::kWgrad);
  auto choose_loads = [&](kernels::GemmPhase phase, int tile_n) {
    if (o.loads != Loads::kAuto) return o.loads;
    return kernels::choose_pipeline(phase, tile_n) == kernels::GemmPipeline::kTma ? Loads::kTma : Loads::kCpAsync;
  };
  loads_fprop_ = choose_loads(kernels::GemmPhase::kFprop, tile_n_fprop_);
  loads_dgrad_ = choose_loads(kernels::GemmPhase::kDgrad, tile_n_dgrad_);
  loads_wgrad_ = choose_loads(kernels::GemmPhase::kWgrad, tile_n_wgrad_);
  scratch_->error = DeviceBuffer(sizeof(DeviceErrorRecord));
  MG_CUDA_CHECK(cudaMemset(scratch_->error.get(), 0, sizeof(DeviceErrorRecord)));
  if (const char* env = std::getenv("MOEGRAPH_PRINT_CONFIG"); env != nullptr && env[0] == '1')
    std::fprintf(stderr, "moegraph: %s\n", describe().c_str());
}

GroupedLinear::~GroupedLinear() = default;

std::string GroupedLinear::describe() const {
  const auto& o = options_;
  if (o.recipe == Recipe::kMXFP8)
    return detail::concat("GroupedLinear G=", o.num_groups, " K=", o.in_features, " N=", o.out_features,
                          " dtype=", dtype_name(o.dtype), " recipe=mxfp8 capacity_rows=", o.capacity_rows,
                          " row_align=", o.row_align, " slots=", o.wgrad_slots,
                          " | fprop, dgrad, wgrad: wgmma e4m3 128x128x128, per-32 scale promotion, 4 stages"
                          " | quantize: row-wise + column-wise from one read | persistent over ",
                          scratch_->sm_count, " SMs");
  return detail::concat("GroupedLinear G=", o.num_groups, " K=", o.in_features, " N=", o.out_features,
                        " dtype=", dtype_name(o.dtype), " capacity_rows=", o.capacity_rows,
                        " row_align=", o.row_align, " slots=", o.wgrad_slots,
                        o.reference_kernels
                            ? " | fprop, dgrad, wgrad: " + kernels::foundation_tile_config().to_string()
                            : " | fprop: " + kernels::wgmma_tile_config(tile_n_fprop_, pipeline(loads_fprop_)).to_string() +
                                  " | dgrad: " + kernels::wgmma_tile_config(tile_n_dgrad_, pipeline(loads_dgrad_)).to_string() +
                                  " | wgrad: " + kernels::wgmma_tile_config(tile_n_wgrad_, pipeline(loads_wgrad_)).to_string(),
                        " | persistent over ", scratch_->sm_count, " SMs");
}

std::size_t GroupedLinear::device_bytes() const {
  return scratch_->workspace_bytes + scratch_->error.bytes();
}

void GroupedLinear::run_fprop(const ForwardArgs& args, const int32_t* splits, const int64_t* offsets,
                              const float* bias_scale, cudaStream_t stream) {
  kernels::RaggedGemmParams p;
  p.a = args.x;
  p.w = args.weight;
  p.n = options_.out_features;
  p.k = options_.in_features;
  p.splits = splits;
  p.offsets = offsets;
  p.num_groups = options_.num_groups;
  p.bias = args.bias;
  p.bias_scale = bias_scale;
  p.c = args.y;
  p.capacity_rows = options_.capacity_rows;
  p.reference = options_.reference_kernels;
  p.tile_n = tile_n_fprop_;
  p.pipeline = pipeline(loads_fprop_);
  kernels::launch_ragged_gemm(options_.dtype, kernels::RaggedGemmKind::kFprop, p, scratch_->sm_count, stream);
}

namespace {
void check_forward_args(const GroupedLinearOptions& o, const ForwardArgs& a) {
  MG_CHECK(a.x != nullptr && a.splits != nullptr && a.weight != nullptr && a.y != nullptr,
           "forward needs x, splits, weight and y");
  MG_CHECK(a.bias == nullptr || o.bias, "a bias was given but the layer was built without bias");
  MG_CHECK(a.bias_scale == nullptr || a.bias != nullptr, "bias_scale needs a bias");
}
}  // namespace

void GroupedLinear::forward(const ForwardArgs& args, cudaStream_t stream) {
  check_forward_args(options_, args);
  int64_t* offsets = scratch_->offsets;
  kernels::launch_group_offsets(args.splits, options_.num_groups, options_.row_align, options_.capacity_rows,
                                offsets, scratch_->error.as<DeviceErrorRecord>(), stream);
  if (mx_) run_mxfp8_fprop(args, args.splits, offsets, args.bias_scale, nullptr, stream);
  else run_fprop(args, args.splits, offsets, args.bias_scale, stream);
}

void GroupedLinear::quantize_weights(const void* weight, cudaStream_t stream) {
  MG_CHECK(mx_ != nullptr, "quantize_weights is for the mxfp8 recipe; this layer runs ", recipe_name(options_.recipe));
  MG_CHECK(weight != nullptr, "quantize_weights needs the weight");
  const kernels::Mxfp8Rowwise row{mx_->w_data.as<uint8_t>(), mx_->w_scales.as<uint8_t>()};
  const kernels::Mxfp8Colwise col{mx_->wt_data.as<uint8_t>(), mx_->wt_scales.as<uint8_t>()};
  kernels::launch_quantize_mxfp8_weights(options_.dtype, weight, options_.num_groups, options_.out_features,
                                         options_.in_features, &row, &col, stream);
  mx_->weights_quantized = true;
}

void GroupedLinear::run_mxfp8_fprop(const ForwardArgs& args, const int32_t* splits, const int64_t* offsets,
                                    const float* bias_scale, Slot* save, cudaStream_t stream) {
  MG_CHECK(mx_->weights_quantized, "the mxfp8 recipe needs quantize_weights() before the first forward");
  const auto& o = options_;
  kernels::launch_quantize_mxfp8(o.dtype, args.x, o.capacity_rows, o.in_features, offsets, splits, o.num_groups,
                                 &mx_->operand, save != nullptr ? &save->x_t : nullptr, stream);
  kernels::Mxfp8RaggedGemmParams p;
  p.a = mx_->operand.data, p.a_scales = mx_->operand.scales;
  p.b = mx_->w_data.as<uint8_t>(), p.b_scales = mx_->w_scales.as<uint8_t>();
  p.n = o.out_features, p.k = o.in_features;
  p.splits = splits, p.offsets = offsets, p.num_groups = o.num_groups;
  p.bias = args.bias, p.bias_scale = bias_scale, p.c = args.y;
  kernels::launch_mxfp8_ragged_gemm(o.dtype, p, scratch_->sm_count, stream);
}

void GroupedLinear::run_mxfp8_wgrad(const Slot& slot, const void* dy_t, const void* dy_t_scales, void* dweight,
                                    float* main_grad, cudaStream_t stream) {
  const auto& o = options_;
  kernels::Mxfp8WgradParams p;
  p.dy_t = static_cast<const uint8_t*>(dy_t), p.dy_t_scales = static_cast<const uint8_t*>(dy_t_scales);
  p.x_t = slot.x_t.data, p.x_t_scales = slot.x_t.scales;
  p.n = o.out_features, p.k = o.in_features, p.capacity_rows = o.capacity_rows;
  p.splits = slot.splits, p.offsets = slot.offsets, p.num_groups = o.num_groups;
  p.dweight = dweight, p.main_grad = main_grad;
  kernels::launch_mxfp8_wgrad(o.dtype, p, scratch_->sm_count, stream);
}

void GroupedLinear::forward_train(const ForwardArgs& args, cudaStream_t stream) {
  check_forward_args(options_, args);
  MG_CHECK(!free_slots_.empty(), "all ", options_.wgrad_slots,
           " wgrad_slots hold forward contexts: run backward / backward_dw before the next forward_train");
  const int index = free_slots_.back();
  Slot& slot = *slots_[index];
  const int g = options_.num_groups;
  MG_CUDA_CHECK(cudaMemcpyAsync(slot.splits, args.splits, g * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream));
  int64_t* offsets = slot.offsets;
  kernels::launch_group_offsets(slot.splits, g, options_.row_align, options_.capacity_rows, offsets,
                                scratch_->error.as<DeviceErrorRecord>(), stream);
  const std::size_t es = dtype_size(options_.dtype);
  const int copy_grid = scratch_->sm_count * 4;
  if (!mx_) kernels::launch_copy_used_rows(slot.x, args.x, options_.in_features * es, offsets, g, copy_grid, stream);
  slot.has_scale = args.bias_scale != nullptr;
  if (slot.has_scale)
    kernels::launch_copy_used_rows(slot.scale, args.bias_scale, sizeof(float), offsets, g, copy_grid, stream);
  // MXFP8: the saved activation is the column-wise copy, quantized in the same read as fprop's operand.
  if (mx_) run_mxfp8_fprop(args, slot.splits, offsets, args.bias_scale, &slot, stream);
  else run_fprop(args, slot.splits, offsets, args.bias_scale, stream);
  free_slots_.pop_back();
  backward_queue_.push_back(index);
}

void GroupedLinear::run_wgrad(const void* dy, const void* x, const int32_t* splits, const int64_t* offsets,
                              void* dweight, float* main_grad, cudaStream_t stream) {
  kernels::WgradParams p;
  p.dy = dy;
  p.x = x;
  p.n = options_.out_features;
  p.k = options_.in_features;
  p.splits = splits;
  p.offsets = offsets;
  p.num_groups = options_.num_groups;
  p.dweight = dweight;
  p.main_grad = main_grad;
  p.capacity_rows = options_.capacity_rows;
  p.reference = options_.reference_kernels;
  p.tile_n = tile_n_wgrad_;
  p.pipeline = pipeline(loads_wgrad_);
  kernels::launch_grouped_wgrad(options_.dtype, p, scratch_->sm_count, stream);
}

void GroupedLinear::backward(const BackwardArgs& args, Recipe recipe, WgradMode mode, cudaStream_t stream) {
  MG_CHECK(recipe == options_.recipe, "backward with the ", recipe_name(recipe), " recipe, but the layer was set up for ",
           recipe_name(options_.recipe), " (its forward_train saved ", recipe_name(options_.recipe), " tensors)");
  MG_CHECK(!backward_queue_.empty(), "backward without a pending forward_train");
  MG_CHECK(args.dy != nullptr, "backward needs dy");
  MG_CHECK(args.dx == nullptr || args.weight != nullptr, "dx needs the weight");
  MG_CHECK((args.dweight == nullptr) != (args.main_grad == nullptr),
           "backward needs exactly one of dweight (written) and main_grad (accumulated)");
  MG_CHECK((args.dbias == nullptr && args.dbias_scale == nullptr) || options_.bias,
           "bias gradients were asked for but the layer has no bias");
  MG_CHECK(args.dbias_scale == nullptr || args.bias != nullptr, "dbias_scale needs the bias");
  MG_CHECK(mode == WgradMode::kImmediate || options_.delay_wgrad,
           "a delayed wgrad needs options.delay_wgrad (room to save dy)");
  const int index = backward_queue_.front();
  Slot& slot = *slots_[index];
  MG_CHECK(args.dbias_scale == nullptr || slot.has_scale, "dbias_scale asked for, but forward had no bias_scale");
  const int32_t* splits = slot.splits;
  const int64_t* offsets = slot.offsets;
  const int g = options_.num_groups;

  // MXFP8: dy quantized once, row-wise along N for dgrad and column-wise for wgrad (kept in the
  // slot when the wgrad is delayed).
  kernels::Mxfp8Colwise* dy_t = nullptr;
  if (mx_) {
    MG_CHECK(args.dx == nullptr || mx_->weights_quantized, "the mxfp8 recipe needs quantize_weights() before dgrad");
    // With delay_wgrad the slot holds a copy either way (the shared scratch exists only without it).
    dy_t = options_.delay_wgrad ? &slot.dy_t : &mx_->dy_t;
    kernels::launch_quantize_mxfp8(options_.dtype, args.dy, options_.capacity_rows, options_.out_features, offsets,
                                   splits, g, args.dx != nullptr ? &mx_->operand : nullptr, dy_t, stream);
  }
  if (args.dx != nullptr && mx_) {
    kernels::Mxfp8RaggedGemmParams p;
    p.a = mx_->operand.data, p.a_scales = mx_->operand.scales;
    p.b = mx_->wt_data.as<uint8_t>(), p.b_scales = mx_->wt_scales.as<uint8_t>();
    p.n = options_.in_features, p.k = options_.out_features;
    p.splits = splits, p.offsets = offsets, p.num_groups = g, p.c = args.dx;
    kernels::launch_mxfp8_ragged_gemm(options_.dtype, p, scratch_->sm_count, stream);
  } else if (args.dx != nullptr) {
    kernels::RaggedGemmParams p;
    p.a = args.dy;
    p.w = args.weight;
    p.n = options_.out_features;
    p.k = options_.in_features;
    p.splits = splits;
    p.offsets = offsets;
    p.num_groups = g;
    p.c = args.dx;
    p.capacity_rows = options_.capacity_rows;
    p.reference = options_.reference_kernels;
    p.tile_n = tile_n_dgrad_;
    p.pipeline = pipeline(loads_dgrad_);
    kernels::launch_ragged_gemm(options_.dtype, kernels::RaggedGemmKind::kDgrad, p, scratch_->sm_count, stream);
  }
  if (args.dbias != nullptr || args.dbias_scale != nullptr) {
    kernels::BiasGradParams p;
    p.dy = args.dy;
    p.bias_scale = slot.has_scale ? slot.scale : nullptr;
    p.bias = args.bias;
    p.n = options_.out_features;
    p.splits = splits;
    p.offsets = offsets;
    p.num_groups = g;
    p.dbias = args.dbias;
    p.dbias_scale = args.dbias_scale;
    p.partials = scratch_->bias_partials;
    kernels::launch_bias_grad(options_.dtype, p, scratch_->sm_count * 4, stream);
  }
  backward_queue_.pop_front();
  if (mode == WgradMode::kImmediate) {
    if (mx_) run_mxfp8_wgrad(slot, dy_t->data, dy_t->scales, args.dweight, args.main_grad, stream);
    else run_wgrad(args.dy, slot.x, splits, offsets, args.dweight, args.main_grad, stream);
    free_slots_.push_back(index);
  } else {
    if (!mx_)
      kernels::launch_copy_used_rows(slot.dy, args.dy, options_.out_features * dtype_size(options_.dtype), offsets, g,
                                     scratch_->sm_count * 4, stream);
    wgrad_queue_.push_back({index, args.dweight, args.main_grad});
  }
}

void GroupedLinear::backward_dw(cudaStream_t stream) {
  MG_CHECK(!wgrad_queue_.empty(), "backward_dw without a queued wgrad");
  const QueuedWgrad q = wgrad_queue_.front();
  Slot& slot = *slots_[q.slot];
  if (mx_) run_mxfp8_wgrad(slot, slot.dy_t.data, slot.dy_t.scales, q.dweight, q.main_grad, stream);
  else run_wgrad(slot.dy, slot.x, slot.splits, slot.offsets, q.dweight, q.main_grad, stream);
  wgrad_queue_.pop_front();
  free_slots_.push_back(q.slot);
}

void GroupedLinear::check_device_errors(cudaStream_t stream) {
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));
  DeviceErrorRecord record{};
  MG_CUDA_CHECK(cudaMemcpy(&record, scratch_->error.get(), sizeof(record), cudaMemcpyDeviceToHost));
  if (record.code == 0) return;
  MG_CUDA_CHECK(cudaMemset(scratch_->error.get(), 0, sizeof(record)));
  detail::throw_error(__FILE__, __LINE__,
                      detail::concat("invalid device splits: ", describe_device_error(record, options_.row_align)),
                      ErrorKind::kDeviceSplits);
}

}  // namespace moegraph
