// Sharded expert weights on emulated data-parallel ranks: W StepGraphs in this process on one GPU,
// each on its own thread and stream, gathering and reducing through each other's windows with the
// kernels the NCCL transport runs (tests/ep runs the same cases on real ranks). The cases and what
// they check: tests/common/shard_harness.hpp. Emulated ranks share the process, so each captures in
// thread-local mode; the NCCL tests capture in global mode.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "moegraph/error.hpp"
#include "moegraph/expert_parallel.hpp"
#include "tests/common/ep_shard_harness.hpp"
#include "tests/common/shard_harness.hpp"
#include "tests/common/thrown.hpp"

namespace moegraph::test {
namespace {

std::vector<std::shared_ptr<EpComm>> emulated(int ranks) {
  EmulatedEpGroup group(ranks);  // its communicators keep the group's state alive
  std::vector<std::shared_ptr<EpComm>> out;
  for (int r = 0; r < ranks; ++r) out.push_back(group.rank(r));
  return out;
}

class ShardedWeightsCase : public ::testing::TestWithParam<ShardCase> {};
TEST_P(ShardedWeightsCase, RanksMatchTheUnshardedStep) {
  run_shard_case(GetParam(), emulated(GetParam().ranks), cudaStreamCaptureModeThreadLocal);
}
INSTANTIATE_TEST_SUITE_P(Cases, ShardedWeightsCase, ::testing::ValuesIn(kShardCases),
                         [](const auto& info) { return std::string(info.param.name); });

// Under expert parallelism: an R x W grid of emulated ranks, an EmulatedEpGroup per row and per column.
std::vector<GridRank> emulated_grid(int ep, int dp) {
  std::vector<std::shared_ptr<EpComm>> rows[kMaxShardRanks], columns[kMaxShardRanks];
  for (int j = 0; j < dp; ++j) rows[j] = emulated(ep);
  for (int i = 0; i < ep; ++i) columns[i] = emulated(dp);
  std::vector<GridRank> out;
  for (int j = 0; j < dp; ++j)
    for (int i = 0; i < ep; ++i) out.push_back({i, j, rows[j][i], columns[i][j]});
  return out;
}

class ExpertParallelShardedWeightsCase : public ::testing::TestWithParam<EpShardCase> {};
TEST_P(ExpertParallelShardedWeightsCase, RanksMatchTheWholeLayers) {
  const EpShardCase& c = GetParam();
  run_ep_shard_case(c, emulated_grid(c.ep, c.dp), cudaStreamCaptureModeThreadLocal);
}
INSTANTIATE_TEST_SUITE_P(Cases, ExpertParallelShardedWeightsCase, ::testing::ValuesIn(kEpShardCases),
                         [](const auto& info) { return std::string(info.param.name); });

// Overlapping descriptors (rank 1 claims rows rank 0 holds) fail on every rank, naming the tensor.
TEST(ShardedWeights, OverlappingDescriptorsAreRefusedOnEveryRank) {
  const ShardCase c = kShardCases[0];
  ShardData data(c);
  const StepGraphsOptions o = shard_options(c, 2, cudaStreamCaptureModeThreadLocal);
  const auto comms = emulated(2);
  DeviceArray<uint16_t> router = upload_bits16(data.router());
  DeviceArray<uint16_t> w(static_cast<std::size_t>(c.experts) * 2 * c.ffn * c.hidden * 2);
  DeviceArray<float> mg(static_cast<std::size_t>(c.experts) * 2 * c.ffn * c.hidden * 2), mgr(c.experts * c.hidden);
  DeviceArray<uint16_t> db(static_cast<std::size_t>(c.experts) * 2 * c.ffn);
  std::vector<std::string> errors(2);
  on_threads(2, [&](int r) {
    StepWeights s;
    s.router = router.get(), s.main_grad_router = mgr.get();
    s.w1 = s.w2 = s.b1 = s.b2 = w.get();
    s.main_grad1 = s.main_grad2 = mg.get();
    s.db1 = s.db2 = db.get();
    s.shards.w1 = r == 0 ? Shard{c.experts, 0, 3} : Shard{c.experts, 2, 3};
    errors[r] = thrown_message([&] { StepGraphs g(o, s, nullptr, comms[r]); });
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("w1"), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("overlap"), std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

}  // namespace
}  // namespace moegraph::test
