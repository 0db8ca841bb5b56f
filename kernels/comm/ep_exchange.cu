// Expert-parallel exchange kernels: counts to every rank, a device barrier over peer flags, the
// receive plan every rank computes identically from the count matrix, and the row stores.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>

#include "kernels/comm/ep_exchange.hpp"
#include "kernels/common/alignment.hpp"
#include "kernels/common/row_lanes.cuh"
#include "kernels/common/warp_scan.cuh"
#include "kernels/routing/routing_common.cuh"
#include "moegraph/error.hpp"

namespace moegraph::kernels {
namespace {

constexpr int kPlanThreads = 1024;  // one thread per expert (E <= 1024)
static_assert(kPlanThreads >= kMaxExperts);
constexpr int kExchangeThreads = 256;

__device__ __forceinline__ void store_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// The epoch in the link word's low 31 bits, and whether `flag` has reached `epoch` there (wrap-safe:
// flags only grow, and every rank runs the same barrier sequence).
constexpr uint32_t kEpochMask = ~kEpLinkStopped;
__device__ __forceinline__ bool epoch_reached(uint32_t flag, uint32_t epoch) {
  return static_cast<int32_t>((flag - epoch) << 1) >= 0;
}
// Whether the link (null: none) has stopped, read by thread 0 for the whole block; a barrier
// earlier in the stream set it. Every thread of the block must call it.
__device__ __forceinline__ bool block_link_stopped(const uint32_t* link) {
  __shared__ int stopped;
  if (threadIdx.x == 0)
    stopped = link != nullptr && (*reinterpret_cast<const volatile uint32_t*>(link) & kEpLinkStopped) != 0;
  __syncthreads();
  return stopped != 0;
}
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---- counts -------------------------------------------------------------------------------------
__global__ void ep_share_counts_kernel(const int32_t* counts, const int32_t* num_tokens, int experts, int rank,
                                       int ranks, PeerBases matrix, const uint32_t* link) {
  const bool stopped = block_link_stopped(link);
  const int64_t row = static_cast<int64_t>(rank) * (experts + 1);
  for (int i = threadIdx.x; i <= experts; i += blockDim.x) {
    const int32_t v = i < experts ? counts[i] : *num_tokens;
    for (int d = 0; d < ranks; ++d)
      if (!stopped || d == rank) reinterpret_cast<int32_t*>(matrix.base[d])[row + i] = v;
  }
  __threadfence_system();  // the barrier that follows publishes these stores
}

// ---- barrier ------------------------------------------------------------------------------------
// Thread d signals rank d (flag[rank] = epoch, and the stopped bit, in d's window) and waits for d's
// signal in its own.
__global__ void ep_barrier_kernel(EpBarrierParams p) {
  __shared__ uint32_t flag;
  if (threadIdx.x == 0) {
    const uint32_t word = *p.epoch;
    const uint32_t epoch = (word + 1) & kEpochMask;
    flag = epoch | (word & kEpLinkStopped);
    *p.epoch = flag;
    if (flag & kEpLinkStopped) raise_device_error(p.error, kDeviceErrorExchangeStopped, p.rank, epoch, 0);
  }
  __syncthreads();
  const int d = threadIdx.x;
  if (d >= p.ranks) return;
  __threadfence_system();  // this rank's earlier stores (previous kernels in the stream) first
  store_release_sys(reinterpret_cast<uint32_t*>(p.flags.base[d]) + p.rank, flag);
  if (flag & kEpLinkStopped) return;
  const uint32_t epoch = flag;
  const uint32_t* mine = reinterpret_cast<const uint32_t*>(p.flags.base[p.rank]) + d;
  const uint64_t start = global_ns();
  for (;;) {
    const uint32_t seen = load_acquire_sys(mine);
    // A stopped peer may have skipped its stores to this rank: nothing after this barrier is sound.
    if (seen & kEpLinkStopped) {
      raise_device_error(p.error, kDeviceErrorPeerStopped, d, epoch, 0);
      break;
    }
    if (epoch_reached(seen, epoch)) return;
    if (global_ns() - start > static_cast<uint64_t>(p.timeout_ns)) {
      raise_device_error(p.error, kDeviceErrorPeerTimeout, d, epoch, p.timeout_ns / 1000000);
      break;
    }
    __nanosleep(100);
  }
  atomicOr(p.epoch, kEpLinkStopped);  // published to the peers by this link's next barrier
}

// ---- plan ---------------------------------------------------------------------------------------
// The plan runs once per dispatch on one block, ahead of every row: it is latency, not work. Each
// step therefore spreads its entries over the block (a warp per source row, a thread per expert)
// instead of walking them on one thread per rank, which at 128 experts cost tens of microseconds
// of dependent global loads. The greedy walk stays for an owner whose bound binds (it is the
// definition of which rows are kept); unbounded, the same layout is a prefix sum.
__global__ void __launch_bounds__(kPlanThreads) ep_plan_kernel(EpPlanParams p) {
  using Scan = cub::BlockScan<int64_t, kPlanThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int64_t group_start[kMaxExperts + 1];  // aligned starts, all owners in one sequence
  __shared__ int greedy[kMaxExpertParallel];         // owners whose bound binds
  const int R = p.ranks, E = p.experts, L = E / R;
  const int64_t stride = p.matrix_stride > 0 ? p.matrix_stride : E + 1;
  // scratch [R][E] each: the rows (source, expert) asks for, their local row base on the source,
  // their receive row on the owner, and how many the owner keeps.
  int32_t* want = p.scratch;
  int32_t* local_base = want + static_cast<int64_t>(R) * E;
  int32_t* recv_row = local_base + static_cast<int64_t>(R) * E;
  int32_t* kept = recv_row + static_cast<int64_t>(R) * E;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t chunk = p.chunk_rows > 0 ? p.chunk_rows : p.local_rows;

  // Each source's token count (its counts were computed on the clamped count) and its local rows.
  // Counts are clamped so that no source's rows pass local_rows whatever the matrix holds (after a
  // barrier timeout it may hold anything): every rank clamps identically. Walking e in order,
  // want = min(count, local_rows - base) with base the rows before; that is, with P(e) the sum of
  // the non-negative counts below e, base(e) = min(P(e), local_rows): a prefix sum per source.
  if (t < R) {
    const int32_t n = p.matrix[t * stride + E];
    if ((n < 0 || n > p.max_tokens) && t != p.rank)
      raise_device_error(p.error, kDeviceErrorPeerTokenCount, t, n, p.max_tokens);
    greedy[t] = 0;
  }
  const int per_lane = (E + 31) / 32;
  for (int s = warp; s < R; s += kPlanThreads / 32) {
    const int32_t* row = p.matrix + s * stride;
    const int first = lane * per_lane, last = std::min(first + per_lane, E);
    // Each count is read once (parked in `want`): after a barrier timeout a late peer's store could
    // land between two reads, and the lanes' ranges would no longer tile the source's rows.
    int64_t sum = 0;
    for (int e = first; e < last; ++e) {
      const int32_t count = std::max(row[e], 0);
      want[s * E + e] = count;
      sum += count;
    }
    int64_t before = warp_exclusive_sum(sum);
    for (int e = first; e < last; ++e) {
      const int64_t after = before + want[s * E + e];
      const int64_t base = std::min(before, p.local_rows);
      want[s * E + e] = static_cast<int32_t>(std::min(after, p.local_rows) - base);
      local_base[s * E + e] = static_cast<int32_t>(base);
      before = after;
    }
  }
  __syncthreads();

  // Each owner's receive layout: local expert by local expert (aligned starts), source by source in
  // rank order. Unbounded, expert e's group holds every row asked for it, so its start is the sum
  // of the aligned groups below it on its owner: one scan over all experts, read relative to the
  // owner's first expert.
  int64_t group = 0;
  if (t < E)
    for (int s = 0; s < R; ++s) group += want[s * E + t];
  const int64_t aligned = (group + p.row_align - 1) / p.row_align * p.row_align;
  int64_t start_all, end_all;
  Scan(scan_storage).ExclusiveSum(aligned, start_all, end_all);
  if (t < E) group_start[t] = start_all;
  if (t == 0) group_start[E] = end_all;
  __syncthreads();
  // A bound binds when the owner's aligned end passes recv_rows (recv_rows is a multiple of
  // row_align, so this is when its last row would), or a source sends the owner more than a chunk.
  if (t < R && group_start[(t + 1) * L] - group_start[t * L] > p.recv_rows) greedy[t] = 1;
  for (int i = t; i < R * R; i += kPlanThreads) {
    const int s = i / R, d = i % R, last = (d + 1) * L - 1;
    const int64_t sent = local_base[s * E + last] + want[s * E + last] - local_base[s * E + d * L];
    if (sent > chunk) greedy[d] = 1;  // benign race: every writer stores 1
  }
  __syncthreads();
  if (t < E && !greedy[t / L]) {
    const int d = t / L, l = t % L;
    const int64_t start = group_start[t] - group_start[d * L];
    int64_t off = start;
    for (int s = 0; s < R; ++s) {
      const int32_t w = want[s * E + t];
      recv_row[s * E + t] = static_cast<int32_t>(off);
      kept[s * E + t] = w;
      off += w;
    }
    if (d == p.rank) {
      p.splits[l] = static_cast<int32_t>(group);
      p.offsets[l] = start;
      if (l == L - 1) p.offsets[L] = group_start[(d + 1) * L] - group_start[d * L];
    }
  }
  // The greedy walk within the bounds (every start is a multiple of row_align, so an aligned end
  // never passes recv_rows; chunk_rows caps what each source sends this owner over its experts).
  if (t < R && greedy[t]) {
    const int d = t;
    int64_t sent[kMaxExpertParallel] = {};  // rows of each source kept so far
    int64_t off = 0;
    for (int l = 0; l < L; ++l) {
      const int e = d * L + l;
      const int64_t start = off;
      for (int s = 0; s < R; ++s) {
        const int64_t take = std::min<int64_t>(std::min<int64_t>(want[s * E + e], p.recv_rows - off), chunk - sent[s]);
        sent[s] += take;
        recv_row[s * E + e] = static_cast<int32_t>(off);
        kept[s * E + e] = static_cast<int32_t>(take);
        off += take;
      }
      if (d == p.rank) {
        p.splits[l] = static_cast<int32_t>(off - start);
        p.offsets[l] = start;
      }
      off = (off + p.row_align - 1) / p.row_align * p.row_align;
    }
    if (d == p.rank) p.offsets[L] = off;
  }
  __syncthreads();

  // Segment tables (thread per entry) and their row prefixes.
  int64_t owner_rows = 0, source_rows = 0;
  unsigned long long lost = 0;
  if (t < E) {
    const int e = t, idx = p.rank * E + e;
    EpSegment o;
    o.src_row = local_base[idx];
    o.dst_row = recv_row[idx];
    o.rows = kept[idx];
    o.peer = e / L;
    p.to_owner[e] = o;
    owner_rows = o.rows;
    const int64_t asked = want[idx];
    p.dropped_rows[2 * e] = o.src_row + o.rows;
    p.dropped_rows[2 * e + 1] = o.src_row + asked;
    lost = static_cast<unsigned long long>(asked - o.rows);

    const int s = e / L, l = e % L, owned = p.rank * L + l;  // entry (s, l) of this rank as the owner
    EpSegment b;
    b.src_row = recv_row[s * E + owned];
    b.dst_row = local_base[s * E + owned];
    b.rows = kept[s * E + owned];
    b.peer = s;
    p.to_source[e] = b;
    source_rows = b.rows;
  }
  if (t < L) {
    p.recv_gaps[2 * t] = p.offsets[t] + p.splits[t];
    p.recv_gaps[2 * t + 1] = p.offsets[t + 1];
  }
  int64_t owner_before, source_before, owner_total, source_total;
  Scan(scan_storage).ExclusiveSum(owner_rows, owner_before, owner_total);
  __syncthreads();
  Scan(scan_storage).ExclusiveSum(source_rows, source_before, source_total);
  if (t < E) {
    p.to_owner_prefix[t] = owner_before;
    p.to_source_prefix[t] = source_before;
    if (lost != 0) atomicAdd(p.dropped, lost);  // integer sum: order-free
  }
  if (t == 0) {
    p.to_owner_prefix[E] = owner_total;
    p.to_source_prefix[E] = source_total;
  }
}

// ---- rows ---------------------------------------------------------------------------------------
// The segment holding flattened row i: the largest s with prefix[s] <= i (empty segments share
// their start with the next one and are skipped).
__device__ __forceinline__ int segment_of(const int64_t* prefix, int count, int64_t i) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (prefix[mid] <= i) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__global__ void __launch_bounds__(kExchangeThreads) ep_exchange_kernel(EpExchangeParams p, int lanes) {
  const int64_t vectors = static_cast<int64_t>(p.row_bytes / 16);
  const bool stopped = block_link_stopped(p.link) && p.mode == EpRowsMode::kPeerStore;
  const int64_t total = stopped ? 0 : p.prefix[p.count];
  const int peers = p.count / p.segments_per_peer;
  const int64_t start = p.mode == EpRowsMode::kPeerStore ? p.prefix[(p.rank + 1) % peers * p.segments_per_peer] : 0;
  for_each_row(total, lanes, [&](int64_t walked, int lane, bool active) {
    if (!active) return;
    const int64_t i = walked + start < total ? walked + start : walked + start - total;  // start <= total
    const int s = segment_of(p.prefix, p.count, i);
    const EpSegment seg = p.segments[s];
    const int64_t k = i - p.prefix[s];
    // Row k of the segment in its peer's chunk: after the rows of the peer's earlier segments.
    const auto chunk_row = [&] {
      return seg.peer * p.chunk_rows + (p.prefix[s] - p.prefix[seg.peer * p.segments_per_peer]) + k;
    };
    const auto source_row = [&](int64_t r) -> int64_t { return p.src_rows != nullptr ? p.src_rows[r] : r; };
    const char* src_base = static_cast<const char*>(p.src);
    char* local = static_cast<char*>(p.local_dst);
    const uint4* src;
    uint4* dst;
    switch (p.mode) {
      case EpRowsMode::kPack:
        src = reinterpret_cast<const uint4*>(src_base + source_row(seg.src_row + k) * p.row_bytes);
        dst = reinterpret_cast<uint4*>(local + chunk_row() * p.row_bytes);
        break;
      case EpRowsMode::kUnpack:
        src = reinterpret_cast<const uint4*>(src_base + chunk_row() * p.row_bytes);
        dst = reinterpret_cast<uint4*>(local + (seg.src_row + k) * p.row_bytes);
        break;
      default:
        src = reinterpret_cast<const uint4*>(src_base + source_row(seg.src_row + k) * p.row_bytes);
        dst = reinterpret_cast<uint4*>(p.dst.base[seg.peer] + (seg.dst_row + k) * p.row_bytes);
    }
    for (int64_t v = lane; v < vectors; v += lanes) dst[v] = src[v];
  });
  // Zero ranges of this rank's own copy: few and short; each block takes ranges in turn.
  for (int z = blockIdx.x; z < p.zero_count; z += gridDim.x) {
    const int64_t begin = p.zero_ranges[2 * z], end = p.zero_ranges[2 * z + 1];
    uint4* base = reinterpret_cast<uint4*>(static_cast<char*>(p.local_dst) + begin * p.row_bytes);
    const int64_t n = std::max<int64_t>(end - begin, 0) * vectors;
    for (int64_t v = threadIdx.x; v < n; v += blockDim.x) base[v] = make_uint4(0, 0, 0, 0);
  }
  __threadfence_system();  // the barrier that follows publishes these stores
}

// ---- the emulated send/recv transport -----------------------------------------------------------
__global__ void __launch_bounds__(kExchangeThreads) ep_push_chunks_kernel(const uint4* send, PeerBases recv,
                                                                          int64_t chunk_vectors, int rank,
                                                                          int ranks, const uint32_t* link) {
  const int64_t total = block_link_stopped(link) ? 0 : chunk_vectors * ranks;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t d = i / chunk_vectors, v = i - d * chunk_vectors;
    reinterpret_cast<uint4*>(recv.base[d])[rank * chunk_vectors + v] = send[i];
  }
  __threadfence_system();  // the barrier that follows publishes these stores
}

}  // namespace

void launch_ep_share_counts(const int32_t* counts, const int32_t* num_tokens, int experts, int rank, int ranks,
                            const PeerBases& matrix, const uint32_t* link, cudaStream_t stream) {
  MG_CHECK(ranks >= 1 && ranks <= kMaxExpertParallel && rank >= 0 && rank < ranks, "ep: rank ", rank, " of ", ranks);
  ep_share_counts_kernel<<<1, 256, 0, stream>>>(counts, num_tokens, experts, rank, ranks, matrix, link);
  MG_LAUNCH_CHECK();
}

void launch_ep_barrier(const EpBarrierParams& p, cudaStream_t stream) {
  MG_CHECK(p.ranks >= 1 && p.ranks <= kMaxExpertParallel && p.epoch != nullptr && p.error != nullptr,
           "ep barrier: bad parameters");
  ep_barrier_kernel<<<1, 64, 0, stream>>>(p);
  MG_LAUNCH_CHECK();
}

std::size_t ep_plan_scratch_bytes(int ranks, int experts) {
  return static_cast<std::size_t>(4) * ranks * experts * sizeof(int32_t);
}

void launch_ep_plan(const EpPlanParams& p, cudaStream_t stream) {
  MG_CHECK(p.ranks >= 1 && p.ranks <= kMaxExpertParallel && p.experts >= 1 && p.experts <= kMaxExperts &&
               p.experts % p.ranks == 0,
           "ep plan: ", p.experts, " experts over ", p.ranks, " ranks");
  MG_CHECK(p.row_align >= 1 && p.recv_rows % p.row_align == 0, "ep plan: recv_rows ", p.recv_rows,
           " is not a multiple of row_align ", p.row_align);
  ep_plan_kernel<<<1, kPlanThreads, 0, stream>>>(p);
  MG_LAUNCH_CHECK();
}

void launch_ep_exchange(const EpExchangeParams& p, cudaStream_t stream) {
  MG_CHECK(p.row_bytes % 16 == 0 && p.row_bytes > 0, "ep exchange: row bytes ", p.row_bytes,
           " must be a positive multiple of 16");
  MG_CHECK(p.count >= 1 && p.segments_per_peer >= 1 && p.count % p.segments_per_peer == 0 && p.rank >= 0 &&
               p.rank < p.count / p.segments_per_peer,
           "ep exchange: ", p.count, " segments, ", p.segments_per_peer, " per peer, rank ", p.rank);
  MG_CHECK(p.mode == EpRowsMode::kPeerStore || (p.chunk_rows >= 0 && p.local_dst != nullptr),
           "ep exchange: a pack or unpack needs chunk rows and the local staging");
  const int64_t vectors = static_cast<int64_t>(p.row_bytes / 16);
  const int lanes = lanes_per_row(vectors);
  const int64_t rows_per_block = kExchangeThreads / 32 * (32 / lanes);
  const int useful = static_cast<int>(std::max<int64_t>(
      (p.max_rows + rows_per_block - 1) / rows_per_block, p.zero_count));
  const int grid = grid_blocks(useful, resident_blocks_per_sm(ep_exchange_kernel, kExchangeThreads));
  ep_exchange_kernel<<<grid, kExchangeThreads, 0, stream>>>(p, lanes);
  MG_LAUNCH_CHECK();
}

void launch_ep_push_chunks(const void* send, const PeerBases& recv, std::size_t chunk_bytes, int rank, int ranks,
                           const uint32_t* link, cudaStream_t stream) {
  MG_CHECK(ranks >= 1 && ranks <= kMaxExpertParallel && rank >= 0 && rank < ranks, "ep chunks: rank ", rank, " of ",
           ranks);
  MG_CHECK(chunk_bytes % 16 == 0 && aligned16(send), "ep chunks: ", chunk_bytes,
           " bytes per chunk must be a multiple of 16 and 16-byte aligned");
  const int64_t vectors = static_cast<int64_t>(chunk_bytes / 16);
  if (vectors == 0) return;
  const int grid = grid_blocks((vectors * ranks + kExchangeThreads - 1) / kExchangeThreads,
                               resident_blocks_per_sm(ep_push_chunks_kernel, kExchangeThreads));
  ep_push_chunks_kernel<<<grid, kExchangeThreads, 0, stream>>>(static_cast<const uint4*>(send), recv, vectors, rank,
                                                               ranks, link);
  MG_LAUNCH_CHECK();
}

}  // namespace moegraph::kernels
