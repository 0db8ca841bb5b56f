#include "testing/step_weights.hpp"

#include <cmath>

#include "graphs/step_weights.hpp"
#include "kernels/elementwise/elementwise.hpp"
#include "moegraph/error.hpp"

namespace moegraph::testing {

OwnedStepWeights make_step_weights(const StepGraphsOptions& options, cudaStream_t stream) {
  cudaStream_t s = stream;
  OwnedStepWeights out;
  LayoutWalker sizing;
  lay_out_weights(options, sizing);
  out.block = DeviceBuffer(sizing.bytes());
  MG_CUDA_CHECK(cudaMemsetAsync(out.block.get(), 0, sizing.bytes(), s));
  LayoutWalker walk(static_cast<std::byte*>(out.block.get()));
  out.weights = lay_out_weights(options, walk);
  const MoeLayerOptions& l = options.layer;
  const StepWeights& w = out.weights;
  const DType dt = l.dtype;
  const int64_t g = moe_local_experts(l);  // the expert tensors' experts (this rank's, as laid out)
  // With prequantized weights the 16-bit values (the same as without) exist only long enough to be
  // quantized: the step then reads exactly what it would have quantized itself.
  DeviceBuffer w1_16, w2_16;
  void* w1 = w.w1;
  void* w2 = w.w2;
  if (l.prequantized_weights) {
    w1_16 = DeviceBuffer(g * 2 * l.ffn * l.hidden * dtype_size(dt)), w1 = w1_16.get();
    w2_16 = DeviceBuffer(g * l.hidden * l.ffn * dtype_size(dt)), w2 = w2_16.get();
  }
  kernels::launch_fill_uniform(dt, w1, g * 2 * l.ffn * l.hidden, 1.0f / std::sqrt(float(l.hidden)), 1, s);
  kernels::launch_fill_uniform(dt, w2, g * l.hidden * l.ffn, 1.0f / std::sqrt(float(l.ffn)), 2, s);
  if (l.prequantized_weights) {
    quantize_mxfp8_weights(dt, w1, static_cast<int>(g), 2 * l.ffn, l.hidden, w.w1_mxfp8, s);
    quantize_mxfp8_weights(dt, w2, static_cast<int>(g), l.hidden, l.ffn, w.w2_mxfp8, s);
  }
  if (w.router != nullptr)
    kernels::launch_fill_uniform(dt, w.router, l.experts * l.hidden, std::sqrt(3.0f / float(l.hidden)), 5, s);
  if (l.bias) {
    kernels::launch_fill_uniform(dt, w.b1, g * 2 * l.ffn, 0.1f, 3, s);
    kernels::launch_fill_uniform(dt, w.b2, g * l.hidden, 0.1f, 4, s);
  }
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));  // set-up: ready before any other stream reads them (and
                                                 // before the temporary 16-bit weights are freed)
  return out;
}

}  // namespace moegraph::testing
