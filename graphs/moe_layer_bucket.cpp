#include "graphs/moe_layer_bucket.hpp"

#include "graphs/expert_mlp_bucket.hpp"
#include "moegraph/error.hpp"

namespace moegraph {

MoeLayerBucket::MoeLayerBucket(const StepGraphsOptions& step, int64_t tokens, LayoutWalker& walk, const StepWeights& w,
                               bool create, std::shared_ptr<EpComm> comm)
    : options_(bucket_layer_options(step, tokens)) {
  const std::size_t es = dtype_size(options_.dtype);
  const int64_t h = options_.hidden;
  io_.tokens = tokens;
  io_.rows = moe_expert_rows(options_);
  io_.x = walk.take("x", tokens, h, es);
  io_.num_tokens = walk.take<int32_t>("num_tokens", sizeof(int32_t));
  io_.y = walk.take("y", tokens, h, es);
  io_.aux_loss = walk.take<float>("aux_loss", sizeof(float));
  if (options_.training) {
    io_.dy = walk.take("dy", tokens, h, es);
    io_.dx = walk.take("dx", tokens, h, es);
  }
  void* workspace = walk.take("layer.workspace", MoeLayer::workspace_bytes(options_));
  if (!create) return;
  MoeLayerWeights lw;
  lw.router = w.router;
  lw.w1 = w.w1, lw.b1 = w.b1, lw.w2 = w.w2, lw.b2 = w.b2;
  lw.main_grad_router = w.main_grad_router, lw.main_grad1 = w.main_grad1, lw.main_grad2 = w.main_grad2;
  lw.d_router = w.d_router, lw.dw1 = w.dw1, lw.dw2 = w.dw2, lw.db1 = w.db1, lw.db2 = w.db2;
  lw.w1_mxfp8 = w.w1_mxfp8, lw.w2_mxfp8 = w.w2_mxfp8;
  layer_ = std::make_unique<MoeLayer>(options_, lw, workspace, std::move(comm));
}

MoeLayerIO MoeLayerBucket::layer_io() const {
  MoeLayerIO io;
  io.x = io_.x;
  io.num_tokens = io_.num_tokens;
  io.y = io_.y;
  io.aux_loss = io_.aux_loss;
  io.dy = io_.dy;
  io.dx = io_.dx;
  return io;
}

void MoeLayerBucket::check_device_errors(cudaStream_t stream) {
  try {
    layer_->check_device_errors(stream);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kDeviceSplits) throw;
    detail::throw_error(__FILE__, __LINE__, detail::concat("bucket of ", io_.tokens, " tokens: ", e.message()),
                        ErrorKind::kDeviceSplits);
  }
}

std::vector<PlannedBuffer> MoeLayerBucket::sub_buffers(const LayoutWalker::Entry& buffer) const {
  std::vector<PlannedBuffer> out;
  if (buffer.name != "layer.workspace") return out;
  for (const auto& b : MoeLayer::workspace_buffers(options_))
    out.push_back({"layer." + b.name, buffer.offset + b.offset, b.bytes, buffer.name});
  return out;
}

MoeLayerOptions bucket_layer_options(const StepGraphsOptions& options, int64_t tokens) {
  MoeLayerOptions o = options.layer;
  o.max_tokens = tokens;
  // The mxfp8 recipe's buckets read one set of MXFP8 weights: the caller's, or the step's shared copies.
  o.prequantized_weights = o.recipe == Recipe::kMXFP8;
  return o;
}

std::unique_ptr<BucketStep> make_bucket_step(const StepGraphsOptions& options, int64_t tokens, LayoutWalker& walk,
                                             const StepWeights& weights, bool create, std::shared_ptr<EpComm> comm) {
  switch (options.step) {
    case StepKind::kMoeLayer:
      return std::make_unique<MoeLayerBucket>(options, tokens, walk, weights, create, std::move(comm));
    case StepKind::kExperts: return std::make_unique<ExpertMlpBucket>(options, tokens, walk, weights, create);
  }
  MG_FAIL("unknown step kind ", static_cast<int>(options.step));
}

}  // namespace moegraph
