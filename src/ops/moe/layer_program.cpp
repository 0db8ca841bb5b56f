#include "src/ops/moe/layer_program.hpp"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "moegraph/error.hpp"
#include "src/core/device_info.hpp"
#include "src/core/device_scope.hpp"
#include "src/ops/group_layout.hpp"
#include "src/ops/moe/op_events.hpp"
#include "src/ops/moe/op_spec.hpp"

namespace moegraph::layer {
namespace {
int slots_of(const MoeLayerOptions& o) { return o.training ? o.wgrad_slots : 1; }

// The weights every forward reads, checked at creation (which of them are set may not change).
void require_weights(const MoeLayerOptions& o, const MoeLayerWeights& w) {
  MG_CHECK(w.router != nullptr, "MoeLayerWeights needs router");
  if (o.prequantized_weights) {
    require_prequantized_weights(o, w.w1_mxfp8, w.w2_mxfp8, "MoeLayerWeights");
  } else {
    MG_CHECK(w.w1 != nullptr && w.w2 != nullptr, "MoeLayerWeights needs w1 and w2");
  }
  MG_CHECK(!o.bias || (w.b1 != nullptr && w.b2 != nullptr), "MoeLayerWeights needs b1 and b2 (bias)");
}

// What a forward reads and writes through the caller's pointers, checked before its first
// operator enqueues anything: a refused call leaves the layer, its slots and (with expert
// parallelism) its peers as they were.
void require_forward_io(const MoeLayerOptions& o, const MoeLayerIO& io, bool train) {
  MG_CHECK(io.x != nullptr && io.num_tokens != nullptr, "MoeLayerIO needs x and num_tokens");
  MG_CHECK(io.y != nullptr, "MoeLayerIO needs y");
  MG_CHECK(!train || o.aux_loss_coef == 0.0 || io.aux_loss != nullptr, "aux_loss_coef is ", o.aux_loss_coef,
           ": forward_train needs MoeLayerIO::aux_loss");
}

// The same for backward, with the weight-gradient buffers it (or its delayed wgrad) writes.
void require_backward_io(const MoeLayerOptions& o, const MoeLayerWeights& w, const MoeLayerIO& io) {
  MG_CHECK(io.dx != nullptr && io.dy != nullptr, "backward needs MoeLayerIO::dy and dx");
  if (o.main_grad_fp32)
    MG_CHECK(w.main_grad_router != nullptr && w.main_grad1 != nullptr && w.main_grad2 != nullptr,
             "backward needs MoeLayerWeights::main_grad_router, main_grad1 and main_grad2 (main_grad_fp32)");
  else
    MG_CHECK(w.d_router != nullptr && w.dw1 != nullptr && w.dw2 != nullptr,
             "backward needs MoeLayerWeights::d_router, dw1 and dw2 (without main_grad_fp32)");
  MG_CHECK(!o.bias || (w.db1 != nullptr && w.db2 != nullptr), "backward needs MoeLayerWeights::db1 and db2 (bias)");
}
}  // namespace

LayerProgram::LayerProgram(const MoeLayerOptions& options) : options_(options), tensors_(slots_of(options)) {
  build(MoeLayerWeights{}, nullptr, nullptr);
}

LayerProgram::LayerProgram(const MoeLayerOptions& options, const MoeLayerWeights& weights, void* workspace,
                           std::shared_ptr<EpComm> comm)
    : options_(options), tensors_(slots_of(options)), comm_(std::move(comm)) {
  // Options and sizes are refused first (they fail the same with or without a GPU), then the
  // device, before any allocation: a clear error, never a failed first enqueue.
  const LayerProgram sizing(options);
  const std::size_t bytes = sizing.workspace_bytes();
  if (options.expert_parallel > 1) {
    MG_CHECK(comm_ != nullptr, "expert_parallel = ", options.expert_parallel,
             " needs this rank's communicator (EpComm)");
    MG_CHECK(comm_->ranks() == options.expert_parallel, "the communicator has ", comm_->ranks(),
             " ranks but expert_parallel is ", options.expert_parallel);
  }
  require_weights(options, weights);
  // With a communicator, set-up runs on its device (the creating thread may have another current).
  const DeviceScope on_device(comm_ != nullptr ? comm_->device() : -1);
  device_ = require_supported_device().device;
  if (workspace == nullptr) {
    owned_ = DeviceBuffer(bytes);
    workspace = owned_.get();
  }
  MG_CHECK(reinterpret_cast<uintptr_t>(workspace) % LayoutWalker::kAlignment == 0, "MoeLayer workspace must be ",
           LayoutWalker::kAlignment, "-byte aligned");
  std::byte* window = nullptr;
  if (options.expert_parallel > 1) {
    std::shared_ptr<EpWindow> allocated = comm_->allocate_window(sizing.window_bytes());
    window = static_cast<std::byte*>(allocated->local());
    tensors_.set_window(std::move(allocated));  // the table keeps it alive and addresses peers through it
  }
  build(weights, static_cast<std::byte*>(workspace), window);
  weights_ = weights;
  for (auto& op : ops_) op->bind(tensors_);
  for (int s = slots_of(options_) - 1; s >= 0; --s) free_slots_.push_back(s);
}

void LayerProgram::build(const MoeLayerWeights& weights, std::byte* base, std::byte* window) {
  validate(options_);
  specs_ = moe_layer_ops(options_);
  if (options_.fuse_weights) MG_CHECK(fuse_routing_weights(specs_) == 1, "fuse_weights: the fusion pattern is missing");
  for (const OpSpec& spec : specs_) ops_.push_back(make_op(spec, options_, weights, comm_));
  for (auto& op : ops_) op->declare(tensors_, options_.training);
  LayoutWalker walk(base), window_walk(window);
  tensors_.lay_out(walk, options_.expert_parallel > 1 ? &window_walk : nullptr);
  entries_ = walk.entries();
  bytes_ = walk.bytes();
  window_entries_ = window_walk.entries();
  window_bytes_ = window_walk.bytes();
}

std::string LayerProgram::describe() const {
  std::string s = "moe layer: " + layer::describe(specs_);
  for (const auto& op : ops_) s += "\n  " + op->kernels();
  return s;
}

namespace {
OpEventSink* g_sink = nullptr;
void after(const LayerOp& op, const char* phase, cudaStream_t stream) {
  if (g_sink != nullptr) g_sink->after(op.name(), phase, stream);
}
}  // namespace

void set_op_event_sink(OpEventSink* sink) { g_sink = sink; }

void LayerProgram::run_forward(const MoeLayerIO& io, int slot, bool train, cudaStream_t stream) {
  const Phase p{&io, slot, train, WgradMode::kImmediate, &tensors_};
  for (auto& op : ops_) op->forward(p, stream), after(*op, "forward", stream);
  last_slot_ = slot;
}

void LayerProgram::forward(const MoeLayerIO& io, cudaStream_t stream) {
  const DeviceScope on_device(device_);
  if (comm_ != nullptr) comm_->require_not_aborted("MoeLayer forward");
  // Inference borrows slot 0's saved tensors; a micro-batch holding them must finish first.
  MG_CHECK(std::find(free_slots_.begin(), free_slots_.end(), 0) != free_slots_.end(),
           "inference forward shares slot 0 with a training micro-batch in flight (", backward_queue_.size(),
           " awaiting backward, ", wgrad_queue_.size(), " awaiting wgrad): finish them first");
  require_forward_io(options_, io, false);
  require_ops_ready();
  run_forward(io, 0, false, stream);
}

void LayerProgram::forward_train(const MoeLayerIO& io, cudaStream_t stream) {
  const DeviceScope on_device(device_);
  if (comm_ != nullptr) comm_->require_not_aborted("MoeLayer forward_train");
  MG_CHECK(options_.training, "forward_train needs MoeLayerOptions::training");
  MG_CHECK(!free_slots_.empty(), "all ", options_.wgrad_slots,
           " wgrad_slots hold micro-batches in flight: run backward / backward_dw first");
  require_forward_io(options_, io, true);
  require_ops_ready();
  const int slot = free_slots_.back();
  run_forward(io, slot, true, stream);
  free_slots_.pop_back();
  backward_queue_.push_back(slot);
}

void LayerProgram::backward(const MoeLayerIO& io, cudaStream_t stream) {
  const DeviceScope on_device(device_);
  if (comm_ != nullptr) comm_->require_not_aborted("MoeLayer backward");
  MG_CHECK(!backward_queue_.empty(), "backward without a forward_train");
  require_backward_io(options_, weights_, io);
  const int slot = backward_queue_.front();
  const WgradMode mode = options_.delay_wgrad ? WgradMode::kDelayed : WgradMode::kImmediate;
  const Phase p{&io, slot, true, mode, &tensors_};
  for (auto it = ops_.rbegin(); it != ops_.rend(); ++it) (*it)->backward(p, stream), after(**it, "backward", stream);
  backward_queue_.pop_front();
  if (mode == WgradMode::kDelayed) wgrad_queue_.push_back(slot);
  else free_slots_.push_back(slot);
}

void LayerProgram::backward_dw(cudaStream_t stream) {
  const DeviceScope on_device(device_);
  if (comm_ != nullptr) comm_->require_not_aborted("MoeLayer backward_dw");
  MG_CHECK(!wgrad_queue_.empty(), "backward_dw without a queued weight gradient (delay_wgrad backward first)");
  for (auto it = ops_.rbegin(); it != ops_.rend(); ++it) (*it)->wgrad(stream), after(**it, "wgrad", stream);
  free_slots_.push_back(wgrad_queue_.front());
  wgrad_queue_.pop_front();
}

void LayerProgram::weights_changed(cudaStream_t stream) {
  const DeviceScope on_device(device_);
  for (auto& op : ops_) op->weights_changed(stream);
}

// Every operator before the first enqueues: FC1 (mxfp8 without weights_changed) would otherwise
// refuse only after the router and the dispatch (with expert parallelism, its exchange) had run.
void LayerProgram::require_ops_ready() const {
  for (const auto& op : ops_) op->require_ready();
}

namespace {
struct Field {
  const char* name;
  const void* ptr;
};
std::vector<Field> weight_fields(const MoeLayerWeights& w) {
  return {{"router", w.router},
          {"w1", w.w1},
          {"b1", w.b1},
          {"w2", w.w2},
          {"b2", w.b2},
          {"w1_mxfp8.data", w.w1_mxfp8.data},
          {"w1_mxfp8.scales", w.w1_mxfp8.scales},
          {"w1_mxfp8.data_t", w.w1_mxfp8.data_t},
          {"w1_mxfp8.scales_t", w.w1_mxfp8.scales_t},
          {"w2_mxfp8.data", w.w2_mxfp8.data},
          {"w2_mxfp8.scales", w.w2_mxfp8.scales},
          {"w2_mxfp8.data_t", w.w2_mxfp8.data_t},
          {"w2_mxfp8.scales_t", w.w2_mxfp8.scales_t},
          {"w1_mxfp8.dequantized", w.w1_mxfp8.dequantized},
          {"w1_mxfp8.dequantized_t", w.w1_mxfp8.dequantized_t},
          {"w2_mxfp8.dequantized", w.w2_mxfp8.dequantized},
          {"w2_mxfp8.dequantized_t", w.w2_mxfp8.dequantized_t},
          {"w1_mxfp8.scales_tiled", w.w1_mxfp8.scales_tiled},
          {"w1_mxfp8.scales_t_tiled", w.w1_mxfp8.scales_t_tiled},
          {"w2_mxfp8.scales_tiled", w.w2_mxfp8.scales_tiled},
          {"w2_mxfp8.scales_t_tiled", w.w2_mxfp8.scales_t_tiled}};
}
// The buffers a queued (delayed) weight gradient writes.
std::vector<Field> wgrad_fields(const MoeLayerWeights& w) {
  return {{"main_grad_router", w.main_grad_router}, {"main_grad1", w.main_grad1}, {"main_grad2", w.main_grad2},
          {"d_router", w.d_router},           {"dw1", w.dw1},               {"dw2", w.dw2}};
}
}  // namespace

// Host only: the operators keep pointers, and every enqueue passes them to its kernels. Which
// weights are set may not change (the operator program was built for them); gradient buffers may
// (backward checks for the ones it needs), but not under a queued weight gradient, which writes
// where its backward said.
void LayerProgram::set_weights(const MoeLayerWeights& w) {
  const std::vector<Field> now = weight_fields(weights_), next = weight_fields(w);
  for (std::size_t i = 0; i < now.size(); ++i)
    MG_CHECK((now[i].ptr == nullptr) == (next[i].ptr == nullptr), "set_weights: ", now[i].name,
             now[i].ptr == nullptr ? " was null at creation and must stay null"
                                   : " was set at creation and must stay set");
  const std::vector<Field> grads_now = wgrad_fields(weights_), grads_next = wgrad_fields(w);
  for (std::size_t i = 0; i < grads_now.size() && !wgrad_queue_.empty(); ++i)
    MG_CHECK(grads_now[i].ptr == grads_next[i].ptr, "set_weights: ", wgrad_queue_.size(),
             " delayed weight gradients are queued and write into the current ", grads_now[i].name,
             "; run backward_dw first, or keep the gradient buffers where they are");
  for (auto& op : ops_) op->set_weights(w);
  weights_ = w;
}

uint64_t LayerProgram::read_dropped(cudaStream_t stream) {
  const DeviceScope on_device(device_);
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));
  uint64_t total = 0;
  for (auto& op : ops_) total += op->take_dropped();
  return total;
}

void LayerProgram::check_device_errors(cudaStream_t stream) {
  const DeviceScope on_device(device_);
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::string first;  // every record is read and cleared; the first problem is reported
  for (auto& op : ops_) {
    const DeviceErrorRecord record = op->take_device_error();
    if (first.empty() && record.code != kDeviceErrorNone)
      first = op->name() + ": " + describe_device_error(record, options_.row_align);
  }
  if (!first.empty())
    detail::throw_error(__FILE__, __LINE__, "invalid device input: " + first, ErrorKind::kDeviceSplits);
}

}  // namespace moegraph::layer
