// The expert-parallel receive plan (kernels/comm/ep_exchange.hpp, launch_ep_plan) at the sizes users
// run, against a host model written as the plan's definition: each source's counts clamped to its
// local rows in expert order, then each owner's greedy walk over (local expert, source) within
// recv_rows and chunk_rows. The kernel computes unbounded owners as prefix sums and walks only the
// owners whose bound binds; every table it writes is compared, for several ranks of each group.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
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

struct PlanCase {
  int ranks, experts, row_align;
  int64_t local_rows;
  int64_t recv_rows;   // 0: the worst case (nothing dropped)
  int64_t chunk_rows;  // 0: no bound
  bool garbage;        // one source's counts negative or past its local rows (clamped), its token count invalid
  int stride_pad;      // elements between matrix rows beyond experts + 1 (send/recv pads them)
  std::string name;
  int stride() const { return experts + 1 + stride_pad; }
};

struct HostPlan {
  std::vector<int32_t> splits;
  std::vector<int64_t> offsets, owner_prefix, source_prefix, gaps, drops;
  std::vector<kernels::EpSegment> to_owner, to_source;
  uint64_t dropped = 0;
};

HostPlan host_plan(const std::vector<int32_t>& matrix, const PlanCase& c, int64_t recv_rows, int rank) {
  const int R = c.ranks, E = c.experts, L = E / R;
  const int64_t chunk = c.chunk_rows > 0 ? c.chunk_rows : c.local_rows;
  std::vector<int64_t> want(R * E), base(R * E), at(R * E), kept(R * E);
  for (int s = 0; s < R; ++s)
    for (int e = 0, b = 0; e < E; ++e) {
      const int64_t w = std::min<int64_t>(std::max(matrix[s * c.stride() + e], 0), c.local_rows - b);
      want[s * E + e] = w, base[s * E + e] = b;
      b += static_cast<int>(w);
    }
  HostPlan h;
  h.splits.resize(L), h.offsets.resize(L + 1);
  for (int d = 0; d < R; ++d) {
    std::vector<int64_t> sent(R, 0);
    int64_t off = 0;
    for (int l = 0; l < L; ++l) {
      const int e = d * L + l;
      const int64_t start = off;
      for (int s = 0; s < R; ++s) {
        const int64_t take = std::min({want[s * E + e], recv_rows - off, chunk - sent[s]});
        sent[s] += take, at[s * E + e] = off, kept[s * E + e] = take, off += take;
      }
      if (d == rank) h.splits[l] = static_cast<int32_t>(off - start), h.offsets[l] = start;
      off = (off + c.row_align - 1) / c.row_align * c.row_align;
    }
    if (d == rank) h.offsets[L] = off;
  }
  h.to_owner.resize(E), h.to_source.resize(E), h.drops.resize(2 * E), h.gaps.resize(2 * L);
  h.owner_prefix.assign(E + 1, 0), h.source_prefix.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) {
    const int i = rank * E + e;
    h.to_owner[e] = {base[i], at[i], kept[i], e / L, 0};
    h.drops[2 * e] = base[i] + kept[i], h.drops[2 * e + 1] = base[i] + want[i];
    h.dropped += static_cast<uint64_t>(want[i] - kept[i]);
    const int s = e / L, j = s * E + rank * L + e % L;
    h.to_source[e] = {at[j], base[j], kept[j], s, 0};
    h.owner_prefix[e + 1] = h.owner_prefix[e] + kept[i];
    h.source_prefix[e + 1] = h.source_prefix[e] + kept[j];
  }
  for (int l = 0; l < L; ++l) h.gaps[2 * l] = h.offsets[l] + h.splits[l], h.gaps[2 * l + 1] = h.offsets[l + 1];
  return h;
}

// Owners whose receive or chunk bound binds (the kernel walks those greedily).
int bound_owners(const std::vector<int32_t>& matrix, const PlanCase& c, int64_t recv_rows) {
  PlanCase unbounded = c;
  unbounded.chunk_rows = 0;
  const int64_t worst = std::numeric_limits<int32_t>::max();
  int bound = 0;
  for (int d = 0; d < c.ranks; ++d) {
    const HostPlan with = host_plan(matrix, c, recv_rows, d), without = host_plan(matrix, unbounded, worst, d);
    bound += with.splits != without.splits || with.offsets != without.offsets ? 1 : 0;
  }
  return bound;
}

void expect_segments(const std::vector<kernels::EpSegment>& got, const std::vector<kernels::EpSegment>& want,
                     const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].src_row, want[i].src_row) << what << " segment " << i;
    EXPECT_EQ(got[i].dst_row, want[i].dst_row) << what << " segment " << i;
    EXPECT_EQ(got[i].rows, want[i].rows) << what << " segment " << i;
    EXPECT_EQ(got[i].peer, want[i].peer) << what << " segment " << i;
  }
}

class EpPlanCase : public ::testing::TestWithParam<PlanCase> {};

TEST_P(EpPlanCase, TablesMatchTheGreedyDefinition) {
  const PlanCase& c = GetParam();
  const int R = c.ranks, E = c.experts, L = E / R;
  std::mt19937_64 rng(11 + R * 1000 + E);
  // Counts per (source, expert): skewed (a few hot experts), some zero, each source's sum at most
  // local_rows, and fewer rows on later sources.
  std::vector<int32_t> matrix(R * c.stride(), -77);  // the padding: never read
  const int garbage_source = c.garbage ? R / 2 : -1;
  for (int s = 0; s < R; ++s) {
    std::fill_n(matrix.begin() + s * c.stride(), E, 0);
    const int64_t rows = c.local_rows - (c.local_rows / 4) * s / R;
    for (int64_t i = 0; i < rows; ++i) {
      const int e = (rng() % 4 == 0) ? static_cast<int>(rng() % 3) * (E / 3) : static_cast<int>(rng() % E);
      ++matrix[s * c.stride() + e];
    }
    matrix[s * c.stride() + E] = s == garbage_source ? -1 : 7;  // the token count (max_tokens 8)
  }
  if (c.garbage)
    for (int e = 0; e < E; ++e)
      matrix[garbage_source * c.stride() + e] = e % 3 == 0 ? -5 : static_cast<int32_t>(c.local_rows / 3);
  const int64_t worst = (R * c.local_rows + L * (c.row_align - 1) + c.row_align - 1) / c.row_align * c.row_align;
  const int64_t recv_rows = c.recv_rows > 0 ? c.recv_rows : worst;
  DeviceArray<int32_t> d_matrix(matrix.size()), scratch(4 * R * E), splits(L);
  d_matrix.upload(matrix);
  DeviceArray<int64_t> offsets(L + 1), owner_prefix(E + 1), source_prefix(E + 1), gaps(2 * L), drops(2 * E);
  DeviceArray<kernels::EpSegment> to_owner(E), to_source(E);
  DeviceArray<unsigned long long> dropped(1);
  DeviceArray<DeviceErrorRecord> error(1);
  for (int rank : {0, R / 2, R - 1}) {
    const std::string where = c.name + " rank " + std::to_string(rank);
    splits.poison(), offsets.poison(), owner_prefix.poison(), source_prefix.poison(), gaps.poison(), drops.poison();
    to_owner.poison(), to_source.poison(), scratch.poison();
    testing::memset_and_wait(dropped.get(), 0, sizeof(unsigned long long));
    testing::memset_and_wait(error.get(), 0, sizeof(DeviceErrorRecord));
    kernels::EpPlanParams p;
    p.matrix = d_matrix.get(), p.rank = rank, p.ranks = R, p.experts = E, p.row_align = c.row_align;
    p.max_tokens = 8, p.local_rows = c.local_rows, p.recv_rows = recv_rows, p.chunk_rows = c.chunk_rows;
    p.matrix_stride = c.stride();
    p.splits = splits.get(), p.offsets = offsets.get();
    p.to_owner = to_owner.get(), p.to_owner_prefix = owner_prefix.get();
    p.to_source = to_source.get(), p.to_source_prefix = source_prefix.get();
    p.recv_gaps = gaps.get(), p.dropped_rows = drops.get(), p.scratch = scratch.get();
    p.dropped = dropped.get(), p.error = error.get();
    testing::Stream stream;
    kernels::launch_ep_plan(p, stream.get());
    MG_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    const HostPlan h = host_plan(matrix, c, recv_rows, rank);
    EXPECT_EQ(splits.download(), h.splits) << where;
    EXPECT_EQ(offsets.download(), h.offsets) << where;
    EXPECT_EQ(owner_prefix.download(), h.owner_prefix) << where;
    EXPECT_EQ(source_prefix.download(), h.source_prefix) << where;
    EXPECT_EQ(gaps.download(), h.gaps) << where;
    EXPECT_EQ(drops.download(), h.drops) << where;
    expect_segments(to_owner.download(), h.to_owner, where + " to_owner");
    expect_segments(to_source.download(), h.to_source, where + " to_source");
    EXPECT_EQ(dropped.download()[0], h.dropped) << where;
    // Another source's invalid token count is reported (group: that source); a rank's own is not
    // checked here (its counts were computed on the clamped count).
    const DeviceErrorRecord e = error.download()[0];
    if (c.garbage && rank != garbage_source) {
      EXPECT_EQ(e.code, kDeviceErrorPeerTokenCount) << where;
      EXPECT_EQ(e.group, garbage_source) << where;
    } else {
      EXPECT_EQ(e.code, kDeviceErrorNone) << where;
    }
  }
  // A bounded case must have owners of both kinds (bound: walked greedily, dropping rows; not:
  // prefix sums), or it would test only one of the kernel's two ways to lay out an owner.
  if (c.recv_rows > 0 || c.chunk_rows > 0) {
    const int bound = bound_owners(matrix, c, recv_rows);
    EXPECT_GT(bound, 0) << c.name;
    EXPECT_LT(bound, R) << c.name;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, EpPlanCase,
    ::testing::Values(PlanCase{8, 256, 16, 512, 0, 0, false, 0, "r8_e256_unbounded"},
                      PlanCase{4, 1024, 1, 2048, 0, 0, false, 0, "r4_e1024_unbounded"},
                      PlanCase{64, 128, 8, 96, 0, 0, false, 0, "r64_e128_unbounded"},
                      PlanCase{2, 2, 128, 40, 0, 0, false, 0, "r2_e2_unbounded"},
                      PlanCase{8, 256, 16, 512, 0, 0, true, 0, "r8_e256_garbage_counts"},
                      PlanCase{8, 256, 16, 512, 640, 0, false, 0, "r8_e256_receive_bound"},
                      PlanCase{8, 64, 8, 512, 0, 64, false, 3, "r8_e64_chunk_bound_padded_rows"},
                      PlanCase{64, 128, 8, 96, 512, 0, false, 0, "r64_e128_receive_bound"}),
    [](const ::testing::TestParamInfo<PlanCase>& i) { return i.param.name; });

}  // namespace
}  // namespace moegraph::test
