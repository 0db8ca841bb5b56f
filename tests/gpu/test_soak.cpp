// Soak: 10,000 graph replays of the whole training step (forward_train, backward, delayed wgrad),
// a fresh routing every replay, among them every token to one expert (empty experts), zero tokens
// and a full bucket; an invalid token count every thousandth step, which must be reported and
// leave the next step correct. Every 100th replay is compared bit for bit with the eager step on
// the same inputs; device memory in use must not move. Prints replays per second per 1000 and the
// drift. MOEGRAPH_SOAK_REPLAYS shortens it (e.g. under the sanitizers).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <random>

#include "kernels/elementwise/elementwise.hpp"
#include "tests/common/expect.hpp"
#include "tests/gpu/step_driver.hpp"

namespace moegraph::test {
namespace {

int soak_replays() {
  const char* env = std::getenv("MOEGRAPH_SOAK_REPLAYS");
  return env != nullptr ? std::max(100, std::atoi(env)) : 10000;
}

TEST(Soak, TenThousandReplaysOfTheTrainingStep) {
  constexpr int64_t kTokens = 256;
  // Top-1, so identical tokens send every token to one expert and leave the others empty.
  StepDriver d(small_layer_step(16, 1, kTokens));
  const int64_t h = d.hidden();
  const BucketIO io = d.step().io(0);
  std::mt19937_64 rng(test_seed("soak"));
  // Inputs where every token is the same row (four variants), uploaded when their turn comes.
  std::vector<std::vector<uint16_t>> same_rows(4);
  for (auto& x : same_rows) {
    const auto row = to_device_bits(random_values(rng, h, 1.0, DType::kBF16), DType::kBF16);
    for (int64_t t = 0; t < kTokens; ++t) x.insert(x.end(), row.begin(), row.end());
  }
  const std::vector<uint16_t> dy = to_device_bits(random_values(rng, kTokens * h, 1.0, DType::kBF16), DType::kBF16);
  std::uniform_int_distribution<int32_t> some_tokens(1, kTokens);

  // One step's inputs: x fresh on the device (a new seed every replay, so a new routing), or the
  // same-row pattern; the token count by the replay's place in its cycle of ten.
  auto set_inputs = [&](int i) -> int32_t {
    int32_t n = some_tokens(rng);
    if (i % 10 == 3) {
      d.write_inputs(same_rows[(i / 10) % 4], dy, kTokens);
      return kTokens;
    }
    if (i % 10 == 5) n = 0;
    if (i % 10 == 7) n = kTokens;
    if (i % 1000 == 999) n = (i / 1000) % 2 == 0 ? kTokens + 1 + i / 1000 : -1 - i / 1000;  // invalid
    kernels::launch_fill_uniform(DType::kBF16, io.x, kTokens * h, 1.0f, 7919u * i + 17u, d.stream());
    d.write_inputs({}, {}, n);
    return n;
  };

  const int replays = soak_replays();
  std::size_t free_after_warmup = 0, free_at_end = 0, total = 0;
  int compared = 0, reported = 0;
  std::vector<double> per_thousand;
  auto block_start = std::chrono::steady_clock::now();
  for (int i = 0; i < replays; ++i) {
    const int32_t n = set_inputs(i);
    const bool invalid = n < 0 || n > kTokens;
    if (i % 100 == 0) {
      // The same inputs through the graphs and eagerly: bit for bit, from zeroed main_grad.
      d.reset_outputs();
      d.train_step(/*graph=*/true);
      const StepBits graph = d.read();
      d.reset_outputs();
      d.train_step(/*graph=*/false);
      ASSERT_TRUE(d.read() == graph) << "replay " << i << " (" << n << " tokens) differs from the eager step";
      ++compared;
    } else {
      d.train_step(/*graph=*/true);
    }
    if (invalid) {
      try {
        d.step().check_device_errors(d.stream());
        FAIL() << "replay " << i << ": num_tokens = " << n << " was not reported";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kDeviceSplits);
        EXPECT_NE(e.message().find("num_tokens = " + std::to_string(n)), std::string::npos) << e.message();
        ++reported;
      }
    } else if (i % 100 == 0 || i % 1000 == 0) {
      EXPECT_NO_THROW(d.step().check_device_errors(d.stream())) << "replay " << i;
    }
    if (i == 0) MG_CUDA_CHECK(cudaMemGetInfo(&free_after_warmup, &total));
    if ((i + 1) % 1000 == 0 || i + 1 == replays) {
      MG_CUDA_CHECK(cudaStreamSynchronize(d.stream()));
      const auto now = std::chrono::steady_clock::now();
      const int in_block = (i % 1000) + 1;
      per_thousand.push_back(in_block / std::chrono::duration<double>(now - block_start).count());
      block_start = now;
    }
  }
  MG_CUDA_CHECK(cudaStreamSynchronize(d.stream()));
  MG_CUDA_CHECK(cudaMemGetInfo(&free_at_end, &total));
  EXPECT_EQ(free_at_end, free_after_warmup) << "device memory in use changed during the soak";
  EXPECT_EQ(compared, (replays + 99) / 100);
  EXPECT_EQ(reported, replays / 1000);
  std::printf("[ soak     ] %d replays, %d compared with eager (bit-identical), %d invalid counts reported;"
              " replays/s per 1000 (incl. input writes and checks):", replays, compared, reported);
  for (double r : per_thousand) std::printf(" %.0f", r);
  std::printf("; drift last/first %.3f; device memory free %zu -> %zu bytes\n",
              per_thousand.back() / per_thousand.front(), free_after_warmup, free_at_end);
}

}  // namespace
}  // namespace moegraph::test
