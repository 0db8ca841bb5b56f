// Prefix sums over the 32 lanes of a warp (Hillis-Steele over shuffles). Every lane must call them.
#pragma once

namespace moegraph::kernels {

// Each lane gets the sum of `v` over lanes 0..lane.
template <class T>
__device__ __forceinline__ T warp_inclusive_sum(T v) {
  const int lane = threadIdx.x & 31;
  for (int o = 1; o < 32; o <<= 1) {
    const T up = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += up;
  }
  return v;
}

// Each lane gets the sum of `v` over lanes 0..lane-1 (0 on lane 0).
template <class T>
__device__ __forceinline__ T warp_exclusive_sum(T v) {
  return warp_inclusive_sum(v) - v;
}

}  // namespace moegraph::kernels
