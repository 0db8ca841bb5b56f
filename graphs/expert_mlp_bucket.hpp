// One shape bucket of the expert-MLP step: its buffers (laid out by one walk over an arena) and its
// phases. FC1 (N = 2 * ffn) -> SwiGLU -> FC2, on rows already grouped by expert.
// Every phase method is an enqueue path: no synchronization, allocation or device read.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "graphs/bucket_step.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/step_graphs.hpp"
#include "src/common/device_buffer.hpp"
#include "src/common/layout.hpp"

namespace moegraph {

// Rows of a bucket: tokens * top_k, plus the worst-case alignment padding, rounded to row_align.
int64_t bucket_rows(const Config& config, int64_t tokens);
GroupedLinearOptions fc1_options(const Config& config, int64_t rows);
GroupedLinearOptions fc2_options(const Config& config, int64_t rows);

class ExpertMlpBucket final : public BucketStep {
 public:
  // Walks the bucket's buffers over `walk`: with a null base it only sizes them (and builds
  // nothing else), with the arena's base it also creates the operators on their workspaces.
  ExpertMlpBucket(const Config& config, int64_t tokens, LayoutWalker& walk, const StepWeights& weights,
                  bool create_operators);

  BucketIO io() const override { return io_; }
  // Inference forward: y = FC2(SwiGLU(FC1(x))).
  void forward(cudaStream_t stream) override;
  // Training forward; `slot` (in [0, wgrad_slots)) keeps this micro-batch's SwiGLU input and offsets.
  void forward_train(int slot, cudaStream_t stream) override;
  // Backward of the micro-batch in `slot`: dx and bias grads, wgrads at once or queued.
  void backward(int slot, cudaStream_t stream) override;
  // The queued wgrads of the oldest backward (FC2 then FC1).
  void wgrad(cudaStream_t stream) override;
  void check_device_errors(cudaStream_t stream) override;
  void weights_changed(cudaStream_t stream) override;
  std::vector<PlannedBuffer> sub_buffers(const LayoutWalker::Entry& buffer) const override;

 private:
  void swiglu_and_fc2(const int64_t* offsets, void* h1, bool train, cudaStream_t stream);

  Config config_;
  int64_t rows_ = 0;
  BucketIO io_;
  StepWeights weights_;
  void* a_ = nullptr;                 // SwiGLU output [rows, ffn]
  void* da_ = nullptr;                // [rows, ffn]
  void* dh1_ = nullptr;               // [rows, 2 * ffn]
  std::vector<void*> h1_;             // per slot: FC1 output [rows, 2 * ffn], read by SwiGLU backward
  std::vector<int64_t*> offsets_;     // per slot: group offsets of that micro-batch
  int64_t* offsets_infer_ = nullptr;
  DeviceBuffer error_;                // the bucket's own offset scans
  std::unique_ptr<GroupedLinear> fc1_, fc2_;
  int grid_ = 0;
};

}  // namespace moegraph
