// Sharded expert weights: a data-parallel group of W ranks, each holding a contiguous block of the
// rows of every expert weight and bias (and of its gradient), described by a Shard — never assumed.
//
// A tensor's rows are its leading dimension in the shard unit: ShardUnit::kExpert shards [El, N, K]
// along El (what FSDP2's Shard(0) does to the PyTorch package's parameters), ShardUnit::kRow along
// the El·N rows of the tensor viewed as [El·N, K] (each expert's rows spread over the ranks, so
// every rank holds a share even when W > El). A bias [El, N] has El rows (kExpert) or El·N rows of
// one element (kRow). A shard is always one contiguous block of memory: rows [first_row,
// first_row + rows) of the tensor.
//
// Two named policies give every rank its block; a caller with another framework's split passes
// its own descriptors (checked on every rank: together they must cover each tensor exactly once).
#pragma once

#include "moegraph/export.h"

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace moegraph {

// kChunk: as torch.chunk and FSDP2: ceil(R / W) rows per rank in rank order, the last ranks fewer
//         or none (R = 5, W = 4: 2, 2, 1, 0).
// kBalanced: the first R mod W ranks hold floor(R / W) + 1 rows, the others floor(R / W)
//         (R = 5, W = 4: 2, 1, 1, 1).
enum class ShardPolicy { kChunk, kBalanced };
MOEGRAPH_API std::string_view shard_policy_name(ShardPolicy p);  // "chunk" or "balanced"

// What one shard row of an expert tensor is (see above).
enum class ShardUnit { kExpert, kRow };
MOEGRAPH_API std::string_view shard_unit_name(ShardUnit u);  // "expert" or "row"

// Rows [first_row, first_row + rows) of a tensor of global_rows rows. rows may be 0 (a rank holding
// nothing of this tensor); global_rows 0 means "not given" where a descriptor is optional.
struct Shard {
  int64_t global_rows = 0, first_row = 0, rows = 0;
};

// Data-parallel ranks of one sharded step, at most kMaxShardRanks.
inline constexpr int kMaxShardRanks = 64;

// Rank `rank`'s shard of global_rows rows over `ranks` ranks. Throws moegraph::Error for
// global_rows < 1 or above 2^62, ranks outside [1, kMaxShardRanks], or rank outside [0, ranks).
MOEGRAPH_API Shard shard_for(ShardPolicy policy, int64_t global_rows, int ranks, int rank);
// Every rank's shard, in rank order.
MOEGRAPH_API std::vector<Shard> shard_table(ShardPolicy policy, int64_t global_rows, int ranks);
// Throws moegraph::Error (naming `tensor` and the rank) unless every rank's shard has the same
// global_rows (>= 1), lies inside it, and together they cover every row exactly once (in any order).
MOEGRAPH_API void check_shard_table(std::span<const Shard> table, std::string_view tensor);

// How a sharded step spreads its expert weights: the data-parallel group's size (1: not sharded),
// the policy giving each rank its rows (unless the caller gives descriptors) and the unit of a row.
struct WeightSharding {
  int ranks = 1;
  ShardPolicy policy = ShardPolicy::kChunk;
  ShardUnit unit = ShardUnit::kExpert;
};

// One rank's descriptors of the four expert tensors (their gradients share them). Rows are in the
// WeightSharding's unit; a descriptor with global_rows 0 is computed by the policy.
struct ExpertShards {
  Shard w1, w2, b1, b2;
};

}  // namespace moegraph
