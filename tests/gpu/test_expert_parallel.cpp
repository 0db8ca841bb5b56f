// Expert parallelism on emulated ranks (R layers in this process on one GPU, each on its own stream,
// exchanging through each other's windows with the same kernels the NCCL transport runs): the
// ranks together equal the whole layer on the global batch (the concatenation of every rank's
// tokens) — output, dx, the router gradient summed over ranks, and each rank's slice of every
// expert weight and bias gradient — against the fp64 reference and the single-GPU MoeLayer, eager
// and graph-replayed (each rank captured in global mode, every replay a new routing), with ranks
// that receive nothing, all tokens on one expert, token counts differing per rank, invalid counts
// reported on every rank, and a receive bound whose drops are counted exactly; both exchanges (peer
// stores, and fixed send/recv chunks whose own bound drops are counted exactly too). The scenarios are
// tests/common/ep_harness.hpp's, which the NCCL tests (tests/ep/) run on real ranks.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "moegraph/error.hpp"
#include "moegraph/expert_parallel.hpp"
#include "moegraph/moe_layer.hpp"
#include "tests/common/ep_harness.hpp"
#include "tests/common/threads.hpp"

namespace moegraph::test {
namespace {

const EpCase kEpCases[] = {
    // name                  R  E   k  H    F    T   bias   sigm   renorm align mg     delay
    {"r2_e8_top2_bias", 2, 8, 2, 128, 64, 48, true, false, true, 1, true, false},
    {"r4_e16_top4_align16", 4, 16, 4, 128, 128, 40, false, true, true, 16, false, true},
    {"r4_e64_top8_bias_align32", 4, 64, 8, 256, 64, 24, true, false, false, 32, true, false},
    {"r2_e4_top1_odd", 2, 4, 1, 64, 32, 33, false, false, false, 1, true, true},
    // The send/recv exchange (fixed chunks through EpComm::all_to_all), worst-case chunks.
    {"r2_e8_top2_bias_send_recv", 2, 8, 2, 128, 64, 48, true, false, true, 1, true, false, EpExchange::kSendRecv},
    {"r4_e16_top4_align16_send_recv", 4, 16, 4, 128, 128, 40, false, true, true, 16, false, true,
     EpExchange::kSendRecv},
};

// Every rank of a fresh emulated group, driven by this process.
EpRanks emulated(const EpCase& c) {
  EmulatedEpGroup group(c.ranks);  // its communicators keep the group's state alive
  EpRanks out;
  for (int r = 0; r < c.ranks; ++r) out.comms.push_back(group.rank(r));
  return out;
}

class ExpertParallelCase : public ::testing::TestWithParam<EpCase> {};

TEST_P(ExpertParallelCase, EagerStepsMatchTheWholeLayer) { ep_eager_steps(GetParam(), emulated(GetParam())); }
TEST_P(ExpertParallelCase, GraphReplaysMatchTheWholeLayer) { ep_graph_replays(GetParam(), emulated(GetParam())); }

INSTANTIATE_TEST_SUITE_P(Cases, ExpertParallelCase, ::testing::ValuesIn(kEpCases),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(ExpertParallel, AllTokensToOneExpert) {
  for (EpCase c : {kEpCases[3], kEpCases[1], kEpCases[5]}) ep_all_tokens_to_one_expert(c, emulated(c));
}

TEST(ExpertParallel, InvalidCountIsReportedOnEveryRank) {
  for (EpCase c : {kEpCases[1], kEpCases[5]}) ep_invalid_count(c, emulated(c));
}

// The last rank never runs its step. The others time out once (not once per exchange) and report
// it; their next step waits for nobody and reports that their exchanges stopped; the late rank then
// stops at once on their flags instead of using rows that never came. Both exchanges: peer stores
// (the layer's link) and emulated send/recv (the group's link).
TEST(ExpertParallel, AMissingRankStopsTheGroupOnce) {
  using std::chrono::steady_clock;
  constexpr double kTimeout = 1.5;  // seconds; read when the group is made
  ASSERT_EQ(setenv("MOEGRAPH_EP_TIMEOUT_MS", "1500", 1), 0);
  for (const EpCase& c : {kEpCases[0], kEpCases[5]}) {
    EpRanks ranks = emulated(c);
    EpHarness h(c, 53, ranks);
    h.set_inputs(std::vector<int64_t>(c.ranks, c.max_tokens));
    auto& all = h.local();
    const int late = c.ranks - 1;
    const auto step_all_but_late = [&] {
      const auto t0 = steady_clock::now();
      on_threads(late, [&](int r) { all[r]->train_step(); });
      h.sync();
      return std::chrono::duration<double>(steady_clock::now() - t0).count();
    };
    const auto expect_error = [&](LayerSlot& s, const std::string& said, const std::string& when) {
      try {
        s.layer->check_device_errors(s.stream.get());
        ADD_FAILURE() << c.name << " " << when << ": rank " << s.rank << " reported nothing";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kDeviceSplits);
        EXPECT_NE(std::string(e.what()).find(said), std::string::npos) << c.name << " " << when << ": " << e.what();
      }
    };
    double seconds = step_all_but_late();
    EXPECT_GT(seconds, 0.9 * kTimeout) << c.name << ": the first barrier did not wait";
    EXPECT_LT(seconds, 1.6 * kTimeout) << c.name << ": the step waited more than once";
    for (int r = 0; r < late; ++r)
      expect_error(*all[r], detail::concat("rank ", late, " of the expert-parallel group did not reach barrier"),
                   "first step");
    seconds = step_all_but_late();
    EXPECT_LT(seconds, 0.5 * kTimeout) << c.name << ": a stopped rank waited";
    for (int r = 0; r < late; ++r)
      expect_error(*all[r], "exchanges of this expert-parallel group stopped", "next step");
    const auto t0 = steady_clock::now();
    all[late]->train_step();
    h.sync();
    EXPECT_LT(std::chrono::duration<double>(steady_clock::now() - t0).count(), 0.5 * kTimeout)
        << c.name << ": the late rank waited";
    expect_error(*all[late], "had stopped exchanging", "late rank");
  }
  unsetenv("MOEGRAPH_EP_TIMEOUT_MS");
}

// A server's way out of a dead peer: wait() gives up on a step that a missing rank holds, abort()
// then refuses every later call with that communicator, and everything tears down without the
// missing rank. (On emulated ranks the barrier's own timeout ends the step; NCCL's abort also ends
// send/recv kernels, which only real ranks can show.)
TEST(ExpertParallel, WaitGivesUpOnAMissingRankAndAbortRefusesLaterCalls) {
  using std::chrono::steady_clock;
  ASSERT_EQ(setenv("MOEGRAPH_EP_TIMEOUT_MS", "1500", 1), 0);
  const EpCase& c = kEpCases[0];
  {
    EpRanks ranks = emulated(c);
    EpHarness h(c, 59, ranks);
    h.set_inputs(std::vector<int64_t>(c.ranks, c.max_tokens));
    auto& all = h.local();
    const int late = c.ranks - 1;
    for (auto& s : all)
      EXPECT_EQ(s->comm->wait(s->stream.get(), 0), EpComm::WaitResult::kDone) << "an idle stream, rank " << s->rank;
    on_threads(late, [&](int r) { all[r]->train_step(); });
    LayerSlot& first = *all[0];
    auto t0 = steady_clock::now();
    EXPECT_EQ(first.comm->wait(first.stream.get(), 200), EpComm::WaitResult::kTimedOut);
    const double waited = std::chrono::duration<double>(steady_clock::now() - t0).count();
    EXPECT_GT(waited, 0.19);
    EXPECT_LT(waited, 1.0) << "wait overran its deadline";
    for (int r = 0; r < late; ++r) all[r]->comm->abort();
    for (int r = 0; r < late; ++r) all[r]->comm->abort();  // a second call does nothing
    // The barrier's own timeout ends the step on emulated ranks.
    EXPECT_EQ(first.comm->wait(first.stream.get(), 10000), EpComm::WaitResult::kDone);
    h.sync();
    for (int r = 0; r < late; ++r) {
      EXPECT_TRUE(all[r]->comm->aborted());
      try {
        all[r]->train_step();
        ADD_FAILURE() << "rank " << r << ": a step on an aborted communicator ran";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("was aborted"), std::string::npos) << e.what();
      }
      EXPECT_THROW(all[r]->comm->allocate_window(1024), Error);
    }
    EXPECT_FALSE(all[late]->comm->aborted());
  }  // every layer and the group torn down with ranks aborted
  unsetenv("MOEGRAPH_EP_TIMEOUT_MS");
}

TEST(ExpertParallel, ReceiveBoundCountsDrops) {
  for (EpCase c : {kEpCases[0], kEpCases[4]}) ep_receive_bound(c, emulated(c));
}

TEST(ExpertParallel, SendRecvChunkBoundCountsDrops) {
  for (EpCase c : {kEpCases[0], kEpCases[1]}) ep_chunk_bound(c, emulated(c));
}

// Emulated ranks share a process, so each rank's StepGraphs captures in thread-local mode (another
// rank's thread synchronizes meanwhile); the NCCL tests capture in global mode.
TEST(ExpertParallel, StepGraphsReplaysMatchTheLayers) {
  for (const EpCase& c : {kEpCases[0], kEpCases[1], kEpCases[4]})
    ep_step_graphs(c, emulated(c), cudaStreamCaptureModeThreadLocal);
}

TEST(ExpertParallel, OptionsAreChecked) {
  MoeLayerOptions o = ep_options(kEpCases[0], 2);
  o.experts = 9;
  EXPECT_THROW(validate(o), Error);
  o = ep_options(kEpCases[0], 2);
  o.capacity_factor = 1.0;
  EXPECT_THROW(validate(o), Error);
  // One receive bound serves every bucket: above a bucket's worst case it is accepted and the
  // buffers hold that worst case; it must keep the row alignment.
  o = ep_options(kEpCases[0], 2);
  o.ep_recv_rows = moe_ep_worst_case_rows(o) + 1;
  EXPECT_NO_THROW(validate(o));
  EXPECT_EQ(moe_expert_rows(o), moe_ep_worst_case_rows(o));
  o = ep_options(kEpCases[1], 4);
  o.ep_recv_rows = 16 * 3 + 8;
  EXPECT_THROW(validate(o), Error);
  o.ep_recv_rows = 16 * 3;
  EXPECT_NO_THROW(validate(o));
  EXPECT_EQ(moe_expert_rows(o), 16 * 3);
  o = ep_options(kEpCases[0], 2);
  const MoeLayerWeights none{};
  EXPECT_THROW({ MoeLayer layer(o, none, nullptr, nullptr); }, Error);  // no communicator
  o = ep_options(kEpCases[4], 2);
  o.ep_chunk_rows = -1;
  EXPECT_THROW(validate(o), Error);
  o = ep_options(kEpCases[0], 1);
  o.ep_exchange = EpExchange::kSendRecv;
  EXPECT_THROW(validate(o), Error);  // send/recv without expert parallelism
  o = ep_options(kEpCases[0], 2);
  EmulatedEpGroup four(4);
  EXPECT_THROW({ MoeLayer layer(o, none, nullptr, four.rank(0)); }, Error);  // a group of the wrong size
}

}  // namespace
}  // namespace moegraph::test
