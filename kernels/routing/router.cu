// Router logits of a small batch, top-k, its auxiliary load-balancing loss, and its backward.
// Top-k: one warp per token; lane l holds experts l, l + 32, ... in registers (kPerLane of them, a
// compile-time count so the arrays never leave registers), so E <= 32 * kPerLane <= 1024.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/common/alignment.hpp"
#include "kernels/common/dtype_dispatch.cuh"
#include "kernels/common/row_lanes.cuh"
#include "kernels/common/vector_io.cuh"
#include "kernels/routing/moe_routing.hpp"
#include "kernels/routing/routing_common.cuh"
#include "moegraph/error.hpp"

namespace moegraph::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// ---- Logits of a small batch ----------------------------------------------------------------------
// logits[t, e] = <x_t, W_r[e]> in fp32 for t < n: a block per expert, its threads over the hidden
// dimension in 16-byte pieces, every token at once (each piece of W_r[e] is loaded once and meets
// the same piece of each of the n rows of x); the warps' sums meet in shared memory. Each thread
// loads a few pieces, unrolled, so the kernel costs about one memory round trip: a warp per expert
// walking the whole row took longer than cuBLASLt's path (docs/PERF.md). Block 0 copies the token
// count first.

static_assert(kRouterSmallTokens <= kThreads, "a thread per token sums the warps' parts");
template <class T>
__global__ void __launch_bounds__(kThreads) router_logits_small_kernel(RouterLogitsParams p) {
  __shared__ float warp_part[kWarps][kRouterSmallTokens];
  const bool first = blockIdx.x == 0 && threadIdx.x == 0;
  const int64_t n = load_token_count(p.num_tokens, p.max_tokens, first ? p.error : nullptr);
  if (first && p.tokens_out != nullptr) *p.tokens_out = *p.num_tokens;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, e = blockIdx.x;
  const int64_t hidden = p.hidden;
  const T* w = static_cast<const T*>(p.w) + e * hidden;
  const T* x = static_cast<const T*>(p.x);
  float acc[kRouterSmallTokens];
#pragma unroll
  for (int t = 0; t < kRouterSmallTokens; ++t) acc[t] = 0.0f;
#pragma unroll 4
  for (int64_t h = 8 * threadIdx.x; h < hidden; h += 8 * kThreads) {  // 16-byte pieces
    float wv[8];
    load8(w + h, wv);
#pragma unroll
    for (int t = 0; t < kRouterSmallTokens; ++t) {
      if (t >= n) continue;
      float xv[8];
      load8(x + t * hidden + h, xv);
      float s = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) s = fmaf(wv[j], xv[j], s);
      acc[t] += s;
    }
  }
#pragma unroll
  for (int t = 0; t < kRouterSmallTokens; ++t) {
    if (t >= n) break;  // n is the same for the whole block
    const float s = warp_sum(acc[t]);
    if (lane == 0) warp_part[warp][t] = s;
  }
  __syncthreads();
  if (threadIdx.x < n) {
    float s = 0.0f;
#pragma unroll
    for (int w8 = 0; w8 < kWarps; ++w8) s += warp_part[w8][threadIdx.x];
    p.logits[threadIdx.x * p.experts + e] = s;
  }
}

// ---- Top-k ----------------------------------------------------------------------------------------

template <int kPerLane>
__global__ void __launch_bounds__(kThreads) router_topk_kernel(RouterTopkParams p) {
  const int64_t n = load_token_count(p.num_tokens, p.max_tokens,
                                     blockIdx.x == 0 && threadIdx.x == 0 ? p.error : nullptr);
  const int lane = threadIdx.x & 31;
  const int experts = p.experts, k = p.top_k;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); t < n;
       t += static_cast<int64_t>(gridDim.x) * kWarps) {
    const float* logits = p.logits + t * experts;
    float v[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = i * 32 + lane;
      v[i] = e < experts ? logits[e] : -INFINITY;
    }
    if (p.score == RouterScore::kSoftmax) {
      float m = -INFINITY;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) m = fmaxf(m, v[i]);
      m = warp_max(m);
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        v[i] = i * 32 + lane < experts ? expf(v[i] - m) : 0.0f;
        sum += v[i];
      }
      sum = warp_sum(sum);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) v[i] = v[i] / sum;
    } else {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) v[i] = 1.0f / (1.0f + expf(-v[i]));
    }
    float* scores = p.scores + t * experts;
    unsigned taken = 0;  // bit i: expert i * 32 + lane is chosen (or does not exist)
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (i * 32 + lane < experts) scores[i * 32 + lane] = v[i];
      else taken |= 1u << i;
    }
    // k rounds of warp argmax; the order (score descending, id ascending) is total once NaN
    // reads as -inf, so every lane ends each round with the same winner, and k <= E guarantees one.
    int my_id = 0;
    float my_score = 0.0f;
    for (int j = 0; j < k; ++j) {
      float best = -INFINITY;
      int best_id = INT_MAX;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const float s = isnan(v[i]) ? -INFINITY : v[i];
        if (!((taken >> i) & 1u) && (s > best || best_id == INT_MAX)) {  // ids ascend with i: ties keep the lower
          best = s;
          best_id = i * 32 + lane;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(kFullMask, best, o);
        const int other_id = __shfl_xor_sync(kFullMask, best_id, o);
        if (other > best || (other == best && other_id < best_id)) {
          best = other;
          best_id = other_id;
        }
      }
      if ((best_id & 31) == lane) taken |= 1u << (best_id >> 5);
      if (lane == j) {
        my_id = best_id;
        my_score = best;
      }
    }
    float weight = my_score;
    if (p.renormalize) weight = my_score / warp_sum(lane < k ? my_score : 0.0f);
    if (lane < k) {
      p.topk_ids[t * k + lane] = my_id;
      p.topk_weights[t * k + lane] = weight;
    }
  }
}

template <int kPerLane>
void launch_topk(const RouterTopkParams& p, cudaStream_t stream) {
  const int blocks_per_sm = resident_blocks_per_sm(router_topk_kernel<kPerLane>, kThreads);
  const int grid = grid_blocks((p.max_tokens + kWarps - 1) / kWarps, blocks_per_sm);
  router_topk_kernel<kPerLane><<<grid, kThreads, 0, stream>>>(p);
  MG_LAUNCH_CHECK();
}

// The register array's length for E experts: ceil(E / 32) rounded up to a power of two.
int per_lane_for(int experts) {
  int per_lane = 1;
  while (per_lane * 32 < experts) per_lane *= 2;
  return per_lane;
}

void check_router_shape(int64_t max_tokens, int experts, int top_k) {
  MG_CHECK(experts >= 1 && experts <= kMaxExperts, "router: experts must be in [1, ", kMaxExperts, "], got ",
           experts);
  MG_CHECK(top_k >= 1 && top_k <= kMaxTopK && top_k <= experts, "router: top_k must be in [1, min(", kMaxTopK,
           ", experts)], got ", top_k, " with ", experts, " experts");
  MG_CHECK(max_tokens >= 0, "router: max_tokens must not be negative, got ", max_tokens);
}

// ---- Auxiliary loss -------------------------------------------------------------------------------
// sum_t <scores[t], counts> over t < n, deterministic without float atomics: a grid fixed by
// max_tokens and E (never by n or the device), each block summing a fixed share of the elements
// in fp64 (the products of an fp32 score and an integer count below 2^24 are exact) in a fixed
// order into its partial; the last block to finish (an integer ticket) adds the partials in a fixed
// order (each lane a stride of blocks, then a butterfly) and resets the ticket for the next launch.
// Launches on one workspace must not overlap (one stream, or streams ordered by events). An earlier
// form, one cluster of 8 blocks of 1024 threads combined through distributed shared memory, needed
// no workspace but took 9-19 us at 1024-4096 tokens of 128 experts (docs/PERF.md).

constexpr int kAuxThreads = 256;
constexpr int kAuxMaxBlocks = 256;
constexpr int kAuxVectorsPerThread = 4;  // at most, before the grid reaches kAuxMaxBlocks
struct AuxWorkspace {
  double partials[kAuxMaxBlocks];
  unsigned ticket;  // zero between launches
};
static_assert(sizeof(AuxWorkspace) <= kRouterAuxLossWorkspaceBytes, "the documented workspace holds it");

int aux_blocks(int64_t max_tokens, int experts) {
  const int64_t per_block = int64_t{kAuxThreads} * kAuxVectorsPerThread * 4;
  const int64_t elements = max_tokens * experts;  // max_tokens < 2^31 (checked), experts <= kMaxExperts: < 2^41
  return static_cast<int>(std::clamp<int64_t>((elements + per_block - 1) / per_block, 1, kAuxMaxBlocks));
}

template <int kVec>  // 4: E % 4 == 0 and 16-byte aligned scores, read as float4
__global__ void __launch_bounds__(kAuxThreads)
    router_aux_loss_kernel(const float* __restrict__ scores, const int32_t* __restrict__ counts,
                           const int32_t* num_tokens, int64_t max_tokens, int experts, int top_k, float coef,
                           float* aux_loss, AuxWorkspace* ws) {
  __shared__ double count_of[kMaxExperts];
  __shared__ double warp_partial[kAuxThreads / 32];
  __shared__ bool last_block;
  const int64_t n = load_token_count(num_tokens, max_tokens);
  for (int e = threadIdx.x; e < experts; e += kAuxThreads) count_of[e] = counts[e];
  __syncthreads();

  const int64_t vectors = n * experts / kVec;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kAuxThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kAuxThreads;
  int col = static_cast<int>(first * kVec % experts);  // advanced incrementally: no division per element
  const int col_step = static_cast<int>(stride * kVec % experts);
  double acc = 0.0;
#pragma unroll 4
  for (int64_t i = first; i < vectors; i += stride) {
    if constexpr (kVec == 4) {
      const float4 s = reinterpret_cast<const float4*>(scores)[i];
      acc = fma(static_cast<double>(s.x), count_of[col], acc);
      acc = fma(static_cast<double>(s.y), count_of[col + 1], acc);
      acc = fma(static_cast<double>(s.z), count_of[col + 2], acc);
      acc = fma(static_cast<double>(s.w), count_of[col + 3], acc);
    } else {
      acc = fma(static_cast<double>(scores[i]), count_of[col], acc);
    }
    col += col_step;
    if (col >= experts) col -= experts;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(kFullMask, acc, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_partial[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double v = 0.0;
    for (int w = 0; w < kAuxThreads / 32; ++w) v += warp_partial[w];
    ws->partials[blockIdx.x] = v;
    __threadfence();  // the partial is visible before the ticket counts this block
    last_block = atomicAdd(&ws->ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last_block || warp != 0) return;
  __threadfence();
  double total = 0.0;
  for (unsigned b = lane; b < gridDim.x; b += 32) total += __ldcg(&ws->partials[b]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(kFullMask, total, o);
  if (lane == 0) {
    const double scale = n > 0 ? static_cast<double>(coef) * experts /
                                     (static_cast<double>(top_k) * static_cast<double>(n) * static_cast<double>(n))
                               : 0.0;
    *aux_loss = static_cast<float>(scale * total);
    ws->ticket = 0;  // every other block has counted itself: the next launch starts from zero
  }
}

// ---- Backward -------------------------------------------------------------------------------------

template <class T, int kPerLane>
__global__ void __launch_bounds__(kThreads) router_backward_kernel(RouterBackwardParams p) {
  const int64_t n = load_token_count(p.num_tokens, p.max_tokens);
  const int lane = threadIdx.x & 31;
  const int experts = p.experts, k = p.top_k;
  T* d_logits = static_cast<T*>(p.d_logits);
  // d aux / d scores[t, e] = coef * E * counts[e] / (k n^2), the same for every token.
  const double aux_scale = n > 0 && p.counts != nullptr
                               ? static_cast<double>(p.aux_coef) * experts /
                                     (static_cast<double>(k) * static_cast<double>(n) * static_cast<double>(n))
                               : 0.0;
  float aux_grad[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * 32 + lane;
    aux_grad[i] = aux_scale != 0.0 && e < experts ? static_cast<float>(aux_scale * p.counts[e]) : 0.0f;
  }
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); t < p.max_tokens;
       t += static_cast<int64_t>(gridDim.x) * kWarps) {
    T* out = d_logits + t * experts;
    if (t >= n) {  // warp-uniform
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (i * 32 + lane < experts) out[i * 32 + lane] = static_cast<T>(0.0f);
      continue;
    }
    const float* scores = p.scores + t * experts;
    float s[kPerLane], ds[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = i * 32 + lane;
      s[i] = e < experts ? scores[e] : 0.0f;
      ds[i] = aux_grad[i];
    }
    // Lane j < k holds assignment j: its expert and the gradient of its score.
    int id = -1;
    float dw = 0.0f, w = 0.0f, chosen_score = 0.0f;
    if (lane < k) {
      id = p.topk_ids[t * k + lane];
      if (id < 0 || id >= experts) id = -1;  // never read outside the row
      dw = p.d_topk_weights[t * k + lane];
      if (p.renormalize) {
        w = p.topk_weights[t * k + lane];
        chosen_score = id >= 0 ? scores[id] : 0.0f;
      }
    }
    float g = dw;
    if (p.renormalize) g = (dw - warp_sum(dw * w)) / warp_sum(chosen_score);
    for (int j = 0; j < k; ++j) {
      const int id_j = __shfl_sync(kFullMask, id, j);
      const float g_j = __shfl_sync(kFullMask, g, j);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (i * 32 + lane == id_j) ds[i] += g_j;
    }
    if (p.score == RouterScore::kSoftmax) {
      float dot = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) dot += s[i] * ds[i];
      dot = warp_sum(dot);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (i * 32 + lane < experts) out[i * 32 + lane] = static_cast<T>(s[i] * (ds[i] - dot));
    } else {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (i * 32 + lane < experts) out[i * 32 + lane] = static_cast<T>(ds[i] * s[i] * (1.0f - s[i]));
    }
  }
}

template <class T, int kPerLane>
void launch_backward(const RouterBackwardParams& p, cudaStream_t stream) {
  const int blocks_per_sm = resident_blocks_per_sm(router_backward_kernel<T, kPerLane>, kThreads);
  const int grid = grid_blocks((p.max_tokens + kWarps - 1) / kWarps, blocks_per_sm);
  router_backward_kernel<T, kPerLane><<<grid, kThreads, 0, stream>>>(p);
  MG_LAUNCH_CHECK();
}

template <class T>
void launch_backward_typed(const RouterBackwardParams& p, cudaStream_t stream) {
  switch (per_lane_for(p.experts)) {
    case 1: return launch_backward<T, 1>(p, stream);
    case 2: return launch_backward<T, 2>(p, stream);
    case 4: return launch_backward<T, 4>(p, stream);
    case 8: return launch_backward<T, 8>(p, stream);
    case 16: return launch_backward<T, 16>(p, stream);
    default: return launch_backward<T, 32>(p, stream);
  }
}

}  // namespace

void launch_router_topk(const RouterTopkParams& p, cudaStream_t stream) {
  check_router_shape(p.max_tokens, p.experts, p.top_k);
  MG_CHECK(p.logits != nullptr && p.num_tokens != nullptr && p.scores != nullptr && p.topk_ids != nullptr &&
               p.topk_weights != nullptr,
           "router_topk: logits, num_tokens, scores, topk_ids and topk_weights are required");
  switch (per_lane_for(p.experts)) {
    case 1: return launch_topk<1>(p, stream);
    case 2: return launch_topk<2>(p, stream);
    case 4: return launch_topk<4>(p, stream);
    case 8: return launch_topk<8>(p, stream);
    case 16: return launch_topk<16>(p, stream);
    default: return launch_topk<32>(p, stream);
  }
}

void launch_router_logits_small(const RouterLogitsParams& p, cudaStream_t stream) {
  check_router_shape(p.max_tokens, p.experts, 1);
  MG_CHECK(p.max_tokens <= kRouterSmallTokens, "router_logits_small: at most ", kRouterSmallTokens,
           " tokens, got max_tokens ", p.max_tokens);
  MG_CHECK(p.hidden > 0 && p.hidden % 8 == 0, "router_logits_small: hidden must be a positive multiple of 8, got ",
           p.hidden);
  MG_CHECK(p.x != nullptr && p.w != nullptr && p.num_tokens != nullptr && p.logits != nullptr,
           "router_logits_small: x, w, num_tokens and logits are required");
  MG_CHECK(aligned16(p.x) && aligned16(p.w),
           "router_logits_small: x and w must be 16-byte aligned");
  with_16bit_type(p.dtype, "router_logits_small", [&](auto t) {
    router_logits_small_kernel<decltype(t)><<<p.experts, kThreads, 0, stream>>>(p);
  });
  MG_LAUNCH_CHECK();
}

void launch_router_aux_loss(const float* scores, const int32_t* counts, const int32_t* num_tokens,
                            int64_t max_tokens, int experts, int top_k, float coef, float* aux_loss, void* workspace,
                            cudaStream_t stream) {
  check_router_shape(max_tokens, experts, top_k);
  MG_CHECK(scores != nullptr && counts != nullptr && num_tokens != nullptr && aux_loss != nullptr &&
               workspace != nullptr,
           "router_aux_loss: scores, counts, num_tokens, aux_loss and workspace are required");
  MG_CHECK(max_tokens < (int64_t{1} << 31), "router_aux_loss: max_tokens must be below 2^31, got ", max_tokens);
  MG_CHECK(reinterpret_cast<std::uintptr_t>(workspace) % alignof(AuxWorkspace) == 0,
           "router_aux_loss: the workspace must be ", alignof(AuxWorkspace), "-byte aligned");
  auto* ws = static_cast<AuxWorkspace*>(workspace);
  const int grid = aux_blocks(max_tokens, experts);
  if (experts % 4 == 0 && aligned16(scores))
    router_aux_loss_kernel<4><<<grid, kAuxThreads, 0, stream>>>(scores, counts, num_tokens, max_tokens, experts, top_k,
                                                                coef, aux_loss, ws);
  else
    router_aux_loss_kernel<1><<<grid, kAuxThreads, 0, stream>>>(scores, counts, num_tokens, max_tokens, experts, top_k,
                                                                coef, aux_loss, ws);
  MG_LAUNCH_CHECK();
}

void launch_router_backward(const RouterBackwardParams& p, cudaStream_t stream) {
  check_router_shape(p.max_tokens, p.experts, p.top_k);
  MG_CHECK(p.scores != nullptr && p.topk_ids != nullptr && p.d_topk_weights != nullptr && p.num_tokens != nullptr &&
               p.d_logits != nullptr,
           "router_backward: scores, topk_ids, d_topk_weights, num_tokens and d_logits are required");
  MG_CHECK(!p.renormalize || p.topk_weights != nullptr, "router_backward: renormalize needs topk_weights");
  MG_CHECK(p.aux_coef == 0.0f || p.counts != nullptr, "router_backward: an aux loss needs counts");
  switch (p.dtype) {
    case DType::kBF16: return launch_backward_typed<__nv_bfloat16>(p, stream);
    case DType::kFP16: return launch_backward_typed<__half>(p, stream);
    case DType::kFP32: return launch_backward_typed<float>(p, stream);
  }
  MG_FAIL("router_backward: unsupported dtype");
}

}  // namespace moegraph::kernels
