// The SwiGLU formula in fp32, defined once: the SwiGLU kernels (kernels/elementwise/swiglu.cu) and
// the MXFP8 quantizer that applies it as it reads FC1's output (launch_quantize_mxfp8_swiglu) must
// give the same bits, so both compute it here (neither translation unit flushes subnormals).
#pragma once

namespace moegraph::kernels {

__device__ __forceinline__ float swiglu_sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// a = silu(gate) * up, evaluated as (gate * sigmoid(gate)) * up.
__device__ __forceinline__ float swiglu_value(float gate, float up) { return gate * swiglu_sigmoid(gate) * up; }

}  // namespace moegraph::kernels
