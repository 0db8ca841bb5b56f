// The MoE layer program: the operator declarations (after fusion), their tensors laid out in one
// workspace, and the order of the micro-batches in flight (slots). MoeLayer is its public face.
#pragma once

#include <cuda_runtime_api.h>

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "moegraph/moe_layer.hpp"
#include "src/core/device_buffer.hpp"
#include "src/core/layout.hpp"
#include "src/ops/moe/op_spec.hpp"

namespace moegraph::layer {

class LayerProgram {
 public:
  // Sizing only (no GPU): the declarations and their layout with a null base.
  explicit LayerProgram(const MoeLayerOptions& options);
  // Set-up on real memory (`workspace` null: allocated here): binds every operator. With expert
  // parallelism, allocates the window on `comm` (collective).
  LayerProgram(const MoeLayerOptions& options, const MoeLayerWeights& weights, void* workspace,
               std::shared_ptr<EpComm> comm);

  std::size_t workspace_bytes() const { return bytes_; }
  const std::vector<LayoutWalker::Entry>& buffers() const { return entries_; }
  std::size_t window_bytes() const { return window_bytes_; }
  const std::vector<LayoutWalker::Entry>& window_entries() const { return window_entries_; }
  const std::vector<OpSpec>& specs() const { return specs_; }
  std::string describe() const;

  void forward(const MoeLayerIO& io, cudaStream_t stream);
  void forward_train(const MoeLayerIO& io, cudaStream_t stream);
  void backward(const MoeLayerIO& io, cudaStream_t stream);
  void backward_dw(cudaStream_t stream);
  void weights_changed(cudaStream_t stream);
  void set_weights(const MoeLayerWeights& weights);
  int queued_wgrads() const { return static_cast<int>(wgrad_queue_.size()); }
  int pending_backwards() const { return static_cast<int>(backward_queue_.size()); }
  const int32_t* splits() const { return tensors_.get<int32_t>(tensor::kSplits, last_slot_); }
  const int64_t* offsets() const { return tensors_.get<int64_t>(tensor::kOffsets, last_slot_); }
  uint64_t read_dropped(cudaStream_t stream);
  void check_device_errors(cudaStream_t stream);

 private:
  void build(const MoeLayerWeights& weights, std::byte* base, std::byte* window);
  void run_forward(const MoeLayerIO& io, int slot, bool train, cudaStream_t stream);
  void require_ops_ready() const;

  MoeLayerOptions options_;
  MoeLayerWeights weights_;  // as bound now (set_weights keeps which of them are set)
  std::vector<OpSpec> specs_;
  std::vector<std::unique_ptr<LayerOp>> ops_;
  TensorTable tensors_;
  std::vector<LayoutWalker::Entry> entries_, window_entries_;
  std::size_t bytes_ = 0, window_bytes_ = 0;
  std::shared_ptr<EpComm> comm_;
  DeviceBuffer owned_;
  std::vector<int> free_slots_;
  std::deque<int> backward_queue_, wgrad_queue_;
  int last_slot_ = 0;
  int device_ = -1;  // set up on; made current for every call (DeviceScope); -1: sizing only
};

}  // namespace moegraph::layer
