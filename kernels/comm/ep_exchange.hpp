// Expert-parallel exchange kernels (host-callable launchers; no device code in this header). R ranks
// each hold a window: memory laid out identically on every rank that every rank can load from and
// store to (NCCL symmetric memory over NVLink, or R buffers of one GPU for emulated ranks). A
// launcher takes the address of one window buffer on every rank (PeerBases) and never learns how
// the addresses were obtained, so the same kernels serve both transports.
//
// One exchange of the MoE layer, on rank r:
//   1. launch_ep_share_counts: r's per-expert counts and its token count go to row r of every
//      rank's count matrix [R][E + 1];
//   2. launch_ep_barrier (every rank's row has arrived);
//   3. launch_ep_plan: from the matrix alone, every rank computes the same receive layout for every
//      rank (grouped by local expert, then by source rank, then in the source's row order), so r
//      knows where each of its rows lands on its owner and where each row it receives came from;
//   4. launch_ep_exchange: rows are stored into the peers' windows, each exactly once;
//   5. launch_ep_barrier (the rows have arrived).
// The send/recv exchange (EpExchange::kSendRecv) replaces the stores of steps 1 and 4 by chunks of a
// fixed size that the transport moves whole: the counts row and the rows for each peer are packed
// into chunk `peer` of a local [ranks][chunk] buffer (share_counts with chunk bases, exchange mode
// kPack), the transport moves chunk p to rank p (EpComm::all_to_all, which completes in stream order
// and needs no barrier here), and the receiver unpacks each source's chunk into place (kUnpack).
// Every launcher is an enqueue path: no synchronization, allocation or device read on the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "moegraph/types.hpp"

namespace moegraph::kernels {

// One window buffer's address on every rank, as this rank addresses it.
struct PeerBases {
  char* base[kMaxExpertParallel] = {};
};

// Rows [src_row, src_row + rows) of the local source buffer go to rows [dst_row, dst_row + rows) of
// `peer`'s destination buffer.
struct EpSegment {
  int64_t src_row = 0, dst_row = 0, rows = 0;
  int32_t peer = 0, pad = 0;
};

// The barrier's epoch word (EpBarrierParams::epoch) is also the link's state: its low 31 bits count
// the barriers, and kEpLinkStopped is set once a barrier of this rank timed out or found a peer
// stopped. From then on the link's barriers wait for nobody and publish the bit to every peer (so a
// peer still in step raises kDeviceErrorPeerStopped at its next barrier instead of passing it on
// rows that never came), and the kernels given the word as `link` store into no peer (so a slow
// peer's buffers are never overwritten while it still reads them). Data errors (token counts) do
// not stop the link: the step runs on the clamped counts, in step on every rank.
inline constexpr uint32_t kEpLinkStopped = 0x80000000u;

// ---- 1. counts ----------------------------------------------------------------------------------------
// Row `rank` of every rank's matrix [ranks][experts + 1] = counts[0..E) and then *num_tokens (raw:
// the receivers check it). `matrix` holds the matrix's address on every rank. For send/recv, pass
// rank 0 and the local chunks as `matrix` (base[d] = chunk d): the row lands at the start of each.
// `link` (null: none): a stopped link writes only this rank's own row.
void launch_ep_share_counts(const int32_t* counts, const int32_t* num_tokens, int experts, int rank, int ranks,
                            const PeerBases& matrix, const uint32_t* link, cudaStream_t stream);

// ---- 2. barrier ---------------------------------------------------------------------------------------
// Every rank's stores issued before the barrier (in stream order) are visible to every rank after
// it. flags: an array of `ranks` uint32 in each window (zero at set-up); epoch: the link's word
// (zero at set-up; see kEpLinkStopped). Every rank must run the same sequence of barriers. A peer
// that has not arrived after `timeout_ns` raises kDeviceErrorPeerTimeout (group: the peer) instead
// of hanging, and a peer that has stopped raises kDeviceErrorPeerStopped: both stop the link. A
// barrier of a stopped link raises kDeviceErrorExchangeStopped (group: this rank; the first error
// recorded is kept).
struct EpBarrierParams {
  PeerBases flags;
  uint32_t* epoch = nullptr;
  int rank = 0, ranks = 0;
  int64_t timeout_ns = 0;
  DeviceErrorRecord* error = nullptr;
};
void launch_ep_barrier(const EpBarrierParams& p, cudaStream_t stream);

// ---- 3. plan ------------------------------------------------------------------------------------------
// Rank d owns experts [d·L, (d+1)·L), L = experts / ranks. Its receive buffer holds `recv_rows`
// rows (a multiple of row_align): local expert l starts at offsets[l] (aligned) and holds, source by
// source in rank order, the rows that source keeps for it. Each source's rows for expert e are
// contiguous in its local row order (its counting sort by expert, row_align 1): they start at the
// sum of its counts of experts below e. A bound smaller than the worst case (recv_rows, or
// chunk_rows per source and owner) keeps rows greedily in (local expert, source) order; the rest
// are dropped, counted on their source rank and zero in its results. In both tables segment i
// belongs to peer i / L, and a peer's segments are in the order of its chunk (send/recv).
struct EpPlanParams {
  const int32_t* matrix = nullptr;  // [ranks][experts + 1], this rank's copy
  int rank = 0, ranks = 0, experts = 0, row_align = 1;
  int64_t max_tokens = 0;           // per rank: a token count outside [0, max_tokens] is an error
  int64_t local_rows = 0;           // rows of each rank's local row order (max_tokens * top_k)
  int64_t recv_rows = 0;
  int64_t chunk_rows = 0;           // send/recv: rows one source may send one owner (0: no bound)
  int64_t matrix_stride = 0;        // elements between the matrix's rows (0: experts + 1)
  int32_t* splits = nullptr;        // [L] rows received per local expert
  int64_t* offsets = nullptr;       // [L + 1] aligned starts, offsets[L] the aligned end
  EpSegment* to_owner = nullptr;    // [E] this rank's rows of expert e -> e's owner
  int64_t* to_owner_prefix = nullptr;   // [E + 1] rows before segment i
  EpSegment* to_source = nullptr;   // [E] (s, l) at s·L + l: received rows -> source s
  int64_t* to_source_prefix = nullptr;  // [E + 1]
  int64_t* recv_gaps = nullptr;     // [L][2] alignment gap rows of this rank's receive buffer
  int64_t* dropped_rows = nullptr;  // [E][2] this rank's local rows kept by no owner
  int32_t* scratch = nullptr;       // ep_plan_scratch_bytes(ranks, experts)
  unsigned long long* dropped = nullptr;  // += this rank's rows dropped by the bound
  DeviceErrorRecord* error = nullptr;     // kDeviceErrorPeerTokenCount (group: the rank)
};
std::size_t ep_plan_scratch_bytes(int ranks, int experts);
void launch_ep_plan(const EpPlanParams& p, cudaStream_t stream);

// ---- 4. rows ------------------------------------------------------------------------------------------
// For every segment, by mode:
//   kPeerStore: its rows of `src` are stored into its peer's copy of the destination (dst.base
//               [peer] + dst_row * row_bytes);
//   kPack:      its rows of `src` go to its peer's chunk of the local staging `local_dst`
//               [ranks][chunk_rows] rows, at its place in the chunk (the rows of the peer's segments
//               before it), dst_row unused;
//   kUnpack:    the mirror: rows of the staging `src` (the chunk of segment's peer, same place) go
//               to rows src_row of `local_dst` (the receiver unpacks with the table whose src_row is
//               its own row: to_source in forward dispatch, to_owner in forward combine).
// Then `zero_ranges` [zero_count][2] rows of `local_dst` are zeroed (alignment gaps, dropped rows;
// none for kPack), so every row a reader may touch is written. row_bytes: a multiple of 16; every
// address 16-byte aligned.
// kPeerStore walks the rows from peer rank + 1's segments on and wraps around (segment i belongs to
// peer i / segments_per_peer): in table order every rank would store into peer 0 first, then peer
// 1, so R - 1 ranks would share one GPU's NVLink ingress while the other links idled.
enum class EpRowsMode { kPeerStore, kPack, kUnpack };
struct EpExchangeParams {
  EpRowsMode mode = EpRowsMode::kPeerStore;
  int64_t chunk_rows = 0;           // kPack, kUnpack: rows of each peer's chunk
  int segments_per_peer = 1;        // L (segment i belongs to peer i / L)
  int rank = 0;                     // kPeerStore: this rank (the walk starts at peer rank + 1)
  const void* src = nullptr;
  // kPeerStore, kPack: when set, the source's row r (the segments' src_row + k) is row src_rows[r]
  // of `src`: the dispatch reads its tokens' rows of x in place instead of a sorted copy.
  const int32_t* src_rows = nullptr;
  std::size_t row_bytes = 0;
  PeerBases dst;
  const EpSegment* segments = nullptr;
  const int64_t* prefix = nullptr;  // [count + 1]
  int count = 0;
  const int64_t* zero_ranges = nullptr;
  int zero_count = 0;
  void* local_dst = nullptr;
  int64_t max_rows = 0;             // bound on the rows moved (sizes the grid)
  const uint32_t* link = nullptr;   // kPeerStore: a stopped link stores no row (the zeroing is local)
};
void launch_ep_exchange(const EpExchangeParams& p, cudaStream_t stream);

// ---- the emulated send/recv transport ---------------------------------------------------------------
// Chunk d of `send` ([ranks][chunk_bytes]) is stored into chunk `rank` of rank d's `recv` (recv.base
// [d]: that rank's [ranks][chunk_bytes] buffer). chunk_bytes: a multiple of 16, 16-byte aligned.
// A barrier publishes the stores. `link` (null: none): a stopped link stores nothing.
void launch_ep_push_chunks(const void* send, const PeerBases& recv, std::size_t chunk_bytes, int rank, int ranks,
                           const uint32_t* link, cudaStream_t stream);

}  // namespace moegraph::kernels
