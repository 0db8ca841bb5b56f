#include "graphs/expert_mlp_bucket.hpp"

#include "kernels/common/device_query.hpp"
#include "kernels/elementwise/elementwise.hpp"
#include "kernels/routing/offsets.hpp"
#include "moegraph/error.hpp"
#include "src/ops/group_layout.hpp"
#include "src/ops/moe/op_spec.hpp"

namespace moegraph {

ExpertMlpBucket::ExpertMlpBucket(const StepGraphsOptions& step, int64_t tokens, LayoutWalker& walk,
                                 const StepWeights& weights, bool create_operators)
    : options_(bucket_layer_options(step, tokens)), rows_(moe_layer_rows(options_)), weights_(weights) {
  const MoeLayerOptions& o = options_;
  const std::size_t es = dtype_size(o.dtype);
  const int64_t g = o.experts, h = o.hidden, f = o.ffn;
  io_.tokens = tokens;
  io_.rows = rows_;
  io_.x = walk.take("x", rows_, h, es);
  io_.splits = walk.take<int32_t>("splits", g, sizeof(int32_t));
  io_.y = walk.take("y", rows_, h, es);
  a_ = walk.take("swiglu_out", rows_, f, es);
  infer_ = {io_.splits, walk.take<int64_t>("offsets.forward", g + 1, sizeof(int64_t))};
  const int slots = o.training ? o.wgrad_slots : 1;
  for (int s = 0; s < slots; ++s) {
    h1_.push_back(walk.take(detail::concat("slot", s, ".fc1_out"), rows_, 2, f, es));
    layouts_.push_back({walk.take<int32_t>(detail::concat("slot", s, ".splits"), g, sizeof(int32_t)),
                        walk.take<int64_t>(detail::concat("slot", s, ".offsets"), g + 1, sizeof(int64_t))});
  }
  if (o.training) {
    io_.dy = walk.take("dy", rows_, h, es);
    io_.dx = walk.take("dx", rows_, h, es);
    da_ = walk.take("d_swiglu_out", rows_, f, es);
    dh1_ = walk.take("d_fc1_out", rows_, 2, f, es);
  }
  const GroupedLinearOptions o1 = layer::expert_linear_options(o, 1, rows_);
  const GroupedLinearOptions o2 = layer::expert_linear_options(o, 2, rows_);
  void* ws1 = walk.take("fc1.workspace", GroupedLinear::workspace_bytes(o1));
  void* ws2 = walk.take("fc2.workspace", GroupedLinear::workspace_bytes(o2));
  if (!create_operators) return;
  fc1_ = std::make_unique<GroupedLinear>(o1, ws1);
  fc2_ = std::make_unique<GroupedLinear>(o2, ws2);
  error_ = DeviceBuffer(sizeof(DeviceErrorRecord));
  MG_CUDA_CHECK(cudaMemset(error_.get(), 0, sizeof(DeviceErrorRecord)));
  forward_grid_ = kernels::swiglu_grid(options_.dtype, false);
  backward_grid_ = kernels::swiglu_grid(options_.dtype, true);
}

void ExpertMlpBucket::plan_layout(const Layout& layout, cudaStream_t stream) {
  const int g = options_.experts;
  if (layout.splits != io_.splits)
    MG_CUDA_CHECK(
        cudaMemcpyAsync(layout.splits, io_.splits, g * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream));
  kernels::launch_group_offsets(layout.splits, g, options_.row_align, rows_, layout.offsets,
                                error_.as<DeviceErrorRecord>(), stream);
}

void ExpertMlpBucket::run_forward(const Layout& layout, void* h1, bool train, cudaStream_t stream) {
  ForwardArgs f1{io_.x, layout.splits, weights_.w1, weights_.b1, nullptr, h1, layout.offsets, weights_.w1_mxfp8};
  ForwardArgs f2{a_, layout.splits, weights_.w2, weights_.b2, nullptr, io_.y, layout.offsets, weights_.w2_mxfp8};
  if (train) fc1_->forward_train(f1, stream);
  else fc1_->forward(f1, stream);
  kernels::launch_swiglu_forward(options_.dtype, h1, a_, options_.ffn, layout.offsets, options_.experts, forward_grid_,
                                 stream);
  if (train) fc2_->forward_train(f2, stream);
  else fc2_->forward(f2, stream);
}

void ExpertMlpBucket::forward(cudaStream_t stream) {
  plan_layout(infer_, stream);
  run_forward(infer_, h1_[0], false, stream);
}

void ExpertMlpBucket::forward_train(int slot, cudaStream_t stream) {
  MG_CHECK(options_.training, "forward_train needs training");
  plan_layout(layouts_[slot], stream);
  run_forward(layouts_[slot], h1_[slot], true, stream);
}

void ExpertMlpBucket::backward(int slot, cudaStream_t stream) {
  const WgradMode mode = options_.delay_wgrad ? WgradMode::kDelayed : WgradMode::kImmediate;
  const bool fp32 = options_.main_grad_fp32;
  BackwardArgs b2{io_.dy, weights_.w2, weights_.b2, da_, weights_.db2, nullptr,
                  fp32 ? nullptr : weights_.dw2, fp32 ? weights_.main_grad2 : nullptr, weights_.w2_mxfp8};
  fc2_->backward(b2, mode, stream);
  kernels::launch_swiglu_backward(options_.dtype, h1_[slot], da_, dh1_, options_.ffn, layouts_[slot].offsets,
                                  options_.experts, backward_grid_, stream);
  BackwardArgs b1{dh1_, weights_.w1, weights_.b1, io_.dx, weights_.db1, nullptr,
                  fp32 ? nullptr : weights_.dw1, fp32 ? weights_.main_grad1 : nullptr, weights_.w1_mxfp8};
  fc1_->backward(b1, mode, stream);
}

void ExpertMlpBucket::wgrad(cudaStream_t stream) {
  fc2_->backward_dw(stream);
  fc1_->backward_dw(stream);
}

std::vector<PlannedBuffer> ExpertMlpBucket::sub_buffers(const LayoutWalker::Entry& e) const {
  std::vector<PlannedBuffer> out;
  const bool fc1 = e.name == "fc1.workspace", fc2 = e.name == "fc2.workspace";
  if (!fc1 && !fc2) return out;
  const GroupedLinearOptions o = layer::expert_linear_options(options_, fc1 ? 1 : 2, rows_);
  for (const auto& w : GroupedLinear::workspace_buffers(o))
    out.push_back({(fc1 ? "fc1." : "fc2.") + w.name, e.offset + w.offset, w.bytes, e.name});
  return out;
}

void ExpertMlpBucket::check_device_errors(cudaStream_t stream) {
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));
  const DeviceErrorRecord record = take_device_error_record(error_);
  if (record.code != kDeviceErrorNone)
    detail::throw_error(__FILE__, __LINE__,
                        detail::concat("bucket of ", io_.tokens, " tokens: invalid device splits: ",
                                       describe_device_error(record, options_.row_align)),
                        ErrorKind::kDeviceSplits);
}

}  // namespace moegraph
