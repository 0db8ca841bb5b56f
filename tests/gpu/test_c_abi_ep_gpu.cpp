// The C ABI on the GPU, expert parallelism: two emulated ranks (mg_ep_emulated_group_create,
// mg_moe_layer_create_ep) against one layer holding every expert, bit for bit.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "moegraph/config.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/moegraph.h"
#include "moegraph/mxfp8_weights.hpp"
#include "moegraph/step_graphs.hpp"
#include "testing/graph.hpp"
#include "testing/step_weights.hpp"
#include "tests/common/expect.hpp"
#include "tests/gpu/c_abi_gpu_helpers.hpp"

namespace moegraph::test {
namespace {

using namespace c_abi_gpu;

// ---- Expert parallelism: emulated ranks through the C ABI -----------------------------------------

TEST(CAbiExpertParallelGpu, TwoRanksMatchTheWholeLayer) {
  constexpr int kRanks = 2, kExperts = 8, kLocal = kExperts / kRanks, kTopK = 2;
  constexpr int64_t kHidden = 128, kFfn = 64, kTokens = 48;  // kTokens per rank
  const int64_t counts[kRanks] = {kTokens, kTokens - 7};     // the ranks' token counts differ
  const int64_t h = kHidden, f = kFfn;
  const DType bf16 = DType::kBF16;
  std::mt19937_64 rng(test_seed("CAbiExpertParallelGpu.TwoRanksMatchTheWholeLayer"));
  // x and the router on grids: every logit is exact, so the ranks and the whole layer route alike.
  const Mat wr = grid_values(rng, kExperts * h, 64, 1.0 / 256);
  const Mat w1 = random_values(rng, kExperts * 2 * f * h, 1.0 / std::sqrt(double(h)), bf16);
  const Mat w2 = random_values(rng, kExperts * h * f, 1.0 / std::sqrt(double(f)), bf16);
  const Mat b1 = random_values(rng, kExperts * 2 * f, 0.1, bf16), b2 = random_values(rng, kExperts * h, 0.1, bf16);
  const auto slice = [](const Mat& m, std::size_t begin, std::size_t count) {
    return Mat(m.begin() + static_cast<std::ptrdiff_t>(begin), m.begin() + static_cast<std::ptrdiff_t>(begin + count));
  };

  mg_moe_layer_options o;
  mg_moe_layer_options_init(&o);
  o.experts = kExperts, o.hidden = kHidden, o.ffn = kFfn, o.top_k = kTopK, o.bias = 1, o.renormalize = 1;
  // Rank r holds experts [r * kLocal, (r + 1) * kLocal); the whole layer (rank -1) all of them.
  const auto make = [&](CLayer& l, int rank, mg_ep_comm* comm) {
    const int64_t first = rank < 0 ? 0 : rank * kLocal, experts = rank < 0 ? kExperts : kLocal;
    mg_moe_layer_options lo = o;
    lo.max_tokens = l.tokens = rank < 0 ? kRanks * kTokens : kTokens;
    lo.expert_parallel = rank < 0 ? 1 : kRanks;
    upload_bf16(l.wr, wr);
    upload_bf16(l.w1, slice(w1, first * 2 * f * h, experts * 2 * f * h));
    upload_bf16(l.w2, slice(w2, first * h * f, experts * h * f));
    upload_bf16(l.b1, slice(b1, first * 2 * f, experts * 2 * f));
    upload_bf16(l.b2, slice(b2, first * h, experts * h));
    l.db1 = DeviceArray<uint16_t>(experts * 2 * f), l.db2 = DeviceArray<uint16_t>(experts * h);
    l.mgr = DeviceArray<float>(kExperts * h);
    l.mg1 = DeviceArray<float>(experts * 2 * f * h), l.mg2 = DeviceArray<float>(experts * h * f);
    for (auto* a : {&l.x, &l.y, &l.dy, &l.dx}) *a = DeviceArray<uint16_t>(l.tokens * h);
    mg_moe_layer_weights w = sized<mg_moe_layer_weights>();
    w.router = l.wr.get(), w.w1 = l.w1.get(), w.w2 = l.w2.get(), w.b1 = l.b1.get(), w.b2 = l.b2.get();
    w.main_grad_router = l.mgr.get(), w.main_grad1 = l.mg1.get(), w.main_grad2 = l.mg2.get();
    w.db1 = l.db1.get(), w.db2 = l.db2.get();
    ok(rank < 0 ? mg_moe_layer_create(&lo, &w, nullptr, &l.layer)
                : mg_moe_layer_create_ep(&lo, &w, nullptr, comm, &l.layer));
  };

  mg_ep_comm* comms[kRanks] = {};
  ok(mg_ep_emulated_group_create(kRanks, comms));
  for (int r = 0; r < kRanks; ++r) {
    int rank = -1, ranks = -1;
    ok(mg_ep_comm_rank(comms[r], &rank));
    ok(mg_ep_comm_ranks(comms[r], &ranks));
    EXPECT_EQ(rank, r);
    EXPECT_EQ(ranks, kRanks);
  }
  CLayer whole, ranks[kRanks];
  make(whole, -1, nullptr);
  // Collective set-up: emulated ranks may be created one after the other by one thread.
  for (int r = 0; r < kRanks; ++r) make(ranks[r], r, comms[r]);
  {
    mg_moe_layer_options ep = o;
    ep.max_tokens = kTokens, ep.expert_parallel = kRanks;
    std::size_t window = 0;
    ok(mg_moe_layer_window_bytes(&ep, &window));
    EXPECT_GT(window, 0u);
  }
  // The layers keep what they need of their communicators: the handles may go first.
  for (mg_ep_comm* c : comms) mg_ep_comm_destroy(c);
  int gone = 0;
  EXPECT_EQ(mg_ep_comm_rank(comms[0], &gone), MG_ERR_INVALID_HANDLE);

  // The global batch: rank 0's tokens, then rank 1's.
  Mat x_all, dy_all;
  for (int r = 0; r < kRanks; ++r) {
    const Mat x = grid_values(rng, kTokens * h, 4, 0.25), dy = random_values(rng, kTokens * h, 1.0, bf16);
    ranks[r].reset(x, dy, counts[r]);
    x_all.insert(x_all.end(), x.begin(), x.begin() + counts[r] * h);
    dy_all.insert(dy_all.end(), dy.begin(), dy.begin() + counts[r] * h);
  }
  const int64_t n = static_cast<int64_t>(x_all.size()) / h;
  x_all.resize(kRanks * kTokens * h, 0.0), dy_all.resize(kRanks * kTokens * h, 0.0);
  whole.reset(x_all, dy_all, n);

  // Each rank's step enqueued by its own thread on its own stream (they wait for each other on the
  // device), then the whole layer's.
  std::string errors[kRanks];
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) threads.emplace_back([&, r] { errors[r] = ranks[r].train_step(); });
    for (auto& thread : threads) thread.join();
  }
  for (int r = 0; r < kRanks; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  ASSERT_EQ(whole.train_step(), "");
  for (int r = 0; r < kRanks; ++r) ok(mg_moe_layer_check_device_errors(ranks[r].layer, ranks[r].stream.get()));
  ok(mg_moe_layer_check_device_errors(whole.layer, whole.stream.get()));
  uint64_t dropped = 7;
  ok(mg_moe_layer_read_dropped(ranks[0].layer, ranks[0].stream.get(), &dropped));
  EXPECT_EQ(dropped, 0u) << "the worst-case receive buffer drops nothing";

  // The whole layer computes the same rows in the same order (by expert, then token): y and every
  // expert's weight gradient agree to the last bit. dx, the biases' gradients and the router's
  // (summed over the ranks) within the chain tolerance: their sums may round differently.
  const Tolerance tol = chain_tolerance_for(bf16);
  const auto bits16 = [](const DeviceArray<uint16_t>& a, std::size_t begin, std::size_t count) {
    const std::vector<uint16_t> all = a.download();
    return std::vector<uint16_t>(all.begin() + begin, all.begin() + begin + count);
  };
  const auto bits32 = [](const DeviceArray<float>& a, std::size_t begin, std::size_t count) {
    const std::vector<float> all = a.download();
    return bits_of(std::vector<float>(all.begin() + begin, all.begin() + begin + count));
  };
  const auto values = [&](const DeviceArray<uint16_t>& a, std::size_t begin, std::size_t count) {
    return from_bits16(bits16(a, begin, count), bf16);
  };
  Mat router_sum(kExperts * h, 0.0);
  int64_t first = 0;
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(detail::concat("rank ", r));
    const CLayer& l = ranks[r];
    const std::size_t rows = counts[r] * h, at = first * h;
    const std::vector<uint16_t> y = bits16(l.y, 0, rows);
    EXPECT_EQ(nan_count(y), 0u);
    EXPECT_TRUE(identical(y, bits16(whole.y, at, rows))) << "y";
    EXPECT_TRUE(passed(all_close("dx", values(l.dx, 0, rows), values(whole.dx, at, rows), h, {}, tol)));
    const std::vector<uint16_t> dx_past = bits16(l.dx, rows, (kTokens - counts[r]) * h);
    EXPECT_FALSE(any_nonzero(dx_past)) << "dx rows past the rank's tokens are written as zero";
    const std::size_t w1_count = kLocal * 2 * f * h, w2_count = kLocal * h * f;
    EXPECT_TRUE(any_nonzero(bits32(l.mg1, 0, w1_count)));
    EXPECT_TRUE(identical(bits32(l.mg1, 0, w1_count), bits32(whole.mg1, r * w1_count, w1_count))) << "main_grad1";
    EXPECT_TRUE(identical(bits32(l.mg2, 0, w2_count), bits32(whole.mg2, r * w2_count, w2_count))) << "main_grad2";
    EXPECT_TRUE(passed(all_close("db1", values(l.db1, 0, kLocal * 2 * f),
                                 values(whole.db1, r * kLocal * 2 * f, kLocal * 2 * f), 2 * f, {}, tol)));
    EXPECT_TRUE(passed(
        all_close("db2", values(l.db2, 0, kLocal * h), values(whole.db2, r * kLocal * h, kLocal * h), h, {}, tol)));
    const std::vector<float> router = l.mgr.download();
    for (std::size_t i = 0; i < router.size(); ++i) router_sum[i] += router[i];
    first += counts[r];
  }
  const std::vector<float> router_whole = whole.mgr.download();
  EXPECT_TRUE(passed(all_close("main_grad_router (sum over ranks)", router_sum,
                               Mat(router_whole.begin(), router_whole.end()), h, {}, tol)));

  // An inference forward on every rank gives the training forward's y again.
  std::vector<uint16_t> trained[kRanks];
  for (int r = 0; r < kRanks; ++r) trained[r] = bits16(ranks[r].y, 0, counts[r] * h), ranks[r].y.poison();
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r)
      threads.emplace_back([&, r] {
        const mg_moe_layer_io a = ranks[r].io();
        const mg_status s = mg_moe_layer_forward(ranks[r].layer, &a, /*train=*/0, ranks[r].stream.get());
        errors[r] = s == MG_OK ? std::string() : std::string(mg_status_string(s)) + ": " + mg_last_error();
      });
    for (auto& thread : threads) thread.join();
  }
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    ok(mg_moe_layer_check_device_errors(ranks[r].layer, ranks[r].stream.get()));
    EXPECT_TRUE(identical(bits16(ranks[r].y, 0, counts[r] * h), trained[r])) << "rank " << r << ": inference y";
  }
}

}  // namespace
}  // namespace moegraph::test
