// Shard descriptors: the two named policies and the check of a caller's table.
#include "moegraph/sharding.hpp"

#include <algorithm>

#include "moegraph/error.hpp"

namespace moegraph {

namespace {
// Row counts stay far below 2^63, so first_row + rows and ceil(R / W) * W never overflow.
constexpr int64_t kMaxShardRows = int64_t{1} << 62;
}  // namespace

std::string_view shard_policy_name(ShardPolicy p) {
  switch (p) {
    case ShardPolicy::kChunk: return "chunk";
    case ShardPolicy::kBalanced: return "balanced";
  }
  return "?";
}

std::string_view shard_unit_name(ShardUnit u) {
  switch (u) {
    case ShardUnit::kExpert: return "expert";
    case ShardUnit::kRow: return "row";
  }
  return "?";
}

Shard shard_for(ShardPolicy policy, int64_t global_rows, int ranks, int rank) {
  MG_CHECK(global_rows >= 1 && global_rows <= kMaxShardRows, "a sharded tensor needs 1 to 2^62 rows, got ",
           global_rows);
  MG_CHECK(ranks >= 1 && ranks <= kMaxShardRanks, "a sharded tensor needs 1 to ", kMaxShardRanks,
           " ranks, got ", ranks);
  MG_CHECK(rank >= 0 && rank < ranks, "rank ", rank, " is outside [0, ", ranks, ")");
  Shard s;
  s.global_rows = global_rows;
  if (policy == ShardPolicy::kChunk) {
    const int64_t per = (global_rows + ranks - 1) / ranks;
    s.first_row = std::min(global_rows, per * rank);
    s.rows = std::min(global_rows, s.first_row + per) - s.first_row;
  } else {
    const int64_t base = global_rows / ranks, extra = global_rows % ranks;
    s.first_row = base * rank + std::min<int64_t>(rank, extra);
    s.rows = base + (rank < extra ? 1 : 0);
  }
  return s;
}

std::vector<Shard> shard_table(ShardPolicy policy, int64_t global_rows, int ranks) {
  std::vector<Shard> t;
  for (int r = 0; r < ranks; ++r) t.push_back(shard_for(policy, global_rows, ranks, r));
  return t;
}

void check_shard_table(std::span<const Shard> table, std::string_view tensor) {
  MG_CHECK(!table.empty(), tensor, ": no shards");
  const int64_t global = table[0].global_rows;
  MG_CHECK(global >= 1 && global <= kMaxShardRows, tensor, ": rank 0's shard has global_rows ", global,
           " (1 to 2^62)");
  std::vector<std::size_t> order;
  for (std::size_t r = 0; r < table.size(); ++r) {
    const Shard& s = table[r];
    MG_CHECK(s.global_rows == global, tensor, ": rank ", r, "'s shard has global_rows ", s.global_rows, " but rank 0's ",
             global, " (every rank must describe the same tensor)");
    MG_CHECK(s.first_row >= 0 && s.rows >= 0 && s.first_row <= global && s.rows <= global - s.first_row, tensor,
             ": rank ", r, "'s shard, rows [", s.first_row, ", ", s.first_row, " + ", s.rows, "), is not inside [0, ",
             global, ")");
    if (s.rows > 0) order.push_back(r);
  }
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return table[a].first_row < table[b].first_row; });
  int64_t next = 0;
  for (std::size_t r : order) {
    const Shard& s = table[r];
    MG_CHECK(s.first_row >= next, tensor, ": rank ", r, "'s rows [", s.first_row, ", ", s.first_row + s.rows,
             ") overlap another rank's, which end at ", next);
    MG_CHECK(s.first_row == next, tensor, ": rows [", next, ", ", s.first_row, ") belong to no rank's shard");
    next = s.first_row + s.rows;
  }
  MG_CHECK(next == global, tensor, ": rows [", next, ", ", global, ") belong to no rank's shard");
}

}  // namespace moegraph
