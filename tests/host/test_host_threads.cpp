// Host-side work that servers do from many threads at once (parse configs, plan steps, choose
// kernels, size workspaces) gives every thread the single-threaded answer. Run under
// ThreadSanitizer (meson setup -Db_sanitize=thread) it also checks for data races.
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "moegraph/config.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/step_graphs.hpp"

namespace moegraph::test {
namespace {

std::string plan_of(Recipe recipe, StepKind step) {
  Config c = default_config();
  c.precision.recipe = recipe;
  c.step = step;
  c.row_align = 32;
  return plan_step(step_graphs_options(parse_config(to_json(c), "threads"))).to_string();
}

TEST(HostThreads, PlansAndConfigsAgreeAcrossEightThreads) {
  const std::vector<std::pair<Recipe, StepKind>> kinds = {{Recipe::kBF16, StepKind::kMoeLayer},
                                                          {Recipe::kMXFP8, StepKind::kMoeLayer},
                                                          {Recipe::kBF16, StepKind::kExperts},
                                                          {Recipe::kMXFP8, StepKind::kExperts}};
  std::vector<std::string> expected;
  for (const auto& [recipe, step] : kinds) expected.push_back(plan_of(recipe, step));
  constexpr int kThreads = 8, kRounds = 20;
  std::vector<int> mismatches(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        const std::size_t k = (t + r) % kinds.size();
        mismatches[t] += plan_of(kinds[k].first, kinds[k].second) != expected[k];
      }
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
  EXPECT_NE(expected[1].find("wgmma_e4m3"), std::string::npos);
}

}  // namespace
}  // namespace moegraph::test
