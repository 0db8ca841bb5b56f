// Device helpers shared by the routing kernels: the step's token count (a device scalar) and
// the expert owning a permuted row (the error record: kernels/common/device_error.cuh).
#pragma once

#include <cstdint>

#include "kernels/common/device_error.cuh"
#include "kernels/routing/moe_routing.hpp"

namespace moegraph::kernels {

constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 8;

// n = *num_tokens clamped into [0, max_tokens], identically in every kernel that reads it, so an
// invalid count never takes a kernel outside its buffers. A non-null `error` (pass it from one
// thread only) also records an out-of-range count as kDeviceErrorTokenCount (group -1, value n,
// limit max_tokens).
__device__ __forceinline__ int64_t load_token_count(const int32_t* num_tokens, int64_t max_tokens,
                                                    DeviceErrorRecord* error = nullptr) {
  const int64_t n = *num_tokens;
  if (n >= 0 && n <= max_tokens) return n;
  if (error != nullptr) raise_device_error(error, kDeviceErrorTokenCount, -1, n, max_tokens);
  return n < 0 ? 0 : max_tokens;
}

// The expert whose aligned span holds row r < offsets[E]: the largest e with offsets[e] <= r
// (empty experts share their start with the next one, so they are skipped).
__device__ __forceinline__ int expert_of_row(const int64_t* offsets, int experts, int64_t r) {
  int lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (offsets[mid] <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace moegraph::kernels
