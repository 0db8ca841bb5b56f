// The C ABI on the GPU, with emulated ranks (mg_ep_emulated_group_create): expert parallelism
// (mg_moe_layer_create_ep) against one layer holding every expert, and a sharded step
// (mg_step_graphs_create with the data-parallel communicator) against the unsharded step, bit for
// bit.
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


// ---- Sharded weights: a sharded step through the C ABI ---------------------------------------------

// Two ranks of a step whose 5 experts are sharded 3 + 2 (chunk policy), each on its own batch:
// each rank's y equals the unsharded step's on that batch, its fp32 main_grad shards equal the
// fp32 sum over the ranks of the unsharded gradients' rows it holds, and its bias-gradient shards
// that sum rounded to bf16.
TEST(CAbiShardedStepGpu, TwoRanksGetTheirRowsOfTheSummedGradient) {
  constexpr int kRanks = 2;
  constexpr int64_t kExperts = 5, kHidden = 128, kFfn = 64, kTokens = 32;
  const int64_t counts[kRanks] = {kTokens, kTokens - 9};
  const std::string layer = R"("layer": {"experts": 5, "hidden": 128, "ffn": 64, "top_k": 2, "bias": true},
      "training": {"enabled": true, "main_grad_fp32": true}, "buckets": [32])";
  const int64_t h = kHidden, f = kFfn;
  // Per expert: w1, w2, b1, b2 elements.
  const int64_t per[4] = {2 * f * h, h * f, 2 * f, h};
  std::mt19937_64 rng(test_seed("CAbiShardedStepGpu.TwoRanksGetTheirRowsOfTheSummedGradient"));
  const std::vector<uint16_t> router = random_bf16(rng, kExperts * h, std::sqrt(3.0 / double(h)));
  std::vector<uint16_t> full[4];
  const double scale[4] = {1.0 / std::sqrt(double(h)), 1.0 / std::sqrt(double(f)), 0.1, 0.1};
  for (int t = 0; t < 4; ++t) full[t] = random_bf16(rng, kExperts * per[t], scale[t]);
  std::vector<uint16_t> x[kRanks], dy[kRanks];
  for (int r = 0; r < kRanks; ++r) x[r] = random_bf16(rng, kTokens * h, 1.0), dy[r] = random_bf16(rng, kTokens * h, 1.0);

  // One rank's buffers: the router whole, the expert tensors' rows [first, first + rows).
  struct Buffers {
    DeviceArray<uint16_t> router, w[4], db[2];
    DeviceArray<float> mgr, mg[2];
    mg_step_graphs* step = nullptr;
    testing::Stream stream;
    mg_step_weights weights(int64_t rows) {
      mg_step_weights sw = sized<mg_step_weights>();
      sw.router = router.get(), sw.main_grad_router = mgr.get();
      if (rows > 0) {
        sw.w1 = w[0].get(), sw.w2 = w[1].get(), sw.b1 = w[2].get(), sw.b2 = w[3].get();
        sw.main_grad1 = mg[0].get(), sw.main_grad2 = mg[1].get(), sw.db1 = db[0].get(), sw.db2 = db[1].get();
      }
      return sw;
    }
  };
  const auto fill = [&](Buffers& b, int64_t first, int64_t rows) {
    b.router = DeviceArray<uint16_t>(router.size()), b.mgr = DeviceArray<float>(kExperts * h);
    to_device(b.router.get(), router, b.stream.get());
    for (int t = 0; t < 4; ++t) {
      b.w[t] = DeviceArray<uint16_t>(rows * per[t]);
      if (rows > 0)
        to_device(b.w[t].get(), std::vector<uint16_t>(full[t].begin() + first * per[t],
                                                        full[t].begin() + (first + rows) * per[t]), b.stream.get());
    }
    for (int t = 0; t < 2; ++t) b.mg[t] = DeviceArray<float>(rows * per[t]), b.db[t] = DeviceArray<uint16_t>(rows * per[2 + t]);
  };
  // One training step of `b` on rank r's batch (its main_grad zeroed, its dW and db poisoned first).
  const auto train = [&](Buffers& b, int r) {
    cudaStream_t s = b.stream.get();
    for (DeviceArray<float>* a : {&b.mgr, &b.mg[0], &b.mg[1]})
      if (a->size()) MG_CUDA_CHECK(cudaMemsetAsync(a->get(), 0, a->size() * sizeof(float), s));
    for (DeviceArray<uint16_t>* a : {&b.db[0], &b.db[1]})
      if (a->size()) poison(a->get(), a->size() * sizeof(uint16_t), s);
    mg_bucket_io io = sized<mg_bucket_io>();
    ok(mg_step_graphs_io(b.step, 0, &io));
    to_device(io.x, x[r], s);
    to_device(io.dy, dy[r], s);
    to_device(io.num_tokens, std::vector<int32_t>{static_cast<int32_t>(counts[r])}, s);
    ok(mg_step_graphs_replay(b.step, 0, MG_PHASE_FORWARD_TRAIN, s));
    ok(mg_step_graphs_replay(b.step, 0, MG_PHASE_BACKWARD, s));
    MG_CUDA_CHECK(cudaStreamSynchronize(s));
    ok(mg_step_graphs_check_device_errors(b.step, s));
    return to_host<uint16_t>(io.y, counts[r] * h, s);
  };

  // The unsharded step on each rank's batch: y, and the full gradients of each batch.
  std::vector<uint16_t> want_y[kRanks];
  std::vector<float> want_mg[kRanks][2], want_mgr[kRanks];
  std::vector<uint16_t> want_db[kRanks][2];
  {
    mg_config* c = nullptr;
    ok(mg_config_parse(("{" + layer + "}").c_str(), &c));
    Buffers whole;
    fill(whole, 0, kExperts);
    const mg_step_weights w = whole.weights(kExperts);
    ok(mg_step_graphs_create(c, &w, nullptr, &whole.step));
    mg_config_destroy(c);
    for (int r = 0; r < kRanks; ++r) {
      want_y[r] = train(whole, r);
      for (int t = 0; t < 2; ++t) want_mg[r][t] = whole.mg[t].download(), want_db[r][t] = whole.db[t].download();
      want_mgr[r] = whole.mgr.download();
    }
    mg_step_graphs_destroy(whole.step);
  }

  // The sharded step: each rank created and driven by its own thread (set-up is collective).
  mg_config* c = nullptr;
  ok(mg_config_parse(("{\"parallel\": {\"sharding\": {\"ranks\": 2}}, " + layer + "}").c_str(), &c));
  mg_ep_comm* comms[kRanks] = {};
  ok(mg_ep_emulated_group_create(kRanks, comms));
  Buffers ranks[kRanks];
  int64_t first[kRanks] = {}, rows[kRanks] = {};
  for (int r = 0; r < kRanks; ++r) {
    ok(mg_shard_rows(MG_SHARD_CHUNK, kExperts, kRanks, r, &first[r], &rows[r]));
    fill(ranks[r], first[r], rows[r]);
  }
  EXPECT_EQ(rows[0], 3);
  EXPECT_EQ(rows[1], 2);
  std::string errors[kRanks];
  std::vector<uint16_t> got_y[kRanks];
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r)
      threads.emplace_back([&, r] {
        try {
          mg_step_graphs_options o = sized<mg_step_graphs_options>();
          o.thread_local_capture = 1, o.shard_comm = comms[r];
          const mg_step_weights w = ranks[r].weights(rows[r]);
          ok(mg_step_graphs_create(c, &w, &o, &ranks[r].step));
          got_y[r] = train(ranks[r], r);
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    for (auto& t : threads) t.join();
  }
  mg_config_destroy(c);
  for (mg_ep_comm* comm : comms) mg_ep_comm_destroy(comm);
  const auto bf16_bits = [](float v) {  // round to nearest even (no NaN here)
    const uint32_t u = std::bit_cast<uint32_t>(v);
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  };
  const auto from_bf16 = [](uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); };
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(detail::concat("rank ", r));
    ASSERT_EQ(errors[r], "");
    EXPECT_TRUE(identical(got_y[r], want_y[r])) << "y differs from the unsharded step's on this rank's batch";
    EXPECT_TRUE(identical(bits_of(ranks[r].mgr.download()), bits_of(want_mgr[r]))) << "the router's own share";
    for (int t = 0; t < 2; ++t) {
      const std::size_t begin = first[r] * per[t], count = rows[r] * per[t];
      std::vector<float> sum(count);
      for (std::size_t i = 0; i < count; ++i) sum[i] = want_mg[0][t][begin + i] + want_mg[1][t][begin + i];
      const std::vector<float> got = ranks[r].mg[t].download();
      EXPECT_TRUE(any_nonzero(got));
      EXPECT_TRUE(identical(bits_of(got), bits_of(sum))) << "main_grad" << t + 1 << " shard";
      const std::size_t bbegin = first[r] * per[2 + t], bcount = rows[r] * per[2 + t];
      std::vector<uint16_t> bsum(bcount);
      for (std::size_t i = 0; i < bcount; ++i)
        bsum[i] = bf16_bits(from_bf16(want_db[0][t][bbegin + i]) + from_bf16(want_db[1][t][bbegin + i]));
      EXPECT_TRUE(identical(ranks[r].db[t].download(), bsum)) << "db" << t + 1 << " shard";
    }
  }
  for (Buffers& b : ranks) mg_step_graphs_destroy(b.step);
}

// mg_ep_comm_wait and mg_ep_comm_abort through the C ABI: a finished stream completes at once, a
// negative timeout is refused, and a second abort does nothing (the refusals after an abort are
// ExpertParallel.WaitGivesUpOnAMissingRankAndAbortRefusesLaterCalls).
TEST(CAbiExpertParallelGpu, WaitAndAbort) {
  mg_ep_comm* comm[1] = {};
  ASSERT_EQ(mg_ep_emulated_group_create(1, comm), MG_OK) << mg_last_error();
  int completed = 0;
  EXPECT_EQ(mg_ep_comm_wait(comm[0], nullptr, 0, &completed), MG_OK) << mg_last_error();
  EXPECT_EQ(completed, 1);
  EXPECT_EQ(mg_ep_comm_wait(comm[0], nullptr, -1, &completed), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_ep_comm_abort(comm[0]), MG_OK) << mg_last_error();
  EXPECT_EQ(mg_ep_comm_abort(comm[0]), MG_OK) << mg_last_error();
  mg_ep_comm_destroy(comm[0]);
}

}  // namespace
}  // namespace moegraph::test
