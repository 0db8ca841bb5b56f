// Eight 16-bit elements moved as one 16-byte access, converted to and from fp32 in registers.
#pragma once

#include <cstdint>

namespace moegraph::kernels {

template <class T>
__device__ __forceinline__ void load8(const T* src, float (&v)[8]) {
  alignas(16) T in[8];
  *reinterpret_cast<uint4*>(in) = *reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(in[i]);
}

template <class T>
__device__ __forceinline__ void store8(T* dst, const float (&v)[8]) {
  alignas(16) T out[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = static_cast<T>(v[i]);
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(out);
}

}  // namespace moegraph::kernels
