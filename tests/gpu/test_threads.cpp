// The threading contract (include/moegraph/step_graphs.hpp): eight threads, each with its own
// stream, weights and StepGraphs of the whole layer, set up, capture (thread-local mode) and replay
// at the same time. Each thread's replays equal its eager steps bit for bit, and every thread
// computes the same bits as the others for the same inputs (no state leaks between handles). On a
// machine of two or more GPUs, a handle also runs on its own device when called from a thread that
// has another device current.
#include <gtest/gtest.h>

#include <barrier>
#include <memory>
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


// A handle keeps the device it was created on and makes it current for each call, giving the
// caller's back after: a thread with another device current (a pool's worker, an expert-parallel
// rank's worker) drives it. Its steps equal the bits of the same step set up and driven on the
// caller's own device. Needs two GPUs (the multi-GPU machines); skipped on one.
TEST(Threads, AHandleRunsOnItsDeviceWhenCalledWithAnotherCurrent) {
  int devices = 0, home = 0;
  MG_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (devices < 2) GTEST_SKIP() << "needs two GPUs, this machine has " << devices;
  MG_CUDA_CHECK(cudaGetDevice(&home));
  const int away = home == 0 ? 1 : 0;
  const StepGraphsOptions o = small_layer_step(16, 2, kTokens);
  StepDriver here(o);
  MG_CUDA_CHECK(cudaSetDevice(away));
  std::unique_ptr<StepDriver> there;
  try {
    there = std::make_unique<StepDriver>(o);
  } catch (...) {
    cudaSetDevice(home);
    throw;
  }
  MG_CUDA_CHECK(cudaSetDevice(home));
  for (int r = 0; r < 3; ++r) {
    const Inputs in = inputs_of_round(r == 2 ? 3 : r, here.hidden());
    here.write_inputs(in.x, in.dy, in.tokens);
    here.reset_outputs();
    here.train_step(/*graph=*/r != 1);
    const StepBits want = here.read();
    // The inputs are written on the handle's device; only the library's calls see `home` current.
    MG_CUDA_CHECK(cudaSetDevice(away));
    there->write_inputs(in.x, in.dy, in.tokens);
    there->reset_outputs();
    MG_CUDA_CHECK(cudaSetDevice(home));
    there->train_step(/*graph=*/r != 1);
    int current = -1;
    MG_CUDA_CHECK(cudaGetDevice(&current));
    EXPECT_EQ(current, home) << "the caller's device is given back";
    MG_CUDA_CHECK(cudaSetDevice(away));
    const StepBits got = there->read();
    there->step().check_device_errors(there->stream());
    MG_CUDA_CHECK(cudaSetDevice(home));
    EXPECT_TRUE(got == want) << "round " << r << (r == 1 ? " (eager)" : " (graphs)")
                             << ": the handle on device " << away << " differs from the one on " << home;
  }
  MG_CUDA_CHECK(cudaSetDevice(away));
  there.reset();
  MG_CUDA_CHECK(cudaSetDevice(home));
}

// A thread that has made no CUDA call yet has no context current, though cudaGetDevice answers 0.
// An operator called there first makes its device current itself: otherwise its first driver call
// (the TMA encoder of a Hopper GEMM) fails with CUDA_ERROR_INVALID_CONTEXT. PyTorch's autograd
// thread calls GroupedLinear's backward so when the input needs no gradient.
TEST(Threads, AnOperatorRunsFirstOnAFreshThread) {
  CaseSpec spec{"fresh_thread", 4, 256, 256, DType::kBF16, 1, {}, 600};
  Problem p(spec, test_seed(spec.name));
  p.op->forward_train(p.forward_args(), nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  std::string error;
  std::thread([&] {
    try {
      BackwardArgs a = p.backward_args();
      a.dx = nullptr;  // as autograd asks when x needs no gradient
      p.op->backward(a, WgradMode::kImmediate, nullptr);
      MG_CUDA_CHECK(cudaStreamSynchronize(nullptr));
    } catch (const std::exception& e) {
      error = e.what();
    }
  }).join();
  ASSERT_EQ(error, "");
  expect_matches_reference(p, OutputSet::kWgrad, "wgrad from a fresh thread");
}

}  // namespace
}  // namespace moegraph::test
