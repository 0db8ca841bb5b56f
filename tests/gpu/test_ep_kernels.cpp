// The expert-parallel exchange kernels on their own (kernels/comm/ep_exchange.hpp), with R windows
// of one GPU and each rank on its own stream: the device barrier (every rank passes, none times
// out, across many rounds; a missing rank's timeout stops the link, and then its late peer), a
// stopped link storing into no peer, and a plan + row exchange against a host model of the layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "kernels/comm/ep_exchange.hpp"
#include "moegraph/error.hpp"
#include "testing/device_array.hpp"
#include "testing/graph.hpp"

namespace moegraph::test {
namespace {

using testing::DeviceArray;

struct Windows {
  int ranks;
  std::vector<DeviceArray<uint32_t>> flags, epoch;
  std::vector<DeviceArray<DeviceErrorRecord>> errors;
  explicit Windows(int r) : ranks(r) {
    for (int i = 0; i < r; ++i) {
      flags.emplace_back(r), epoch.emplace_back(1), errors.emplace_back(1);
      testing::memset_and_wait(flags.back().get(), 0, r * sizeof(uint32_t));
      testing::memset_and_wait(epoch.back().get(), 0, sizeof(uint32_t));
      testing::memset_and_wait(errors.back().get(), 0, sizeof(DeviceErrorRecord));
    }
  }
  kernels::EpBarrierParams params(int rank) {
    kernels::EpBarrierParams p;
    for (int i = 0; i < ranks; ++i) p.flags.base[i] = reinterpret_cast<char*>(flags[i].get());
    p.epoch = epoch[rank].get();
    p.rank = rank, p.ranks = ranks;
    p.timeout_ns = 3'000'000'000LL;
    p.error = errors[rank].get();
    return p;
  }
};

TEST(EpKernels, BarrierRoundsOnConcurrentStreams) {
  for (int ranks : {2, 4}) {
    Windows w(ranks);
    std::vector<std::unique_ptr<testing::Stream>> streams;
    for (int r = 0; r < ranks; ++r) streams.push_back(std::make_unique<testing::Stream>());
    for (int round = 0; round < 50; ++round)
      for (int r = 0; r < ranks; ++r) kernels::launch_ep_barrier(w.params(r), streams[r]->get());
    MG_CUDA_CHECK(cudaDeviceSynchronize());
    for (int r = 0; r < ranks; ++r) {
      EXPECT_EQ(w.errors[r].download()[0].code, kDeviceErrorNone) << "rank " << r << " of " << ranks;
      EXPECT_EQ(w.epoch[r].download()[0], 50u);
    }
  }
}

void expect_record(const DeviceArray<DeviceErrorRecord>& record, int32_t code, int32_t group, int64_t value,
                   int64_t limit, const std::string& where) {
  const DeviceErrorRecord e = record.download()[0];
  EXPECT_EQ(e.code, code) << where;
  EXPECT_EQ(e.group, group) << where;
  EXPECT_EQ(e.value, value) << where;
  EXPECT_EQ(e.limit, limit) << where;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Rank 1 never comes: rank 0 times out once, and its link stops. Its later barriers wait for nobody
// (their timeout would outlast the test's check) and say so, and rank 1, arriving late, stops at
// once on rank 0's flag instead of passing a barrier whose rows never came.
TEST(EpKernels, ATimeoutStopsTheLinkAndThenItsPeer) {
  using std::chrono::steady_clock;
  constexpr int64_t kLong = 20'000'000'000LL;  // 20 s: a barrier that waits fails the time checks
  Windows w(2);
  testing::Stream s0, s1;
  kernels::EpBarrierParams p0 = w.params(0);
  p0.timeout_ns = 100'000'000;
  kernels::launch_ep_barrier(p0, s0.get());
  MG_CUDA_CHECK(cudaStreamSynchronize(s0.get()));
  expect_record(w.errors[0], kDeviceErrorPeerTimeout, 1, 1, 100, "rank 0's timeout");
  EXPECT_EQ(w.epoch[0].download()[0], 1u | kernels::kEpLinkStopped);

  testing::memset_and_wait(w.errors[0].get(), 0, sizeof(DeviceErrorRecord));  // as the host's read does
  p0.timeout_ns = kLong;
  auto t0 = steady_clock::now();
  kernels::launch_ep_barrier(p0, s0.get());
  MG_CUDA_CHECK(cudaStreamSynchronize(s0.get()));
  EXPECT_LT(seconds_since(t0), 5.0) << "a stopped link's barrier waited";
  expect_record(w.errors[0], kDeviceErrorExchangeStopped, 0, 2, 0, "rank 0's next barrier");
  EXPECT_EQ(w.flags[1].download()[0], 2u | kernels::kEpLinkStopped) << "rank 0's flag in rank 1's window";

  kernels::EpBarrierParams p1 = w.params(1);
  p1.timeout_ns = kLong;
  t0 = steady_clock::now();
  kernels::launch_ep_barrier(p1, s1.get());
  MG_CUDA_CHECK(cudaStreamSynchronize(s1.get()));
  EXPECT_LT(seconds_since(t0), 5.0) << "the late rank waited for its stopped peer";
  expect_record(w.errors[1], kDeviceErrorPeerStopped, 0, 1, 0, "the late rank 1");
  EXPECT_EQ(w.epoch[1].download()[0], 1u | kernels::kEpLinkStopped);
}

// A stopped link stores into no peer (counts, rows, emulated chunks), while this rank's own row and
// its local zeroing still happen; the same calls on a running link do store (the check can fail).
TEST(EpKernels, AStoppedLinkStoresIntoNoPeer) {
  constexpr int kE = 4, kWords = 4, kRows = 6;  // 16-byte rows
  DeviceArray<uint32_t> link(1);
  DeviceArray<int32_t> counts(kE), tokens(1);
  counts.upload({3, 1, 4, 1});
  tokens.upload({5});
  DeviceArray<int32_t> src(kRows * kWords);
  std::vector<int32_t> rows(kRows * kWords);
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<int32_t>(1000 + i);
  src.upload(rows);
  DeviceArray<kernels::EpSegment> segment(1);
  segment.upload({kernels::EpSegment{0, 0, 4, 1, 0}});  // rows 0..3 to rows 0..3 of rank 1
  DeviceArray<int64_t> prefix(2), zero(2);
  prefix.upload({0, 4});
  zero.upload({4, 6});  // rows 4, 5 of rank 0's own destination
  testing::Stream s;
  for (const bool stopped : {true, false}) {
    const std::string where = stopped ? "stopped" : "running";
    testing::memset_and_wait(link.get(), 0, sizeof(uint32_t));
    if (stopped) link.upload({kernels::kEpLinkStopped | 7u});
    std::vector<DeviceArray<int32_t>> matrix, dst, chunks;
    kernels::PeerBases m, d, c;
    for (int r = 0; r < 2; ++r) {
      matrix.emplace_back(2 * (kE + 1)), dst.emplace_back(kRows * kWords), chunks.emplace_back(2 * kWords);
      matrix.back().poison(), dst.back().poison(), chunks.back().poison();
      m.base[r] = reinterpret_cast<char*>(matrix.back().get());
      d.base[r] = reinterpret_cast<char*>(dst.back().get());
      c.base[r] = reinterpret_cast<char*>(chunks.back().get());
    }
    kernels::launch_ep_share_counts(counts.get(), tokens.get(), kE, 0, 2, m, link.get(), s.get());
    kernels::EpExchangeParams x;
    x.src = src.get(), x.row_bytes = kWords * sizeof(int32_t), x.dst = d;
    x.segments = segment.get(), x.prefix = prefix.get(), x.count = 1;
    x.zero_ranges = zero.get(), x.zero_count = 1, x.local_dst = dst[0].get(), x.max_rows = 4;
    x.link = link.get();
    kernels::launch_ep_exchange(x, s.get());
    kernels::launch_ep_push_chunks(src.get(), c, kWords * sizeof(int32_t), 0, 2, link.get(), s.get());
    MG_CUDA_CHECK(cudaStreamSynchronize(s.get()));

    const std::vector<int32_t> row0 = {3, 1, 4, 1, 5};
    const std::vector<int32_t> m0 = matrix[0].download(), m1 = matrix[1].download();
    EXPECT_EQ(std::vector<int32_t>(m0.begin(), m0.begin() + kE + 1), row0) << where << ": the own row";
    EXPECT_EQ(std::vector<int32_t>(m1.begin(), m1.begin() + kE + 1),
              stopped ? std::vector<int32_t>(kE + 1, -1) : row0) << where << ": rank 1's matrix";
    const std::vector<int32_t> d0 = dst[0].download(), d1 = dst[1].download();
    EXPECT_EQ(std::vector<int32_t>(d0.begin() + 4 * kWords, d0.end()), std::vector<int32_t>(2 * kWords, 0))
        << where << ": the local zeroing";
    const std::vector<int32_t> sent(rows.begin(), rows.begin() + 4 * kWords);
    EXPECT_EQ(std::vector<int32_t>(d1.begin(), d1.begin() + 4 * kWords),
              stopped ? std::vector<int32_t>(4 * kWords, -1) : sent)
        << where << ": rank 1's rows";
    const std::vector<int32_t> c1 = chunks[1].download();
    EXPECT_EQ(std::vector<int32_t>(c1.begin(), c1.begin() + kWords),
              stopped ? std::vector<int32_t>(kWords, -1)
                      : std::vector<int32_t>(rows.begin() + kWords, rows.begin() + 2 * kWords))
        << where << ": the chunk rank 0 pushes to rank 1";
  }
}

// The plan and the row stores of R ranks run one after another on one stream (so no barrier is
// needed, and the sanitizer can run them): every row lands where a host model of the layout says,
// alignment gaps and dropped rows are zero, and the rows that come back are the rows that left.
// The unbounded round sends from a sorted buffer; the bounded one gathers the same rows from a
// scattered copy (EpExchangeParams::src_rows), so both ways of reading the source are checked.
TEST(EpKernels, PlanAndRowsMatchAHostModel) {
  constexpr int R = 3, E = 6, L = E / R, kAlign = 4, kWords = 4;  // rows of 16 bytes
  constexpr int64_t kLocalRows = 24;
  std::mt19937_64 rng(5);
  for (int64_t bound : {int64_t{0}, int64_t{16}}) {
    // Counts per (rank, expert), some zero, each rank's sum at most kLocalRows.
    std::vector<std::vector<int32_t>> counts(R, std::vector<int32_t>(E, 0));
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kLocalRows - 3 * r; ++i) ++counts[r][rng() % (r == 1 ? 2 : E)];
    // Host model: local bases, then each owner's greedy layout.
    std::vector<std::vector<int64_t>> base(R, std::vector<int64_t>(E)), at(R, std::vector<int64_t>(E)),
        kept(R, std::vector<int64_t>(E));
    for (int r = 0; r < R; ++r)
      for (int e = 0, b = 0; e < E; b += counts[r][e], ++e) base[r][e] = b;
    const int64_t recv_rows = bound > 0 ? bound : (R * kLocalRows + L * (kAlign - 1) + kAlign - 1) / kAlign * kAlign;
    std::vector<std::vector<int64_t>> offsets(R, std::vector<int64_t>(L + 1));
    std::vector<std::vector<int32_t>> splits(R, std::vector<int32_t>(L));
    uint64_t expected_dropped[R] = {};
    for (int d = 0; d < R; ++d) {
      int64_t off = 0;
      for (int l = 0; l < L; ++l) {
        offsets[d][l] = off;
        for (int s = 0; s < R; ++s) {
          const int e = d * L + l;
          at[s][e] = off;
          kept[s][e] = std::min<int64_t>(counts[s][e], recv_rows - off);
          expected_dropped[s] += counts[s][e] - kept[s][e];
          off += kept[s][e];
        }
        splits[d][l] = static_cast<int32_t>(off - offsets[d][l]);
        off = (off + kAlign - 1) / kAlign * kAlign;
      }
      offsets[d][L] = off;
    }

    struct Rank {
      DeviceArray<int32_t> counts{E}, tokens{1}, matrix{R * (E + 1)}, splits{L}, scratch{4 * R * E};
      DeviceArray<int64_t> offsets{L + 1}, owner_prefix{E + 1}, source_prefix{E + 1}, gaps{2 * L}, drops{2 * E};
      DeviceArray<kernels::EpSegment> to_owner{E}, to_source{E};
      DeviceArray<int32_t> send, recv, back;
      DeviceArray<int32_t> x, row_of_x{kLocalRows};  // the send rows scattered, and where each is
      DeviceArray<unsigned long long> dropped{1};
      DeviceArray<DeviceErrorRecord> error{1};
    };
    std::vector<Rank> ranks(R);
    kernels::PeerBases matrix, recv, back;
    for (int r = 0; r < R; ++r) {
      Rank& k = ranks[r];
      k.send = DeviceArray<int32_t>(kLocalRows * kWords), k.recv = DeviceArray<int32_t>(recv_rows * kWords);
      k.back = DeviceArray<int32_t>(kLocalRows * kWords);
      k.counts.upload(counts[r]);
      k.tokens.upload({7});
      std::vector<int32_t> rows(kLocalRows * kWords);
      for (int64_t i = 0; i < kLocalRows; ++i)
        for (int w = 0; w < kWords; ++w) rows[i * kWords + w] = static_cast<int32_t>(1000 * r + 10 * i + w + 1);
      k.send.upload(rows);
      // The same rows scattered (row i at (7 i + 3) mod 24, a bijection): the bounded round
      // gathers them along row_of_x, as the dispatch reads x in place.
      std::vector<int32_t> scattered(kLocalRows * kWords), where(kLocalRows);
      for (int64_t i = 0; i < kLocalRows; ++i) {
        where[i] = static_cast<int32_t>((7 * i + 3) % kLocalRows);
        for (int w = 0; w < kWords; ++w) scattered[where[i] * kWords + w] = rows[i * kWords + w];
      }
      k.x = DeviceArray<int32_t>(kLocalRows * kWords);
      k.x.upload(scattered);
      k.row_of_x.upload(where);
      k.recv.poison(), k.back.poison();
      testing::memset_and_wait(k.dropped.get(), 0, sizeof(unsigned long long));
      testing::memset_and_wait(k.error.get(), 0, sizeof(DeviceErrorRecord));
      matrix.base[r] = reinterpret_cast<char*>(k.matrix.get());
      recv.base[r] = reinterpret_cast<char*>(k.recv.get());
      back.base[r] = reinterpret_cast<char*>(k.back.get());
    }
    testing::Stream stream;
    for (int r = 0; r < R; ++r)
      kernels::launch_ep_share_counts(ranks[r].counts.get(), ranks[r].tokens.get(), E, r, R, matrix, nullptr,
                                      stream.get());
    for (int r = 0; r < R; ++r) {
      Rank& k = ranks[r];
      kernels::EpPlanParams p;
      p.matrix = k.matrix.get(), p.rank = r, p.ranks = R, p.experts = E, p.row_align = kAlign;
      p.max_tokens = 8, p.local_rows = kLocalRows, p.recv_rows = recv_rows;
      p.splits = k.splits.get(), p.offsets = k.offsets.get();
      p.to_owner = k.to_owner.get(), p.to_owner_prefix = k.owner_prefix.get();
      p.to_source = k.to_source.get(), p.to_source_prefix = k.source_prefix.get();
      p.recv_gaps = k.gaps.get(), p.dropped_rows = k.drops.get(), p.scratch = k.scratch.get();
      p.dropped = k.dropped.get(), p.error = k.error.get();
      kernels::launch_ep_plan(p, stream.get());
    }
    auto exchange = [&](int r, bool to_owner) {
      Rank& k = ranks[r];
      kernels::EpExchangeParams x;
      x.src = to_owner ? (bound > 0 ? k.x.get() : k.send.get()) : k.recv.get();
      x.src_rows = to_owner && bound > 0 ? k.row_of_x.get() : nullptr;
      x.row_bytes = kWords * sizeof(int32_t);
      x.dst = to_owner ? recv : back;
      x.segments = to_owner ? k.to_owner.get() : k.to_source.get();
      x.prefix = to_owner ? k.owner_prefix.get() : k.source_prefix.get();
      x.count = E, x.segments_per_peer = L, x.rank = r;  // each rank's walk starts at peer r + 1
      x.zero_ranges = to_owner ? k.gaps.get() : k.drops.get();
      x.zero_count = to_owner ? L : E;
      x.local_dst = to_owner ? k.recv.get() : k.back.get();
      x.max_rows = to_owner ? kLocalRows : recv_rows;
      kernels::launch_ep_exchange(x, stream.get());
    };
    for (int r = 0; r < R; ++r) exchange(r, true);
    for (int r = 0; r < R; ++r) exchange(r, false);
    MG_CUDA_CHECK(cudaStreamSynchronize(stream.get()));

    for (int d = 0; d < R; ++d) {
      const std::string where = "bound " + std::to_string(bound) + " rank " + std::to_string(d);
      EXPECT_EQ(ranks[d].splits.download(), splits[d]) << where;
      EXPECT_EQ(ranks[d].offsets.download(), offsets[d]) << where;
      EXPECT_EQ(ranks[d].dropped.download()[0], expected_dropped[d]) << where;
      EXPECT_EQ(ranks[d].error.download()[0].code, kDeviceErrorNone) << where;
      // Receive buffer: each (source, local expert) segment holds the source's rows; gaps are zero.
      const std::vector<int32_t> got = ranks[d].recv.download();
      std::vector<int> expected(recv_rows * kWords, -1);  // -1: never written (still poison)
      for (int l = 0; l < L; ++l) {
        for (int64_t row = offsets[d][l] + splits[d][l]; row < offsets[d][l + 1]; ++row)
          for (int w = 0; w < kWords; ++w) expected[row * kWords + w] = 0;
        for (int s = 0; s < R; ++s)
          for (int64_t i = 0; i < kept[s][d * L + l]; ++i)
            for (int w = 0; w < kWords; ++w)
              expected[(at[s][d * L + l] + i) * kWords + w] = static_cast<int>(1000 * s + 10 * (base[s][d * L + l] + i) + w + 1);
      }
      for (int64_t i = 0; i < offsets[d][L] * kWords; ++i)
        ASSERT_EQ(got[i], expected[i]) << where << " receive word " << i;
      // What came back: the rows that left, or zero where the owner dropped them.
      const std::vector<int32_t> sent = ranks[d].send.download(), returned = ranks[d].back.download();
      const int64_t used = base[d][E - 1] + counts[d][E - 1];
      for (int e = 0; e < E; ++e)
        for (int64_t i = 0; i < counts[d][e]; ++i)
          for (int w = 0; w < kWords; ++w) {
            const int64_t at_word = (base[d][e] + i) * kWords + w;
            ASSERT_EQ(returned[at_word], i < kept[d][e] ? sent[at_word] : 0) << where << " returned word " << at_word;
          }
      EXPECT_LE(used, kLocalRows);
    }
    if (bound > 0) {
      uint64_t total = 0;
      for (uint64_t v : expected_dropped) total += v;
      EXPECT_GT(total, 0u) << "the bound must drop rows for this test to mean anything";
    }
  }
}

}  // namespace
}  // namespace moegraph::test
