// Sharded-weight collectives over windows (host-callable launchers; no device code in this header).
// Every rank of a data-parallel group holds one window laid out identically (NCCL symmetric memory,
// or R buffers of one GPU for emulated ranks); a full tensor lies at the same offset in each. Rank p
// owns elements [first_p, first_p + count_p) of every sharded tensor (its shard).
//
//   gather (before forward): the owner's shard is copied into its own window (a plain copy), a
//     barrier, then launch_shard_gather pulls every other rank's elements from that rank's window,
//     then a barrier (no owner refreshes its rows while a peer still reads them);
//   reduce (after the gradients): a barrier (every rank's full gradient is written), then
//     launch_shard_reduce sums, for its own elements only, every rank's gradient in rank order in
//     fp32 and adds the sum into the caller's fp32 shard or writes it rounded to 16 bits, then a
//     barrier (no rank overwrites its gradient while a peer still reads it).
// The barriers are launch_ep_barrier's (kernels/comm/ep_exchange.hpp). Enqueue paths only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/comm/ep_exchange.hpp"
#include "moegraph/types.hpp"

namespace moegraph::kernels {

inline constexpr int kMaxShardTensors = 4;

// One tensor: at `offset` bytes of every rank's window; `ranges` is device memory [ranks][2] holding
// each rank's first element and element count.
struct ShardTensor {
  std::size_t offset = 0;
  const int64_t* ranges = nullptr;
  DType type = DType::kBF16;  // the window's elements: 16-bit, or fp32
  // Reduce only: this rank's shard of the result (the caller's), fp32 accumulated into when `type`
  // is fp32, else written in `type`.
  void* out = nullptr;
};

struct ShardExchangeParams {
  PeerBases window;
  ShardTensor tensors[kMaxShardTensors];
  int count = 0;
  int rank = 0, ranks = 1;
  int64_t max_elements = 0;  // the largest shard of any tensor (sizes the grid)
};

// Every other rank's elements of each tensor, from its window into this rank's.
void launch_shard_gather(const ShardExchangeParams& p, cudaStream_t stream);
// This rank's elements of each tensor: the sum over ranks 0..R-1 (in that order, in fp32) into out.
void launch_shard_reduce(const ShardExchangeParams& p, cudaStream_t stream);

}  // namespace moegraph::kernels
