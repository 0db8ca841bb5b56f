// One shape bucket of the whole-MoE-layer step: the caller's buffers (x, the device token count,
// y, aux loss, dy, dx) and one MoeLayer on the bucket's share of the arena.
#pragma once

#include <memory>

#include "graphs/bucket_step.hpp"
#include "moegraph/moe_layer.hpp"

namespace moegraph {

class MoeLayerBucket final : public BucketStep {
 public:
  MoeLayerBucket(const StepGraphsOptions& options, int64_t tokens, LayoutWalker& walk, const StepWeights& weights,
                 bool create, std::shared_ptr<EpComm> comm);
  BucketIO io() const override { return io_; }
  void forward(cudaStream_t stream) override { layer_->forward(layer_io(), stream); }
  void forward_train(int, cudaStream_t stream) override { layer_->forward_train(layer_io(), stream); }
  void backward(int, cudaStream_t stream) override { layer_->backward(layer_io(), stream); }
  void wgrad(cudaStream_t stream) override { layer_->backward_dw(stream); }
  void check_device_errors(cudaStream_t stream) override;
  uint64_t read_dropped(cudaStream_t stream) override { return layer_->read_dropped(stream); }
  std::vector<PlannedBuffer> sub_buffers(const LayoutWalker::Entry& buffer) const override;
  const MoeLayer& layer() const { return *layer_; }

 private:
  MoeLayerIO layer_io() const;
  MoeLayerOptions options_;
  BucketIO io_;
  std::unique_ptr<MoeLayer> layer_;
};

}  // namespace moegraph
