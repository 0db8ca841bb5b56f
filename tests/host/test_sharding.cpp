// Shard descriptors: the two named policies against their definitions (torch.chunk's for kChunk),
// the check of a caller's table, and a sharded step's options and plan (no GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <string>
#include <vector>

#include "graphs/sharded_weights.hpp"
#include "moegraph/error.hpp"
#include "moegraph/moegraph.h"
#include "moegraph/sharding.hpp"
#include "moegraph/step_graphs.hpp"
#include "tests/common/thrown.hpp"

namespace moegraph::test {
namespace {

std::vector<int64_t> rows_of(ShardPolicy p, int64_t global, int ranks) {
  std::vector<int64_t> out;
  for (const Shard& s : shard_table(p, global, ranks)) out.push_back(s.rows);
  return out;
}

TEST(Sharding, PoliciesOnTheIssuesExamples) {
  // 151936 rows over 4 ranks divide evenly: both policies agree.
  EXPECT_EQ(rows_of(ShardPolicy::kChunk, 151936, 4), (std::vector<int64_t>{37984, 37984, 37984, 37984}));
  EXPECT_EQ(rows_of(ShardPolicy::kBalanced, 151936, 4), (std::vector<int64_t>{37984, 37984, 37984, 37984}));
  EXPECT_EQ(rows_of(ShardPolicy::kChunk, 5, 4), (std::vector<int64_t>{2, 2, 1, 0}));
  EXPECT_EQ(rows_of(ShardPolicy::kBalanced, 5, 4), (std::vector<int64_t>{2, 1, 1, 1}));
  EXPECT_EQ(rows_of(ShardPolicy::kChunk, 10, 4), (std::vector<int64_t>{3, 3, 3, 1}));
  EXPECT_EQ(rows_of(ShardPolicy::kBalanced, 10, 4), (std::vector<int64_t>{3, 3, 2, 2}));
  // torch.chunk(3 rows, 4) gives three chunks of one: the fourth rank holds nothing.
  EXPECT_EQ(rows_of(ShardPolicy::kChunk, 3, 4), (std::vector<int64_t>{1, 1, 1, 0}));
  // ceil(9 / 4) = 3 rows per chunk: 3, 3, 3 and nothing left for the last rank.
  EXPECT_EQ(rows_of(ShardPolicy::kChunk, 9, 4), (std::vector<int64_t>{3, 3, 3, 0}));
  EXPECT_EQ(rows_of(ShardPolicy::kChunk, 1, 3), (std::vector<int64_t>{1, 0, 0}));
  EXPECT_EQ(shard_for(ShardPolicy::kBalanced, 10, 4, 2).first_row, 6);
  EXPECT_EQ(shard_for(ShardPolicy::kChunk, 9, 4, 3).first_row, 9);
}

// Every (rows, ranks) up to 70 x 9: kChunk is torch.chunk (chunks of ceil(R / W) in order, a rank past the
// last chunk holds none), kBalanced gives the first R mod W ranks one row more, and both tile the rows.
TEST(Sharding, PoliciesMatchTheirDefinitionsEverywhere) {
  for (int64_t global = 1; global <= 70; ++global)
    for (int ranks = 1; ranks <= 9; ++ranks) {
      const int64_t chunk = (global + ranks - 1) / ranks;
      int64_t next = 0;
      for (int r = 0; r < ranks; ++r) {
        const Shard c = shard_for(ShardPolicy::kChunk, global, ranks, r);
        const int64_t begin = std::min(global, r * chunk), end = std::min(global, (r + 1) * chunk);
        EXPECT_EQ(c.first_row, begin) << global << " rows, " << ranks << " ranks, rank " << r;
        EXPECT_EQ(c.rows, end - begin) << global << " rows, " << ranks << " ranks, rank " << r;
        const Shard b = shard_for(ShardPolicy::kBalanced, global, ranks, r);
        EXPECT_EQ(b.first_row, next);
        EXPECT_EQ(b.rows, global / ranks + (r < global % ranks ? 1 : 0));
        next += b.rows;
      }
      EXPECT_NO_THROW(check_shard_table(shard_table(ShardPolicy::kChunk, global, ranks), "t"));
      EXPECT_NO_THROW(check_shard_table(shard_table(ShardPolicy::kBalanced, global, ranks), "t"));
    }
}

TEST(Sharding, BadArgumentsAreRefused) {
  EXPECT_THROW(shard_for(ShardPolicy::kChunk, 0, 2, 0), Error);
  EXPECT_THROW(shard_for(ShardPolicy::kChunk, 8, 0, 0), Error);
  EXPECT_THROW(shard_for(ShardPolicy::kChunk, 8, kMaxShardRanks + 1, 0), Error);
  EXPECT_THROW(shard_for(ShardPolicy::kChunk, 8, 2, 2), Error);
  EXPECT_THROW(shard_for(ShardPolicy::kBalanced, 8, 2, -1), Error);
}

TEST(Sharding, CallerTablesAreChecked) {
  // Any order is fine as long as every row has exactly one owner.
  EXPECT_NO_THROW(check_shard_table(std::vector<Shard>{{8, 5, 3}, {8, 0, 5}, {8, 5, 0}}, "w1"));
  EXPECT_NE(thrown_what([] { check_shard_table(std::vector<Shard>{{8, 0, 5}, {8, 4, 4}}, "w1"); }).find("overlap"),
            std::string::npos);
  EXPECT_NE(thrown_what([] { check_shard_table(std::vector<Shard>{{8, 0, 4}, {8, 5, 3}}, "w1"); }).find("rows [4, 5)"),
            std::string::npos);
  EXPECT_NE(thrown_what([] { check_shard_table(std::vector<Shard>{{8, 0, 4}, {8, 4, 3}}, "w2"); }).find("rows [7, 8)"),
            std::string::npos);
  EXPECT_NE(thrown_what([] { check_shard_table(std::vector<Shard>{{8, 0, 4}, {9, 4, 5}}, "b1"); }).find("global_rows"),
            std::string::npos);
  EXPECT_NE(thrown_what([] { check_shard_table(std::vector<Shard>{{8, 0, 4}, {8, 6, 4}}, "b2"); }).find("not inside"),
            std::string::npos);
  EXPECT_THROW(check_shard_table(std::vector<Shard>{{8, -1, 4}, {8, 3, 5}}, "w1"), Error);
  EXPECT_THROW(check_shard_table(std::vector<Shard>{}, "w1"), Error);
}

StepGraphsOptions sharded_options(int ranks, ShardUnit unit) {
  StepGraphsOptions o;
  o.layer.experts = 6, o.layer.hidden = 64, o.layer.ffn = 32, o.layer.top_k = 2, o.layer.bias = true;
  o.layer.training = true, o.layer.main_grad_fp32 = true;
  o.buckets = {16};
  o.sharding.ranks = ranks, o.sharding.unit = unit;
  return o;
}

TEST(Sharding, TensorShapesFollowTheUnit) {
  const auto experts = sharded_tensor_shapes(sharded_options(4, ShardUnit::kExpert));
  ASSERT_EQ(experts.size(), 4u);
  EXPECT_EQ(experts[0].global_rows, 6);
  EXPECT_EQ(experts[0].row_elements, 2 * 32 * 64);
  EXPECT_EQ(experts[3].row_elements, 64);  // b2 [6, 64]
  const auto rows = sharded_tensor_shapes(sharded_options(4, ShardUnit::kRow));
  EXPECT_EQ(rows[0].global_rows, 6 * 64);  // w1 as [6 * 2 * 32, 64]
  EXPECT_EQ(rows[1].global_rows, 6 * 64);  // w2 as [6 * 64, 32]
  EXPECT_EQ(rows[1].row_elements, 32);
  EXPECT_EQ(rows[2].row_elements, 1);      // b1: one element per row
}

TEST(Sharding, PlanCountsShardsAndTheWindow) {
  StepGraphsOptions whole = sharded_options(1, ShardUnit::kExpert);
  const StepPlan unsharded = plan_step(whole);
  const StepPlan sharded = plan_step(sharded_options(4, ShardUnit::kExpert));
  EXPECT_EQ(unsharded.shard_window_bytes, 0u);
  // Rank 0 holds 2 of 6 experts (chunk), so its weights and gradients shrink while the window holds
  // full weights and full gradients.
  EXPECT_LT(sharded.weight_bytes, unsharded.weight_bytes);
  EXPECT_GT(sharded.shard_window_bytes, unsharded.weight_bytes / 2);
  EXPECT_EQ(sharded.device_bytes(), sharded.arena_bytes + sharded.weight_bytes + sharded.shard_window_bytes);
  EXPECT_NE(sharded.to_string().find("sharded weights' window"), std::string::npos);
}

TEST(Sharding, StepOptionsAreChecked) {
  StepGraphsOptions o = sharded_options(kMaxShardRanks + 1, ShardUnit::kExpert);
  EXPECT_THROW(validate(o), Error);
  o = sharded_options(0, ShardUnit::kExpert);
  EXPECT_THROW(validate(o), Error);
  o = sharded_options(2, ShardUnit::kExpert);
  o.layer.recipe = Recipe::kMXFP8, o.layer.row_align = 32, o.layer.hidden = 128, o.layer.ffn = 128;
  EXPECT_NO_THROW(validate(o));  // the step quantizes what it gathers
  o.layer.prequantized_weights = true;
  EXPECT_NE(thrown_what([&] { validate(o); }).find("cannot take prequantized MXFP8 weights"), std::string::npos);
  o = sharded_options(2, ShardUnit::kExpert);
  o.layer.expert_parallel = 2;  // shards of each rank's own experts
  EXPECT_NO_THROW(validate(o));
  // A sharded step without the group's communicator is refused before touching the GPU.
  o = sharded_options(2, ShardUnit::kExpert);
  StepWeights w;
  int dummy = 0;
  w.router = &dummy, w.main_grad_router = reinterpret_cast<float*>(&dummy);
  EXPECT_NE(thrown_what([&] { StepGraphs g(o, w); }).find("shard_comm"), std::string::npos);
}

// The C ABI gives the same rows as the C++ policies, and refuses bad arguments with a message.
TEST(Sharding, CAbiRowsMatchThePolicies) {
  for (const auto& [c_policy, policy] : {std::pair{MG_SHARD_CHUNK, ShardPolicy::kChunk},
                                         std::pair{MG_SHARD_BALANCED, ShardPolicy::kBalanced}})
    for (int rank = 0; rank < 4; ++rank) {
      int64_t first = -1, rows = -1;
      ASSERT_EQ(mg_shard_rows(c_policy, 5, 4, rank, &first, &rows), MG_OK);
      const Shard s = shard_for(policy, 5, 4, rank);
      EXPECT_EQ(first, s.first_row);
      EXPECT_EQ(rows, s.rows);
    }
  int64_t first = 7, rows = 7;
  EXPECT_EQ(mg_shard_rows(MG_SHARD_CHUNK, 5, 4, 4, &first, &rows), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(first, 0);
  EXPECT_EQ(rows, 0);
  EXPECT_NE(std::string(mg_last_error()).find("rank 4"), std::string::npos) << mg_last_error();
  EXPECT_EQ(mg_shard_rows(static_cast<mg_shard_policy>(7), 5, 4, 0, &first, &rows), MG_ERR_INVALID_ARGUMENT);
  rows = 7;
  EXPECT_EQ(mg_shard_rows(MG_SHARD_CHUNK, 5, 4, 0, nullptr, &rows), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(rows, 0) << "the output given is zeroed when the other is missing";
  first = 7;
  EXPECT_EQ(mg_shard_rows(MG_SHARD_CHUNK, 5, 4, 0, &first, nullptr), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(first, 0);
}

}  // namespace
}  // namespace moegraph::test
