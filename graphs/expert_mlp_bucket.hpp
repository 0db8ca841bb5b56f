// One shape bucket of the expert-MLP step: its buffers (laid out by one walk over an arena) and its
// phases. FC1 (N = 2 * ffn) -> SwiGLU -> FC2, on rows already grouped by expert. Each micro-batch's
// group layout is planned once (one offsets launch, one error record) and read by FC1, SwiGLU and
// FC2. Every phase method is an enqueue path: no synchronization, allocation or device read.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "graphs/bucket_step.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/step_graphs.hpp"
#include "src/core/device_buffer.hpp"
#include "src/core/layout.hpp"

namespace moegraph {

class ExpertMlpBucket final : public BucketStep {
 public:
  // Walks the bucket's buffers over `walk`: with a null base it only sizes them (and builds
  // nothing else), with the arena's base it also creates the operators on their workspaces.
  ExpertMlpBucket(const StepGraphsOptions& options, int64_t tokens, LayoutWalker& walk, const StepWeights& weights,
                  bool create_operators);

  BucketIO io() const override { return io_; }
  // Inference forward: y = FC2(SwiGLU(FC1(x))).
  void forward(cudaStream_t stream) override;
  // Training forward; `slot` (in [0, wgrad_slots)) keeps this micro-batch's SwiGLU input and layout.
  void forward_train(int slot, cudaStream_t stream) override;
  // Backward of the micro-batch in `slot`: dx and bias grads, wgrads at once or queued.
  void backward(int slot, cudaStream_t stream) override;
  // The queued wgrads of the oldest backward (FC2 then FC1).
  void wgrad(cudaStream_t stream) override;
  void check_device_errors(cudaStream_t stream) override;
  std::vector<PlannedBuffer> sub_buffers(const LayoutWalker::Entry& buffer) const override;

 private:
  // The layout of one micro-batch: the caller's splits, copied (a training slot keeps its own, so
  // the caller may write the next micro-batch's), and their offsets.
  struct Layout {
    int32_t* splits = nullptr;
    int64_t* offsets = nullptr;
  };
  void plan_layout(const Layout& layout, cudaStream_t stream);
  void run_forward(const Layout& layout, void* h1, bool train, cudaStream_t stream);

  MoeLayerOptions options_;
  int64_t rows_ = 0;
  BucketIO io_;
  StepWeights weights_;
  void* a_ = nullptr;                 // SwiGLU output [rows, ffn]
  void* da_ = nullptr;                // [rows, ffn]
  void* dh1_ = nullptr;               // [rows, 2 * ffn]
  std::vector<void*> h1_;             // per slot: FC1 output [rows, 2 * ffn], read by SwiGLU backward
  std::vector<Layout> layouts_;       // per slot
  Layout infer_;                      // inference forward
  DeviceBuffer error_;                // the record every layout's offsets scan raises into
  std::unique_ptr<GroupedLinear> fc1_, fc2_;
  int forward_grid_ = 0, backward_grid_ = 0;  // the SwiGLU kernels'
};

}  // namespace moegraph
