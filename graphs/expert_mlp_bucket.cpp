#include "graphs/expert_mlp_bucket.hpp"

#include "kernels/elementwise/elementwise.hpp"
#include "kernels/routing/offsets.hpp"
#include "moegraph/error.hpp"
#include "src/ops/shape_rules.hpp"

namespace moegraph {

int64_t bucket_rows(const Config& c, int64_t tokens) {
  const int64_t align = c.row_align;
  const int64_t worst = tokens * c.layer.top_k + (align > 1 ? int64_t{c.layer.experts} * (align - 1) : 0);
  return (worst + align - 1) / align * align;
}

namespace {
GroupedLinearOptions linear_options(const Config& c, int64_t rows, int64_t k, int64_t n) {
  GroupedLinearOptions o;
  o.num_groups = c.layer.experts;
  o.in_features = k;
  o.out_features = n;
  o.capacity_rows = rows;
  o.row_align = c.row_align;
  o.dtype = c.precision.dtype;
  o.bias = c.layer.bias;
  o.wgrad_slots = c.training.wgrad_slots;
  o.delay_wgrad = c.training.enabled && c.training.delay_wgrad;
  o.recipe = recipe_of(c);
  return o;
}
}  // namespace

GroupedLinearOptions fc1_options(const Config& c, int64_t rows) {
  return linear_options(c, rows, c.layer.hidden, 2 * c.layer.ffn);
}
GroupedLinearOptions fc2_options(const Config& c, int64_t rows) {
  return linear_options(c, rows, c.layer.ffn, c.layer.hidden);
}

ExpertMlpBucket::ExpertMlpBucket(const Config& config, int64_t tokens, LayoutWalker& walk, const StepWeights& weights,
                                 bool create_operators)
    : config_(config), rows_(bucket_rows(config, tokens)), weights_(weights) {
  const auto& l = config.layer;
  const std::size_t es = dtype_size(config.precision.dtype);
  const int64_t g = l.experts, h = l.hidden, f = l.ffn;
  io_.tokens = tokens;
  io_.rows = rows_;
  io_.x = walk.take("x", rows_ * h * es);
  io_.splits = walk.take<int32_t>("splits", g * sizeof(int32_t));
  io_.y = walk.take("y", rows_ * h * es);
  a_ = walk.take("swiglu_out", rows_ * f * es);
  offsets_infer_ = walk.take<int64_t>("offsets.forward", (g + 1) * sizeof(int64_t));
  const int slots = config.training.enabled ? config.training.wgrad_slots : 1;
  for (int s = 0; s < slots; ++s) {
    h1_.push_back(walk.take(detail::concat("slot", s, ".fc1_out"), rows_ * 2 * f * es));
    offsets_.push_back(walk.take<int64_t>(detail::concat("slot", s, ".offsets"), (g + 1) * sizeof(int64_t)));
  }
  if (config.training.enabled) {
    io_.dy = walk.take("dy", rows_ * h * es);
    io_.dx = walk.take("dx", rows_ * h * es);
    da_ = walk.take("d_swiglu_out", rows_ * f * es);
    dh1_ = walk.take("d_fc1_out", rows_ * 2 * f * es);
  }
  const GroupedLinearOptions o1 = fc1_options(config, rows_), o2 = fc2_options(config, rows_);
  void* ws1 = walk.take("fc1.workspace", GroupedLinear::workspace_bytes(o1));
  void* ws2 = walk.take("fc2.workspace", GroupedLinear::workspace_bytes(o2));
  if (!create_operators) return;
  fc1_ = std::make_unique<GroupedLinear>(o1, ws1);
  fc2_ = std::make_unique<GroupedLinear>(o2, ws2);
  error_ = DeviceBuffer(sizeof(DeviceErrorRecord));
  MG_CUDA_CHECK(cudaMemset(error_.get(), 0, sizeof(DeviceErrorRecord)));
  int device = 0, sms = 0;
  MG_CUDA_CHECK(cudaGetDevice(&device));
  MG_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  grid_ = sms * 4;
}

void ExpertMlpBucket::swiglu_and_fc2(const int64_t* offsets, void* h1, bool train, cudaStream_t stream) {
  kernels::launch_swiglu_forward(config_.precision.dtype, h1, a_, config_.layer.ffn, offsets, config_.layer.experts,
                                 grid_, stream);
  ForwardArgs f2{a_, io_.splits, weights_.w2, weights_.b2, nullptr, io_.y};
  if (train) fc2_->forward_train(f2, stream);
  else fc2_->forward(f2, stream);
}

void ExpertMlpBucket::forward(cudaStream_t stream) {
  const int g = config_.layer.experts;
  kernels::launch_group_offsets(io_.splits, g, config_.row_align, rows_, offsets_infer_,
                                error_.as<DeviceErrorRecord>(), stream);
  fc1_->forward({io_.x, io_.splits, weights_.w1, weights_.b1, nullptr, h1_[0]}, stream);
  swiglu_and_fc2(offsets_infer_, h1_[0], false, stream);
}

void ExpertMlpBucket::forward_train(int slot, cudaStream_t stream) {
  MG_CHECK(config_.training.enabled, "forward_train needs training.enabled");
  const int g = config_.layer.experts;
  kernels::launch_group_offsets(io_.splits, g, config_.row_align, rows_, offsets_[slot],
                                error_.as<DeviceErrorRecord>(), stream);
  fc1_->forward_train({io_.x, io_.splits, weights_.w1, weights_.b1, nullptr, h1_[slot]}, stream);
  swiglu_and_fc2(offsets_[slot], h1_[slot], true, stream);
}

void ExpertMlpBucket::backward(int slot, cudaStream_t stream) {
  const WgradMode mode = config_.training.delay_wgrad ? WgradMode::kDelayed : WgradMode::kImmediate;
  const bool fp32 = config_.training.main_grad_fp32;
  BackwardArgs b2{io_.dy, weights_.w2, weights_.b2, da_, weights_.db2, nullptr,
                  fp32 ? nullptr : weights_.dw2, fp32 ? weights_.main_grad2 : nullptr};
  fc2_->backward(b2, fc2_->options().recipe, mode, stream);
  kernels::launch_swiglu_backward(config_.precision.dtype, h1_[slot], da_, dh1_, config_.layer.ffn, offsets_[slot],
                                  config_.layer.experts, grid_, stream);
  BackwardArgs b1{dh1_, weights_.w1, weights_.b1, io_.dx, weights_.db1, nullptr,
                  fp32 ? nullptr : weights_.dw1, fp32 ? weights_.main_grad1 : nullptr};
  fc1_->backward(b1, fc1_->options().recipe, mode, stream);
}

void ExpertMlpBucket::weights_changed(cudaStream_t stream) {
  if (recipe_of(config_) != Recipe::kMXFP8) return;
  fc1_->quantize_weights(weights_.w1, stream);
  fc2_->quantize_weights(weights_.w2, stream);
}

void ExpertMlpBucket::wgrad(cudaStream_t stream) {
  fc2_->backward_dw(stream);
  fc1_->backward_dw(stream);
}

std::vector<PlannedBuffer> ExpertMlpBucket::sub_buffers(const LayoutWalker::Entry& e) const {
  std::vector<PlannedBuffer> out;
  const bool fc1 = e.name == "fc1.workspace", fc2 = e.name == "fc2.workspace";
  if (!fc1 && !fc2) return out;
  const GroupedLinearOptions o = fc1 ? fc1_options(config_, rows_) : fc2_options(config_, rows_);
  for (const auto& w : GroupedLinear::workspace_buffers(o))
    out.push_back({(fc1 ? "  fc1." : "  fc2.") + w.name, e.offset + w.offset, w.bytes});
  return out;
}

void ExpertMlpBucket::check_device_errors(cudaStream_t stream) {
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::string first;  // every record is read and cleared; the first problem is reported
  DeviceErrorRecord record{};
  MG_CUDA_CHECK(cudaMemcpy(&record, error_.get(), sizeof(record), cudaMemcpyDeviceToHost));
  if (record.code != 0) {
    MG_CUDA_CHECK(cudaMemset(error_.get(), 0, sizeof(record)));
    first = describe_device_error(record, config_.row_align);
  }
  for (GroupedLinear* op : {fc1_.get(), fc2_.get()}) {
    try {
      op->check_device_errors(stream);
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kDeviceSplits) throw;
      const std::string prefix = "invalid device splits: ";
      const std::string& m = e.message();
      if (first.empty()) first = m.rfind(prefix, 0) == 0 ? m.substr(prefix.size()) : m;
    }
  }
  if (!first.empty())
    detail::throw_error(__FILE__, __LINE__,
                        detail::concat("bucket of ", io_.tokens, " tokens: invalid device splits: ", first),
                        ErrorKind::kDeviceSplits);
}

}  // namespace moegraph
