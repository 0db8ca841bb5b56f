// moegraph-bench's main mode: the captured expert-MLP step of each bucket of a config.
#pragma once

#include <optional>
#include <string>

#include "moegraph/config.hpp"
#include "tools/bench/torch_results.hpp"

namespace moegraph::bench {

struct StepBenchOptions {
  std::string json_path;  // --json FILE: machine-readable results
  int replays = 0;        // --replays N overrides bench.replays
  std::optional<TorchResults> torch;  // --torch T.json: the PyTorch layer's times, already checked
  bool ops = false;       // --ops: each operator's eager time per phase (whole-layer configs)
};

int run_step_bench(const Config& config, const StepBenchOptions& options);

}  // namespace moegraph::bench
