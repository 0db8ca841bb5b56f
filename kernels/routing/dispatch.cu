// The dispatch plan (a stable counting sort of the (token, j) assignments by expert) and the row
// permutation it drives.
//
// The assignments a = t * k + j, t < n, are cut into chunks of `chunk` consecutive assignments
// (a host-side function of max_tokens and k, so grids never depend on device data):
//   1. count:  per chunk, per expert assignment counts -> workspace [E, chunks];
//   2. scan:   one block: each expert's exclusive scan over the chunks (in place, a warp per
//              expert), its total, the capacity cut, the aligned offsets (exactly as
//              launch_group_offsets), drops;
//   3. place:  per chunk, each warp recounts its slice, the block turns the counts into per-warp
//              rank bases, and each warp walks its slice again in order, 32 assignments at a time,
//              ranking equal experts with __match_any_sync. Rank < kept rows -> row offsets[e] + rank.
// A small batch (at most kSmallAssignments, by capacity) runs the three in one block instead.
// No float atomics and no order-dependent integer atomics: every output is bit-reproducible.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/common/alignment.hpp"
#include "kernels/common/ragged_tiles.cuh"
#include "kernels/common/row_lanes.cuh"
#include "kernels/common/warp_scan.cuh"
#include "kernels/routing/moe_routing.hpp"
#include "kernels/routing/routing_common.cuh"
#include "moegraph/error.hpp"

namespace moegraph::kernels {
namespace {

constexpr int kThreads = 256;  // count and place kernels
constexpr int kWarps = kThreads / 32;
constexpr int kScanThreads = 1024;  // one thread per expert
constexpr int kScanWarps = kScanThreads / 32;
constexpr int64_t kMaxChunks = 256;
constexpr int64_t kMaxScanCells = 65536;  // chunks x experts the single-block scan reads
// Up to this capacity one block does it all (at most 4 steps per warp and pass). Measured on an H200
// at decode sizes: the sort went from 17.2 to 12.5 us at 6 assignments and from 16.9 to 15.4 at 768,
// but from 15.7 to 20.0 us at 1536, where the three kernels' wider grid wins.
constexpr int64_t kSmallAssignments = 1024;
constexpr unsigned kFullMask = 0xffffffffu;
static_assert(kScanThreads >= kMaxExperts);

// How the assignments are cut, from the capacity alone (grids never depend on device data).
struct Chunks {
  int64_t size = kThreads;  // assignments per chunk: a multiple of kThreads (whole 32-wide warp steps)
  int64_t count = 0;        // chunks of max_tokens * k: the workspace's row length
};

// As small as the bounds allow: each kernel is a few dependent memory round trips per 32-wide
// step, so a small batch should spread over many blocks, one step per warp. With 2048-wide chunks
// (the old minimum) 8192 assignments made every warp walk 8 steps in turn, and the three kernels
// took about 30 us on an H200. The bounds keep the workspace and the one-block scan small.
Chunks chunks_of(int64_t max_tokens, int top_k, int experts) {
  const int64_t assignments = max_tokens * top_k;
  const int64_t most = std::max<int64_t>(1, std::min(kMaxChunks, kMaxScanCells / std::max(experts, 1)));
  const int64_t per_chunk = (assignments + most - 1) / most;
  Chunks c;
  c.size = std::max<int64_t>(kThreads, (per_chunk + kThreads - 1) / kThreads * kThreads);
  c.count = (assignments + c.size - 1) / c.size;
  return c;
}

// The expert of assignment a, or -1 past the slice end or for an id outside [0, E).
__device__ __forceinline__ int expert_key(const int32_t* ids, int64_t a, int64_t end, int experts) {
  if (a >= end) return -1;
  const int e = ids[a];
  return e >= 0 && e < experts ? e : -1;
}

// ---- pieces shared by the kernels ------------------------------------------------------------------
// One warp's slice [begin, end): how many assignments go to each expert, into `row` (zeroed first).
__device__ __forceinline__ void count_slice(const DispatchParams& p, int64_t begin, int64_t end, int* row) {
  const int lane = threadIdx.x & 31;
  for (int e = lane; e < p.experts; e += 32) row[e] = 0;
  __syncwarp();
  for (int64_t base = begin; base < end; base += 32) {  // warp-uniform; each warp owns its row
    const int key = expert_key(p.topk_ids, base + lane, end, p.experts);
    const unsigned peers = __match_any_sync(kFullMask, key);
    if (key >= 0 && __ffs(peers) - 1 == lane) row[key] += __popc(peers);
    __syncwarp();
  }
}

// Expert e's per-warp counts turned into each warp's first rank, starting from `run` (the
// assignments to e before this block's slices); returns the rank after the last warp's.
__device__ __forceinline__ int warp_bases(int (*rank_base)[kMaxExperts], int e, int run) {
  for (int w = 0; w < kWarps; ++w) {
    const int v = rank_base[w][e];
    rank_base[w][e] = run;
    run += v;
  }
  return run;
}

// From each expert's total (shared), on a block of Threads: counts, splits after the capacity cut,
// the aligned offsets (exactly as launch_group_offsets), the past-capacity error and the drops.
template <int Threads>
__device__ void finish_layout(const DispatchParams& p, int64_t n, const int* expert_total) {
  constexpr int kItems = (kMaxExperts + Threads - 1) / Threads;  // experts per thread, blocked
  using Scan = cub::BlockScan<int64_t, Threads, cub::BLOCK_SCAN_WARP_SCANS>;  // raking spills at 1024 threads
  using Reduce = cub::BlockReduce<int64_t, Threads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ typename Reduce::TempStorage reduce_storage;
  __shared__ int first_past_capacity;
  const int tid = threadIdx.x, experts = p.experts;
  // C = ceil(capacity_factor * n * k / E) in double; 0 means dropless.
  int64_t keep = INT64_MAX;
  if (p.capacity_factor > 0.0) {
    const double c = ceil(p.capacity_factor * static_cast<double>(n) * p.top_k / p.experts);
    keep = c < 9.0e18 ? static_cast<int64_t>(c) : INT64_MAX;
  }
  int64_t span[kItems], end[kItems], lost[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int e = tid * kItems + i;
    span[i] = lost[i] = 0;
    if (e < experts) {
      const int64_t count = expert_total[e], split = std::min(count, keep);
      span[i] = (split + p.row_align - 1) / p.row_align * p.row_align;
      lost[i] = count - split;
      p.counts[e] = static_cast<int32_t>(count);
      p.splits[e] = static_cast<int32_t>(split);
    }
  }
  if (tid == 0) {
    first_past_capacity = experts;
    p.offsets[0] = 0;
  }
  int64_t total;
  Scan(scan_storage).InclusiveSum(span, end, total);
  __syncthreads();  // first_past_capacity is initialized
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int e = tid * kItems + i;
    if (e < experts) {
      if (end[i] > p.capacity_rows) atomicMin(&first_past_capacity, e);
      p.offsets[e + 1] = std::min(end[i], p.capacity_rows);
    }
  }
  const int64_t dropped = Reduce(reduce_storage).Sum(lost);
  __syncthreads();  // first_past_capacity is final
  if (tid == 0) {
    if (total > p.capacity_rows && p.error != nullptr)
      raise_device_error(p.error, kDeviceErrorPastCapacity, first_past_capacity, total, p.capacity_rows);
    if (p.dropped != nullptr && dropped > 0) atomicAdd(p.dropped, static_cast<unsigned long long>(dropped));
  }
}

// Each expert's first row and kept rows (the split, clamped into its span), from the layout in
// global memory. The caller synchronizes the block after.
__device__ __forceinline__ void load_row_bounds(const DispatchParams& p, int* row_start, int* row_limit) {
  for (int e = threadIdx.x; e < p.experts; e += blockDim.x) {
    const int64_t start = p.offsets[e], span = p.offsets[e + 1] - start;
    const int64_t split = p.splits[e];
    row_start[e] = static_cast<int>(start);  // capacity_rows < 2^31
    row_limit[e] = static_cast<int>(split < 0 ? 0 : std::min(split, span));
  }
  if (threadIdx.x == 0) row_start[p.experts] = static_cast<int>(p.offsets[p.experts]);
}

// One warp's slice again, in order, 32 assignments at a time: each assignment's rank among its
// expert's (equal experts ranked with __match_any_sync) -> its row, or -1 when dropped.
__device__ __forceinline__ void place_slice(const DispatchParams& p, int64_t begin, int64_t end, int* row,
                                            const int* row_start, const int* row_limit) {
  const int lane = threadIdx.x & 31;
  const unsigned lower_lanes = (1u << lane) - 1;
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t a = base + lane;
    const int key = expert_key(p.topk_ids, a, end, p.experts);
    const unsigned peers = __match_any_sync(kFullMask, key);
    const int rank = key >= 0 ? row[key] + __popc(peers & lower_lanes) : 0;
    __syncwarp();  // every lane has read its base before the leader advances it
    if (key >= 0 && __ffs(peers) - 1 == lane) row[key] += __popc(peers);
    __syncwarp();
    if (a < end) {
      const int r = key >= 0 && rank < row_limit[key] ? row_start[key] + rank : -1;
      p.row_of[a] = r;
      if (r >= 0) {
        p.token_of_row[r] = static_cast<int32_t>(a / p.top_k);
        if (p.row_weight != nullptr) p.row_weight[r] = p.topk_weights != nullptr ? p.topk_weights[a] : 1.0f;
      }
    }
  }
}

// Assignments of tokens t >= n, and the alignment gap rows after each expert's kept rows, spread
// over the grid.
__device__ __forceinline__ void clear_tails(const DispatchParams& p, int64_t used, const int* row_start,
                                            const int* row_limit) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t a = used + first; a < p.max_tokens * p.top_k; a += stride) p.row_of[a] = -1;
  for (int e = blockIdx.x; e < p.experts; e += gridDim.x) {
    for (int r = row_start[e] + row_limit[e] + threadIdx.x; r < row_start[e + 1]; r += blockDim.x) {
      p.token_of_row[r] = -1;
      if (p.row_weight != nullptr) p.row_weight[r] = 0.0f;
    }
  }
}

// ---- a small batch: one block ----------------------------------------------------------------------
// Up to kSmallAssignments, the three steps below in one block: each warp counts its slice, the
// block ranks the warps and lays out the experts, each warp places its slice. The three kernel
// nodes, a few dependent round trips each, cost about 16 us at decode sizes on an H200.
__global__ void __launch_bounds__(kThreads) dispatch_small_kernel(DispatchParams p, int64_t slice) {
  __shared__ int rank_base[kWarps][kMaxExperts];
  __shared__ int expert_total[kMaxExperts];
  __shared__ int row_start[kMaxExperts + 1];
  __shared__ int row_limit[kMaxExperts];
  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t n = load_token_count(p.num_tokens, p.max_tokens, tid == 0 ? p.error : nullptr);
  const int64_t used = n * p.top_k;
  const int64_t begin = warp * slice, end = std::min(begin + slice, used);
  count_slice(p, begin, end, rank_base[warp]);
  __syncthreads();
  for (int e = tid; e < p.experts; e += kThreads) expert_total[e] = warp_bases(rank_base, e, 0);
  __syncthreads();
  finish_layout<kThreads>(p, n, expert_total);
  __syncthreads();  // the layout's global stores are visible to the block
  load_row_bounds(p, row_start, row_limit);
  __syncthreads();
  place_slice(p, begin, end, rank_base[warp], row_start, row_limit);
  clear_tails(p, used, row_start, row_limit);
}

// ---- 1. counts per chunk ---------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads) dispatch_count_kernel(DispatchParams p, Chunks chunks) {
  const int64_t chunk = chunks.size;
  __shared__ int hist[kMaxExperts];
  const int64_t used = load_token_count(p.num_tokens, p.max_tokens) * p.top_k;
  const int64_t chunks_used = (used + chunk - 1) / chunk;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t c = blockIdx.x; c < chunks_used; c += gridDim.x) {
    for (int e = threadIdx.x; e < p.experts; e += kThreads) hist[e] = 0;
    __syncthreads();
    const int64_t end = std::min(c * chunk + chunk, used);
    for (int64_t base = c * chunk + warp * 32; base < end; base += kThreads) {  // warp-uniform
      const int key = expert_key(p.topk_ids, base + lane, end, p.experts);
      const unsigned peers = __match_any_sync(kFullMask, key);
      if (key >= 0 && __ffs(peers) - 1 == lane) atomicAdd(&hist[key], __popc(peers));  // sums: order-free
    }
    __syncthreads();
    for (int e = threadIdx.x; e < p.experts; e += kThreads) p.workspace[e * chunks.count + c] = hist[e];
    __syncthreads();
  }
}

// ---- 2. the plan (one block) -----------------------------------------------------------------------
__global__ void __launch_bounds__(kScanThreads) dispatch_scan_kernel(DispatchParams p, Chunks chunks) {
  __shared__ int expert_total[kMaxExperts];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int experts = p.experts;
  const int64_t n = load_token_count(p.num_tokens, p.max_tokens, threadIdx.x == 0 ? p.error : nullptr);
  const int64_t used = n * p.top_k;
  const int64_t chunks_used = (used + chunks.size - 1) / chunks.size;

  // A warp per expert walks its row of chunk counts 32 at a time (coalesced), rewriting them as
  // exclusive bases in the same pass; no block-wide step until every total is in.
  for (int e = warp; e < experts; e += kScanWarps) {
    int* row = p.workspace + e * chunks.count;
    int carry = 0;
    for (int64_t c0 = 0; c0 < chunks_used; c0 += 32) {
      const int64_t c = c0 + lane;
      const int v = c < chunks_used ? row[c] : 0;
      const int inclusive = warp_inclusive_sum(v);
      if (c < chunks_used) row[c] = carry + inclusive - v;
      carry += __shfl_sync(kFullMask, inclusive, 31);
    }
    if (lane == 0) expert_total[e] = carry;
  }
  __syncthreads();
  finish_layout<kScanThreads>(p, n, expert_total);
}

// ---- 3. rows --------------------------------------------------------------------------------------
__global__ void __launch_bounds__(kThreads) dispatch_place_kernel(DispatchParams p, Chunks chunks) {
  const int64_t chunk = chunks.size;
  __shared__ int rank_base[kWarps][kMaxExperts];  // per warp: the next rank of each expert
  __shared__ int row_start[kMaxExperts + 1];
  __shared__ int row_limit[kMaxExperts];
  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t used = load_token_count(p.num_tokens, p.max_tokens) * p.top_k;
  const int64_t chunks_used = (used + chunk - 1) / chunk;
  load_row_bounds(p, row_start, row_limit);
  __syncthreads();

  const int64_t slice = chunk / kWarps;
  for (int64_t c = blockIdx.x; c < chunks_used; c += gridDim.x) {
    const int64_t begin = c * chunk + warp * slice, end = std::min(begin + slice, used);
    count_slice(p, begin, end, rank_base[warp]);
    __syncthreads();
    // the assignments to e in earlier chunks, then this chunk's warps in order
    for (int e = tid; e < p.experts; e += kThreads) warp_bases(rank_base, e, p.workspace[e * chunks.count + c]);
    __syncthreads();
    place_slice(p, begin, end, rank_base[warp], row_start, row_limit);
    __syncthreads();  // rank_base is reused by the next chunk
  }
  clear_tails(p, used, row_start, row_limit);
}

// ---- Permute --------------------------------------------------------------------------------------
constexpr int kCopyThreads = 256;
constexpr int kCopyMinBlocksPerSm = 4;  // <= 64 registers: 1024 threads x 4 vectors = 64 KB in flight per SM
constexpr int kUnroll = 4;  // 16-byte vectors in flight per lane

__global__ void __launch_bounds__(kCopyThreads, kCopyMinBlocksPerSm)
    permute_rows_kernel(const uint4* __restrict__ x, const int32_t* __restrict__ token_of_row, const int32_t* splits,
                        const int64_t* offsets, int experts, int64_t vectors, int lanes, uint4* __restrict__ permuted) {
  for_each_row(offsets[experts], lanes, [&](int64_t r, int lane, bool active) {
    if (!active) return;
    const int e = expert_of_row(offsets, experts, r);
    const int64_t local = r - offsets[e];
    const int64_t token = local < group_rows(splits, offsets, e) ? token_of_row[r] : -1;
    uint4* dst = permuted + r * vectors;
    if (token < 0) {
      for (int64_t v = lane; v < vectors; v += lanes) dst[v] = make_uint4(0, 0, 0, 0);
      return;
    }
    const uint4* src = x + token * vectors;
    for (int64_t v0 = lane; v0 < vectors; v0 += kUnroll * lanes) {
      uint4 buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v0 + u * lanes < vectors) buf[u] = src[v0 + u * lanes];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v0 + u * lanes < vectors) dst[v0 + u * lanes] = buf[u];
    }
  });
}

}  // namespace

std::size_t dispatch_workspace_bytes(int64_t max_tokens, int experts, int top_k) {
  if (max_tokens * top_k <= kSmallAssignments) return 0;  // the one-block kernel keeps its counts in shared memory
  return static_cast<std::size_t>(chunks_of(max_tokens, top_k, experts).count) * experts * sizeof(int32_t);
}

void launch_dispatch(const DispatchParams& p, cudaStream_t stream) {
  MG_CHECK(p.experts >= 1 && p.experts <= kMaxExperts, "dispatch: experts must be in [1, ", kMaxExperts, "], got ",
           p.experts);
  MG_CHECK(p.top_k >= 1 && p.top_k <= kMaxTopK && p.top_k <= p.experts, "dispatch: top_k must be in [1, min(",
           kMaxTopK, ", experts)], got ", p.top_k);
  MG_CHECK(p.max_tokens >= 0 && p.max_tokens * p.top_k < (int64_t{1} << 31),
           "dispatch: max_tokens * top_k must be in [0, 2^31), got ", p.max_tokens, " * ", p.top_k);
  MG_CHECK(p.capacity_rows >= 0 && p.capacity_rows < (int64_t{1} << 31),
           "dispatch: capacity_rows must be in [0, 2^31), got ", p.capacity_rows);
  MG_CHECK(p.row_align >= 1, "dispatch: row_align must be positive, got ", p.row_align);
  MG_CHECK(p.capacity_factor >= 0.0 && std::isfinite(p.capacity_factor),
           "dispatch: capacity_factor must be finite and >= 0, got ", p.capacity_factor);
  MG_CHECK(p.topk_ids != nullptr && p.num_tokens != nullptr && p.counts != nullptr && p.splits != nullptr &&
               p.offsets != nullptr && p.row_of != nullptr && p.token_of_row != nullptr,
           "dispatch: topk_ids, num_tokens, counts, splits, offsets, row_of and token_of_row are required");
  MG_CHECK(p.workspace != nullptr || dispatch_workspace_bytes(p.max_tokens, p.experts, p.top_k) == 0,
           "dispatch: workspace is required");
  const int64_t assignments = p.max_tokens * p.top_k;
  if (assignments <= kSmallAssignments) {
    const int64_t chunk = std::max<int64_t>(kThreads, (assignments + kThreads - 1) / kThreads * kThreads);
    dispatch_small_kernel<<<1, kThreads, 0, stream>>>(p, chunk / kWarps);
    MG_LAUNCH_CHECK();
    return;
  }
  const Chunks chunks = chunks_of(p.max_tokens, p.top_k, p.experts);
  const int grid = static_cast<int>(std::max<int64_t>(1, chunks.count));
  dispatch_count_kernel<<<grid, kThreads, 0, stream>>>(p, chunks);
  MG_LAUNCH_CHECK();
  dispatch_scan_kernel<<<1, kScanThreads, 0, stream>>>(p, chunks);
  MG_LAUNCH_CHECK();
  dispatch_place_kernel<<<grid, kThreads, 0, stream>>>(p, chunks);
  MG_LAUNCH_CHECK();
}

void launch_permute_rows(DType dtype, const void* x, const int32_t* token_of_row, const int32_t* splits,
                         const int64_t* offsets, int experts, int64_t hidden, void* permuted, cudaStream_t stream) {
  MG_CHECK(dtype == DType::kBF16 || dtype == DType::kFP16, "permute_rows: dtype must be bf16 or fp16");
  MG_CHECK(hidden > 0 && hidden % 16 == 0, "permute_rows: hidden must be a positive multiple of 16, got ", hidden);
  MG_CHECK(experts >= 1 && experts <= kMaxExperts, "permute_rows: experts must be in [1, ", kMaxExperts, "]");
  MG_CHECK(aligned16(x) && aligned16(permuted),
           "permute_rows: x and permuted must be 16-byte aligned");
  const int64_t vectors = hidden * static_cast<int64_t>(dtype_size(dtype)) / 16;
  const int blocks_per_sm = resident_blocks_per_sm(permute_rows_kernel, kCopyThreads);
  const int grid = grid_blocks(INT64_MAX, blocks_per_sm);  // the rows are known on the device only
  permute_rows_kernel<<<grid, kCopyThreads, 0, stream>>>(static_cast<const uint4*>(x), token_of_row, splits,
                                                         offsets, experts, vectors, lanes_per_row(vectors),
                                                         static_cast<uint4*>(permuted));
  MG_LAUNCH_CHECK();
}

}  // namespace moegraph::kernels
