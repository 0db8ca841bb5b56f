// The SwiGLU formula in fp32, defined once: the SwiGLU kernels (kernels/elementwise/swiglu.cu) and
// the MXFP8 quantizer that applies it as it reads FC1's output (launch_quantize_mxfp8_swiglu) must
// give the same bits, so both compute it here (neither translation unit flushes subnormals).
#pragma once

namespace moegraph::kernels {

__device__ __forceinline__ float swiglu_sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// a = silu(gate) * up, evaluated as (gate * sigmoid(gate)) * up.
__device__ __forceinline__ float swiglu_value(float gate, float up) { return gate * swiglu_sigmoid(gate) * up; }

// The gradients of a = silu(gate) * up given da: dgate = da * up * s * (1 + gate * (1 - s)) and
// dup = da * gate * s, s = sigmoid(gate). The SwiGLU backward kernel and the MXFP8 quantizer that
// computes FC1's output gradient as it reads (launch_quantize_mxfp8_swiglu_grad) both use them.
__device__ __forceinline__ float swiglu_grad_gate(float gate, float up, float da) {
  const float s = swiglu_sigmoid(gate);
  return da * up * s * (1.0f + gate * (1.0f - s));
}
__device__ __forceinline__ float swiglu_grad_up(float gate, float da) { return da * gate * swiglu_sigmoid(gate); }

}  // namespace moegraph::kernels
