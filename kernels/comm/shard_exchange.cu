// Sharded-weight gather and reduce: plain grid-stride loads from the peers' windows (NVLink loads
// for NCCL ranks, ordinary loads for emulated ranks), so one kernel serves both transports.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/comm/shard_exchange.hpp"
#include "kernels/common/row_lanes.cuh"
#include "moegraph/error.hpp"

namespace moegraph::kernels {
namespace {

constexpr int kThreads = 256;

// Bytes [begin, end) from src to dst (the same offsets in two windows, so equally aligned): 16-byte
// vectors where both ends allow, 2-byte elements at the unaligned ends (every element is 2 or 4 bytes).
__device__ void copy_range(const char* src, char* dst, int64_t begin, int64_t end, int64_t thread, int64_t threads) {
  const int64_t mid_begin = std::min(end, (begin + 15) / 16 * 16), mid_end = std::max(mid_begin, end / 16 * 16);
  for (int64_t i = begin / 2 + thread; i < mid_begin / 2; i += threads)
    reinterpret_cast<uint16_t*>(dst)[i] = reinterpret_cast<const uint16_t*>(src)[i];
  for (int64_t i = mid_begin / 16 + thread; i < mid_end / 16; i += threads)
    reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  for (int64_t i = mid_end / 2 + thread; i < end / 2; i += threads)
    reinterpret_cast<uint16_t*>(dst)[i] = reinterpret_cast<const uint16_t*>(src)[i];
}

// blockIdx.y: tensor * ranks + step; step s reads from peer rank + s. The x dimension alone fills
// the GPU, so the steps run about one after another; taken in rank order instead, every rank would
// read from rank 0 first and R - 1 readers would share its NVLink egress.
__global__ void shard_gather_kernel(ShardExchangeParams p) {
  const int t = blockIdx.y / p.ranks, step = blockIdx.y % p.ranks;
  if (step == 0) return;  // the own rows are in place
  const int peer = (p.rank + step) % p.ranks;
  const ShardTensor& x = p.tensors[t];
  const int64_t es = x.type == DType::kFP32 ? 4 : 2;
  const int64_t first = x.ranges[2 * peer], count = x.ranges[2 * peer + 1];
  const char* src = p.window.base[peer] + x.offset;
  char* dst = p.window.base[p.rank] + x.offset;
  copy_range(src, dst, first * es, (first + count) * es, blockIdx.x * int64_t{blockDim.x} + threadIdx.x,
             int64_t{gridDim.x} * blockDim.x);
}

template <class T>
__device__ float load_float(const void* base, int64_t i) {
  if constexpr (std::is_same_v<T, float>) return static_cast<const float*>(base)[i];
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(static_cast<const T*>(base)[i]);
  else return __half2float(static_cast<const T*>(base)[i]);
}

// In = float: out (fp32) += the sum; else out (In) = the sum rounded to nearest even.
template <class In>
__device__ void reduce_tensor(const ShardExchangeParams& p, const ShardTensor& x) {
  const int64_t first = x.ranges[2 * p.rank], count = x.ranges[2 * p.rank + 1];
  const int64_t threads = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += threads) {
    float s = load_float<In>(p.window.base[0] + x.offset, first + i);
    for (int r = 1; r < p.ranks; ++r) s += load_float<In>(p.window.base[r] + x.offset, first + i);
    if constexpr (std::is_same_v<In, float>) {
      float* out = static_cast<float*>(x.out);
      out[i] = out[i] + s;
    } else if constexpr (std::is_same_v<In, __nv_bfloat16>) {
      static_cast<In*>(x.out)[i] = __float2bfloat16_rn(s);
    } else {
      static_cast<In*>(x.out)[i] = __float2half_rn(s);
    }
  }
}

// blockIdx.y: tensor.
__global__ void shard_reduce_kernel(ShardExchangeParams p) {
  const ShardTensor& x = p.tensors[blockIdx.y];
  switch (x.type) {
    case DType::kFP32: reduce_tensor<float>(p, x); break;
    case DType::kBF16: reduce_tensor<__nv_bfloat16>(p, x); break;
    case DType::kFP16: reduce_tensor<__half>(p, x); break;
  }
}

void check(const ShardExchangeParams& p, const char* who) {
  MG_CHECK(p.ranks >= 1 && p.ranks <= kMaxExpertParallel && p.rank >= 0 && p.rank < p.ranks, who, ": rank ", p.rank,
           " of ", p.ranks);
  MG_CHECK(p.count >= 1 && p.count <= kMaxShardTensors, who, ": ", p.count, " tensors (1 to ", kMaxShardTensors, ")");
  for (int t = 0; t < p.count; ++t)
    MG_CHECK(p.tensors[t].ranges != nullptr && p.tensors[t].offset % 16 == 0, who, ": tensor ", t,
             " needs its ranges and a 16-byte aligned offset");
}

int blocks_for(int64_t elements, const void* kernel) {
  return grid_blocks((std::max<int64_t>(elements, 1) + kThreads - 1) / kThreads, resident_blocks_per_sm(kernel, kThreads));
}

}  // namespace

void launch_shard_gather(const ShardExchangeParams& p, cudaStream_t stream) {
  check(p, "shard gather");
  if (p.ranks == 1) return;
  // A 16-byte vector holds 4 to 8 elements: a quarter of the elements bounds the useful threads.
  const dim3 grid(blocks_for(p.max_elements / 4, reinterpret_cast<const void*>(shard_gather_kernel)),
                  p.count * p.ranks);
  shard_gather_kernel<<<grid, kThreads, 0, stream>>>(p);
  MG_LAUNCH_CHECK();
}

void launch_shard_reduce(const ShardExchangeParams& p, cudaStream_t stream) {
  check(p, "shard reduce");  // a rank holding no rows of a tensor may pass a null `out` for it
  const dim3 grid(blocks_for(p.max_elements, reinterpret_cast<const void*>(shard_reduce_kernel)), p.count);
  shard_reduce_kernel<<<grid, kThreads, 0, stream>>>(p);
  MG_LAUNCH_CHECK();
}

}  // namespace moegraph::kernels
