// The expert weights of a sharded step (StepGraphsOptions::sharding.ranks = W > 1). Each rank of
// the data-parallel group holds a shard of w1, w2, b1, b2 and of their gradients (the caller's
// StepWeights); the step works on full tensors kept in one window on the group's communicator:
//   forward / forward_train: gather (every rank's rows into every window), then the layer reads the
//     full weights — backward reuses them;
//   a phase that writes weight gradients: the full fp32 gradients are zeroed first (the layer adds
//     into them), and after the phase each rank reduces its own rows over the group into its
//     main_grad shard (added) or its dw shard (written); bias gradients (written by backward) are
//     reduced after backward.
// No rank ever holds another rank's reduced rows: each full gradient is only the input of the
// reduction, as it would be for a reduce-scatter. Every enqueue is a graph-capturable sequence of
// copies, kernels and device barriers.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/comm/shard_exchange.hpp"
#include "moegraph/expert_parallel.hpp"
#include "moegraph/sharding.hpp"
#include "moegraph/step_graphs.hpp"
#include "src/core/device_buffer.hpp"
#include "src/core/layout.hpp"

namespace moegraph {

// One expert tensor's rows in the sharding's unit.
struct ShardedTensorShape {
  const char* name;
  int64_t global_rows, row_elements;
};
// w1, w2 and (with layer.bias) b1, b2.
std::vector<ShardedTensorShape> sharded_tensor_shapes(const StepGraphsOptions& options);
// The window every rank allocates (full weights, full gradients, descriptor table, barrier), as
// named buffers from a null base. Touches no GPU.
std::vector<LayoutWalker::Entry> shard_window_layout(const StepGraphsOptions& options);
std::size_t shard_window_bytes(const StepGraphsOptions& options);
// The bytes of the caller's largest shards of every expert tensor and gradient (rank 0's under
// both policies), for the plan.
std::size_t largest_shard_bytes(const StepGraphsOptions& options);

class ShardedWeights {
 public:
  // Set-up, collective over `comm` (sharding.ranks ranks): allocates the window. Call
  // exchange_shards once every rank's allocations are done (after the group's set_up_barrier).
  ShardedWeights(const StepGraphsOptions& options, const StepWeights& shards, std::shared_ptr<EpComm> comm);
  ~ShardedWeights();

  // Set-up, collective, synchronizes `stream`: every rank's descriptors (the caller's, or the
  // policy's) to every rank, checked on every rank (moegraph::Error naming the tensor and rank).
  void exchange_shards(cudaStream_t stream);

  // The caller's weights with the expert tensors and their gradients replaced by the full ones in
  // the window: what the buckets' layers read and write.
  const StepWeights& full() const { return full_; }

  // Enqueue paths (no synchronization, allocation or device read on the host).
  void gather(cudaStream_t stream);
  void zero_weight_gradients(cudaStream_t stream);  // before a phase writing fp32 weight gradients
  void reduce(bool weights, bool biases, cudaStream_t stream);

  // Synchronizes `stream`; throws moegraph::Error (kDeviceSplits) when a barrier timed out.
  void check_device_errors(cudaStream_t stream);
  // Every rank's rows of every tensor, e.g. "w1 (expert rows of 2048 x 4096): rank 0 [0, 4) ...".
  std::string describe() const;
  // The data-parallel group's communicator.
  const EpComm& comm() const { return *comm_; }

 private:
  struct Tensor;
  void barrier(cudaStream_t stream);
  kernels::ShardExchangeParams params(bool gradients, bool weights, bool biases) const;

  StepGraphsOptions options_;
  std::shared_ptr<EpComm> comm_;
  std::shared_ptr<EpWindow> window_;
  StepWeights full_;
  std::vector<Tensor> tensors_;
  DeviceBuffer ranges_;  // [tensor][rank][2] first element and count
  std::vector<Shard> table_;  // [rank][tensor], after exchange_shards
  uint32_t* flags_ = nullptr;
  uint32_t* epoch_ = nullptr;
  DeviceErrorRecord* error_ = nullptr;
  Shard* shared_table_ = nullptr;  // window [rank][kMaxShardTensors]
};

}  // namespace moegraph
