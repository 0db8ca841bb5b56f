// Drives a whole-layer StepGraphs the way a caller does (its own weights and stream, inputs written
// into the bucket's buffers on that stream) and reads back everything a training step produces,
// as bits: shared by the soak and the threads tests.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "moegraph/step_graphs.hpp"
#include "testing/graph.hpp"
#include "testing/step_weights.hpp"

namespace moegraph::test {

// A small whole MoE layer: router (softmax, renormalized, aux loss), biases, fp32 main_grad,
// delayed wgrad on two slots.
inline StepGraphsOptions small_layer_step(int experts, int top_k, int64_t tokens) {
  StepGraphsOptions o;
  o.step = StepKind::kMoeLayer;
  MoeLayerOptions& l = o.layer;
  l.experts = experts, l.hidden = 256, l.ffn = 256, l.top_k = top_k, l.bias = true;
  l.score = RouterScore::kSoftmax, l.renormalize = true, l.aux_loss_coef = 0.01;
  l.training = true, l.delay_wgrad = true, l.wgrad_slots = 2, l.main_grad_fp32 = true;
  o.buckets = {tokens};
  return o;
}

struct StepBits {
  std::vector<uint16_t> y, dx;
  std::vector<uint32_t> main_grad_router, main_grad1, main_grad2, aux;
  bool operator==(const StepBits&) const = default;
};

class StepDriver {
 public:
  explicit StepDriver(StepGraphsOptions o)
      : options_(o), weights_(testing::make_step_weights(o, stream_.get())), step_(o, weights_.weights) {}

  StepGraphs& step() { return step_; }
  cudaStream_t stream() const { return stream_.get(); }
  int64_t tokens() const { return options_.buckets.front(); }
  int64_t hidden() const { return options_.layer.hidden; }

  // x and dy for every row of the bucket (bf16 bits; empty: left as they are), and the token
  // count, on the driver's stream.
  void write_inputs(const std::vector<uint16_t>& x, const std::vector<uint16_t>& dy, int32_t num_tokens) {
    const BucketIO io = step_.io(0);
    if (!x.empty()) MG_CUDA_CHECK(cudaMemcpyAsync(io.x, x.data(), x.size() * 2, cudaMemcpyHostToDevice, stream()));
    if (!dy.empty())
      MG_CUDA_CHECK(cudaMemcpyAsync(io.dy, dy.data(), dy.size() * 2, cudaMemcpyHostToDevice, stream()));
    num_tokens_ = num_tokens;  // a pageable source copies synchronously, so a local is safe
    MG_CUDA_CHECK(cudaMemcpyAsync(io.num_tokens, &num_tokens_, 4, cudaMemcpyHostToDevice, stream()));
  }
  // main_grad back to zero and the outputs poisoned, so each checked step stands alone.
  void reset_outputs() {
    const BucketIO io = step_.io(0);
    const StepWeights& w = weights_.weights;
    const MoeLayerOptions& l = options_.layer;
    MG_CUDA_CHECK(cudaMemsetAsync(io.y, 0xff, tokens() * hidden() * 2, stream()));
    MG_CUDA_CHECK(cudaMemsetAsync(io.dx, 0xff, tokens() * hidden() * 2, stream()));
    MG_CUDA_CHECK(cudaMemsetAsync(w.main_grad_router, 0, l.experts * l.hidden * 4, stream()));
    MG_CUDA_CHECK(cudaMemsetAsync(w.main_grad1, 0, l.experts * 2 * l.ffn * l.hidden * 4, stream()));
    MG_CUDA_CHECK(cudaMemsetAsync(w.main_grad2, 0, l.experts * l.hidden * l.ffn * 4, stream()));
  }
  // forward_train, backward, wgrad: replayed graphs, or the same phases eagerly.
  void train_step(bool graph) {
    if (graph) {
      step_.forward_train(0, stream()), step_.backward(0, stream()), step_.wgrad(0, stream());
    } else {
      step_.run_eager(0, StepPhase::kForwardTrain, stream());
      step_.run_eager(0, StepPhase::kBackward, stream());
      step_.run_eager(0, StepPhase::kWgrad, stream());
    }
  }
  StepBits read() {
    const BucketIO io = step_.io(0);
    const StepWeights& w = weights_.weights;
    const MoeLayerOptions& l = options_.layer;
    StepBits b;
    b.y = copy<uint16_t>(io.y, tokens() * hidden());
    b.dx = copy<uint16_t>(io.dx, tokens() * hidden());
    b.main_grad_router = copy<uint32_t>(w.main_grad_router, l.experts * l.hidden);
    b.main_grad1 = copy<uint32_t>(w.main_grad1, l.experts * 2 * l.ffn * l.hidden);
    b.main_grad2 = copy<uint32_t>(w.main_grad2, l.experts * l.hidden * l.ffn);
    b.aux = copy<uint32_t>(io.aux_loss, 1);
    return b;
  }

 private:
  template <class T>
  std::vector<T> copy(const void* p, int64_t count) {
    std::vector<T> out(count);
    MG_CUDA_CHECK(cudaMemcpyAsync(out.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost, stream()));
    MG_CUDA_CHECK(cudaStreamSynchronize(stream()));
    return out;
  }

  StepGraphsOptions options_;
  testing::Stream stream_;
  testing::OwnedStepWeights weights_;
  StepGraphs step_;
  int32_t num_tokens_ = 0;
};

}  // namespace moegraph::test
