// Expert parallelism over NCCL on real ranks: one process per GPU, started by scripts/launch
// (scripts/gpu-ep-suite runs R = 2 and 4 where a multi-GPU machine is lent). Every process builds
// the global batch from the same seed, runs its rank of the EP layer and checks its share against
// the fp64 reference and the single-GPU layer (tests/common/ep_harness.hpp: the scenarios the
// emulated ranks run too). Without the launcher's environment it runs as a group of one on GPU 0:
// the transport tests (windows through NCCL, the peer table, the device barrier over NCCL memory)
// run, the layer tests need two ranks and are skipped.
#include <gtest/gtest.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/comm/ep_exchange.hpp"
#include "moegraph/error.hpp"
#include "moegraph/nccl_ep.hpp"
#include "testing/device_array.hpp"
#include "tests/common/ep_harness.hpp"
#include "tests/common/ep_shard_harness.hpp"
#include "tests/common/shard_harness.hpp"

namespace moegraph::test {
namespace {

std::shared_ptr<NcclEpComm> g_comm;

// Sums a host vector over the group (fp64 all-reduce).
void sum_over_group(Mat& v) {
  DeviceArray<double> d(v.size());
  d.upload(v);
  testing::Stream s;
  if (ncclAllReduce(d.get(), d.get(), v.size(), ncclFloat64, ncclSum, g_comm->nccl(), s.get()) != ncclSuccess)
    MG_FAIL("ncclAllReduce failed");
  MG_CUDA_CHECK(cudaStreamSynchronize(s.get()));
  v = d.download();
}

EpRanks this_rank() {
  EpRanks r;
  r.comms.push_back(g_comm);
  r.sum_over_processes = sum_over_group;
  return r;
}

// Every rank stores a pattern naming itself into its slot of every rank's window (through the peer
// table, as the exchange kernels do), a device barrier over a second window's flags, then each
// rank reads R slots written by R ranks. 50 more barrier rounds must neither time out nor skew.
TEST(NcclTransport, WindowsReachEveryRankThroughTheBarrier) {
  const int R = g_comm->ranks(), me = g_comm->rank();
  constexpr std::size_t kSlot = 4096 + 64;  // not a multiple of the window granularity
  auto data = g_comm->allocate_window(kSlot * R);
  auto flags = g_comm->allocate_window(sizeof(uint32_t) * R);
  ASSERT_EQ(data->ranks(), R);
  std::vector<uint8_t> mine(kSlot);
  for (std::size_t i = 0; i < kSlot; ++i) mine[i] = static_cast<uint8_t>(me * 37 + i * 11 + 1);
  for (int d = 0; d < R; ++d)
    MG_CUDA_CHECK(cudaMemcpy(static_cast<char*>(data->peer(d)) + me * kSlot, mine.data(), kSlot, cudaMemcpyDefault));
  DeviceArray<uint32_t> epoch(1);
  DeviceArray<DeviceErrorRecord> error(1);
  testing::memset_and_wait(epoch.get(), 0, sizeof(uint32_t));
  testing::memset_and_wait(error.get(), 0, sizeof(DeviceErrorRecord));
  kernels::EpBarrierParams p;
  for (int d = 0; d < R; ++d) p.flags.base[d] = static_cast<char*>(flags->peer(d));
  p.epoch = epoch.get(), p.rank = me, p.ranks = R, p.timeout_ns = g_comm->barrier_timeout_ns();
  p.error = error.get();
  testing::Stream s;
  kernels::launch_ep_barrier(p, s.get());
  MG_CUDA_CHECK(cudaStreamSynchronize(s.get()));
  std::vector<uint8_t> got(kSlot * R);
  MG_CUDA_CHECK(cudaMemcpy(got.data(), data->local(), got.size(), cudaMemcpyDefault));
  for (int src = 0; src < R; ++src)
    for (std::size_t i = 0; i < kSlot; ++i)
      ASSERT_EQ(got[src * kSlot + i], static_cast<uint8_t>(src * 37 + i * 11 + 1)) << "slot of rank " << src;
  for (int round = 0; round < 50; ++round) kernels::launch_ep_barrier(p, s.get());
  MG_CUDA_CHECK(cudaStreamSynchronize(s.get()));
  EXPECT_EQ(error.download()[0].code, kDeviceErrorNone);
  EXPECT_EQ(epoch.download()[0], 51u);
  // The flags this rank received: one per peer, each at the last epoch.
  std::vector<uint32_t> f(R);
  MG_CUDA_CHECK(cudaMemcpy(f.data(), flags->local(), sizeof(uint32_t) * R, cudaMemcpyDefault));
  for (int d = 0; d < R; ++d) EXPECT_EQ(f[d], 51u) << "flag from rank " << d;
}

// The cases of the emulated suite, by group size; a launch of R ranks runs those with R ranks.
const EpCase kCases[] = {
    // name                  R  E   k  H    F    T   bias   sigm   renorm align mg     delay
    {"r2_e8_top2_bias", 2, 8, 2, 128, 64, 48, true, false, true, 1, true, false},
    {"r2_e4_top1_odd", 2, 4, 1, 64, 32, 33, false, false, false, 1, true, true},
    {"r4_e16_top4_align16", 4, 16, 4, 128, 128, 40, false, true, true, 16, false, true},
    {"r4_e64_top8_bias_align32", 4, 64, 8, 256, 64, 24, true, false, false, 32, true, false},
    {"r8_e64_top8_align16", 8, 64, 8, 128, 64, 32, false, false, true, 16, true, true},
    // The send/recv exchange: grouped ncclSend / ncclRecv of fixed chunks.
    {"r2_e8_top2_bias_send_recv", 2, 8, 2, 128, 64, 48, true, false, true, 1, true, false, EpExchange::kSendRecv},
    {"r4_e16_top4_align16_send_recv", 4, 16, 4, 128, 128, 40, false, true, true, 16, false, true,
     EpExchange::kSendRecv},
    {"r8_e64_top8_align16_send_recv", 8, 64, 8, 128, 64, 32, false, false, true, 16, true, true,
     EpExchange::kSendRecv},
};

std::vector<EpCase> cases_of_this_group() {
  std::vector<EpCase> out;
  for (const EpCase& c : kCases)
    if (c.ranks == g_comm->ranks()) out.push_back(c);
  return out;
}

#define FOR_EVERY_CASE(body)                                                                              \
  do {                                                                                                    \
    const auto cases = cases_of_this_group();                                                             \
    if (cases.empty()) GTEST_SKIP() << "no case for a group of " << g_comm->ranks()                       \
                                    << " (the layer tests run under scripts/launch -n 2, 4 or 8)";        \
    for (const EpCase& c : cases) {                                                                       \
      SCOPED_TRACE(c.name);                                                                               \
      body;                                                                                               \
    }                                                                                                     \
  } while (0)

TEST(NcclExpertParallel, EagerStepsMatchTheWholeLayer) { FOR_EVERY_CASE(ep_eager_steps(c, this_rank())); }
TEST(NcclExpertParallel, GraphReplaysMatchTheWholeLayer) { FOR_EVERY_CASE(ep_graph_replays(c, this_rank())); }
TEST(NcclExpertParallel, AllTokensToOneExpert) { FOR_EVERY_CASE(ep_all_tokens_to_one_expert(c, this_rank())); }
TEST(NcclExpertParallel, InvalidCountIsReportedOnEveryRank) { FOR_EVERY_CASE(ep_invalid_count(c, this_rank())); }
TEST(NcclExpertParallel, ReceiveBoundCountsDrops) { FOR_EVERY_CASE(ep_receive_bound(c, this_rank())); }
TEST(NcclExpertParallel, SendRecvChunkBoundCountsDrops) { FOR_EVERY_CASE(ep_chunk_bound(c, this_rank())); }
TEST(NcclExpertParallel, StepGraphsReplaysMatchTheLayers) {
  FOR_EVERY_CASE(ep_step_graphs(c, this_rank(), cudaStreamCaptureModeGlobal));
}

// Sharded expert weights over this group (the communicator serves as the data-parallel group):
// tests/common/shard_harness.hpp's cases of this many ranks, captured in global mode.
TEST(NcclShardedWeights, RanksMatchTheUnshardedStep) {
  bool ran = false;
  for (const ShardCase& c : kShardCases) {
    if (c.ranks != g_comm->ranks()) continue;
    run_shard_case(c, {g_comm}, cudaStreamCaptureModeGlobal);
    ran = true;
  }
  if (!ran) GTEST_SKIP() << "no sharding case for a group of " << g_comm->ranks();
}

// nccl_ep_comm_split: the ranks of one parity form a group, ordered by the key (reversed here).
TEST(NcclTransport, SplitGivesEachRankItsSubgroup) {
  const int rank = g_comm->rank(), ranks = g_comm->ranks();
  const int color = rank % 2, members = (ranks - color + 1) / 2;
  const auto sub = nccl_ep_comm_split(*g_comm, color, ranks - rank);
  EXPECT_EQ(sub->ranks(), members);
  EXPECT_EQ(sub->rank(), members - 1 - rank / 2);
  EXPECT_EQ(sub->device(), g_comm->device());
}

// A rank whose peers never come: rank 0 starts a send/recv exchange that the others never join.
// wait() gives up on it; abort() makes NCCL's kernel return, so the stream drains; then the window
// is released without a collective call and later calls are refused. Every rank aborts its own copy
// of the group (a split with one color), which is not collective. A group of one runs the part
// after the exchange.
TEST(NcclTransport, AbortEndsAnExchangeThatPeersNeverJoin) {
  const int R = g_comm->ranks(), me = g_comm->rank();
  auto sub = nccl_ep_comm_split(*g_comm, 0, me);
  constexpr std::size_t kChunk = 1 << 16;
  auto window = sub->allocate_window(kChunk * R);
  DeviceArray<uint8_t> send(kChunk * R);
  testing::Stream s;
  if (R >= 2) {  // one exchange with everyone first: NCCL connects the peers on first use, on the host
    sub->all_to_all(send.get(), window->local(), kChunk, nullptr, s.get());
    EXPECT_EQ(sub->wait(s.get(), 20000), EpComm::WaitResult::kDone);
  }
  if (R >= 2 && me == 0) {
    sub->all_to_all(send.get(), window->local(), kChunk, nullptr, s.get());
    EXPECT_EQ(sub->wait(s.get(), 500), EpComm::WaitResult::kTimedOut) << "the exchange finished without its peers";
  }
  sub->abort();
  EXPECT_TRUE(sub->aborted());
  EXPECT_EQ(sub->nccl(), nullptr);
  EXPECT_EQ(sub->wait(s.get(), 20000), EpComm::WaitResult::kDone) << "NCCL's kernel did not return after the abort";
  EXPECT_THROW(sub->allocate_window(1024), Error);
  EXPECT_THROW(sub->all_to_all(send.get(), window->local(), kChunk, nullptr, s.get()), Error);
  window.reset();  // no deregistration: it would wait for the peers
  sub.reset();
  EXPECT_FALSE(g_comm->aborted()) << "the parent is untouched";
}

// Sharded expert weights under expert parallelism: this group as an R x W grid (rank g at expert-
// parallel index g mod R and data-parallel index g / R), split into its rows and columns.
TEST(NcclShardedWeights, UnderExpertParallelismRanksMatchTheWholeLayers) {
  bool ran = false;
  for (const EpShardCase& c : kEpShardCases) {
    if (c.ep * c.dp != g_comm->ranks()) continue;
    const int g = g_comm->rank();
    GridRank at{g % c.ep, g / c.ep, nullptr, nullptr};
    at.ep = nccl_ep_comm_split(*g_comm, at.dp_index, at.ep_index);
    at.dp = nccl_ep_comm_split(*g_comm, at.ep_index, at.dp_index);
    run_ep_shard_case(c, {at}, cudaStreamCaptureModeGlobal);
    ran = true;
  }
  if (!ran) GTEST_SKIP() << "no expert-parallel sharding case for a group of " << g_comm->ranks();
}

// With several ranks, the first failed check ends this process (after the printer has shown it):
// a rank that went on would wait in the next collective for ranks that took another path, and the
// launcher stops the others once one has exited.
class ExitOnFailure : public ::testing::EmptyTestEventListener {
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fflush(stdout);
    std::_Exit(1);
  }
};

}  // namespace
}  // namespace moegraph::test

// Exits 77 (Meson's SKIP) without a CUDA device. A failing test on one rank must not leave the
// others waiting in a collective: each rank runs the same tests, and the device barriers time out
// (MOEGRAPH_EP_TIMEOUT_MS) rather than hang.
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped %d tests\n", ::testing::UnitTest::GetInstance()->total_test_count());
    return 77;
  }
  using namespace moegraph;
  try {
    if (nccl_ep_environment_present()) {
      test::g_comm = nccl_ep_comm_from_environment();
    } else {
      // A group of one. NCCL_NVLS_ENABLE=0 must come from the environment the process starts with
      // (meson's test definition sets it; a setenv here would be refused).
      MG_CUDA_CHECK(cudaSetDevice(0));
      test::g_comm = nccl_ep_comm_init(1, 0, nccl_unique_id_hex());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cannot create the NCCL communicator: %s\n", e.what());
    return 1;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, test::g_comm->device());
  std::printf("rank %d of %d on device %d (%s), transport: %s\n", test::g_comm->rank(), test::g_comm->ranks(),
              test::g_comm->device(), prop.name, test::g_comm->transport().c_str());
  if (test::g_comm->ranks() > 1)
    ::testing::UnitTest::GetInstance()->listeners().Append(new test::ExitOnFailure);  // gtest owns it
  const int status = RUN_ALL_TESTS();
  test::g_comm.reset();
  return status;
}
