// One shape bucket of a step, whatever the step is (the whole MoE layer, or the expert MLP alone):
// its buffers are laid out by one walk over the shared arena, and each phase is an enqueue path
// (no synchronization, allocation or device read) that the runtime captures into a graph.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "moegraph/step_graphs.hpp"
#include "src/core/layout.hpp"

namespace moegraph {

class BucketStep {
 public:
  virtual ~BucketStep() = default;
  virtual BucketIO io() const = 0;
  virtual void forward(cudaStream_t stream) = 0;
  // `slot` (in [0, wgrad_slots)): the micro-batch's saved tensors. Slots are taken and released in
  // FIFO order, the same order every operator inside keeps.
  virtual void forward_train(int slot, cudaStream_t stream) = 0;
  virtual void backward(int slot, cudaStream_t stream) = 0;
  virtual void wgrad(cudaStream_t stream) = 0;
  virtual void check_device_errors(cudaStream_t stream) = 0;
  // (token, expert) assignments dropped by a capacity factor since the last call (synchronizes).
  virtual uint64_t read_dropped(cudaStream_t /*stream*/) { return 0; }
  // Named sub-buffers of `buffer` (an operator's workspace) for --plan; empty if none.
  virtual std::vector<PlannedBuffer> sub_buffers(const LayoutWalker::Entry& /*buffer*/) const { return {}; }
};

// The options of the bucket of `tokens` tokens.
MoeLayerOptions bucket_layer_options(const StepGraphsOptions& options, int64_t tokens);

// The bucket of `tokens` tokens for options.step: sizes only (create = false) or real operators
// (with expert parallelism, on this rank's communicator `comm`).
std::unique_ptr<BucketStep> make_bucket_step(const StepGraphsOptions& options, int64_t tokens, LayoutWalker& walk,
                                             const StepWeights& weights, bool create,
                                             std::shared_ptr<EpComm> comm = nullptr);

}  // namespace moegraph
