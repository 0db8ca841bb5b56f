// The threading contract (include/moegraph/step_graphs.hpp): eight threads, each with its own
// stream, weights and StepGraphs of the whole layer, set up, capture (thread-local mode) and replay
// at the same time. Each thread's replays equal its eager steps bit for bit, and every thread
// computes the same bits as the others for the same inputs (no state leaks between handles).
#include <gtest/gtest.h>

#include <barrier>
#include <random>
#include <thread>

#include "tests/common/expect.hpp"
#include "tests/gpu/step_driver.hpp"

namespace moegraph::test {
namespace {

constexpr int kThreads = 8, kRounds = 6;
constexpr int64_t kTokens = 96;

struct Inputs {
  std::vector<uint16_t> x, dy;
  int32_t tokens;
};

// The same inputs for every thread: round r's data comes from seed r.
Inputs inputs_of_round(int r, int64_t hidden) {
  std::mt19937_64 rng(1000 + r);
  const std::size_t n = kTokens * hidden;
  const int32_t tokens[kRounds] = {kTokens, 1, 0, 57, kTokens, 13};
  return {to_device_bits(random_values(rng, n, 1.0, DType::kBF16), DType::kBF16),
          to_device_bits(random_values(rng, n, 1.0, DType::kBF16), DType::kBF16), tokens[r]};
}

TEST(Threads, EightThreadsSetUpCaptureAndReplayConcurrently) {
  int device = 0;
  MG_CUDA_CHECK(cudaGetDevice(&device));
  std::vector<std::vector<StepBits>> results(kThreads, std::vector<StepBits>(kRounds));
  std::vector<std::string> errors(kThreads);
  std::vector<int> mismatches(kThreads, 0);
  std::barrier sync_point(kThreads);
  auto work = [&](int t) {
    try {
      MG_CUDA_CHECK(cudaSetDevice(device));  // a handle is bound to the device current at set-up
      StepGraphsOptions o = small_layer_step(16, 2, kTokens);
      o.capture_mode = cudaStreamCaptureModeThreadLocal;  // others set up and synchronize meanwhile
      sync_point.arrive_and_wait();  // every thread sets up and captures at the same time
      StepDriver d(o);
      for (int r = 0; r < kRounds; ++r) {
        const Inputs in = inputs_of_round(r, d.hidden());
        d.write_inputs(in.x, in.dy, in.tokens);
        d.reset_outputs();
        d.train_step(/*graph=*/true);
        results[t][r] = d.read();
        d.reset_outputs();
        d.train_step(/*graph=*/false);
        mismatches[t] += !(d.read() == results[t][r]);
        d.step().check_device_errors(d.stream());
      }
    } catch (const std::exception& e) {
      errors[t] = e.what();
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(work, t);
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(errors[t], "") << "thread " << t;
    EXPECT_EQ(mismatches[t], 0) << "thread " << t << ": replays differ from eager steps";
    for (int r = 0; r < kRounds; ++r)
      EXPECT_TRUE(results[t][r] == results[0][r]) << "thread " << t << " round " << r << " differs from thread 0";
  }
  // Not all zero or NaN: the rounds with tokens computed something.
  std::size_t finite = 0;
  for (uint16_t bits : results[0][0].y) finite += (bits & 0x7f80) != 0x7f80 && bits != 0;
  EXPECT_GT(finite, results[0][0].y.size() / 2);
}

}  // namespace
}  // namespace moegraph::test
