// Parameters for a StepGraphs owned by its caller (the benchmark, the tests): one device block laid
// out like the plan's weights, filled with seeded uniform values of realistic scale.
#pragma once

#include <cuda_runtime_api.h>

#include "moegraph/step_graphs.hpp"
#include "src/core/device_buffer.hpp"

namespace moegraph::testing {

struct OwnedStepWeights {
  DeviceBuffer block;
  StepWeights weights;
};

// Allocates and fills (enqueued on `stream`): w1, w2 ~ U(+-1/sqrt(fan_in)), router rows of norm
// about 1 (logits spread about 1 against unit-variance x: a realistic routing), biases U(+-0.1),
// gradients zero. With layer.prequantized_weights, w1 and w2 are those values quantized into
// w1_mxfp8 and w2_mxfp8 (no 16-bit copy kept). Synchronizes `stream` before it returns (set-up).
OwnedStepWeights make_step_weights(const StepGraphsOptions& options, cudaStream_t stream);

}  // namespace moegraph::testing
