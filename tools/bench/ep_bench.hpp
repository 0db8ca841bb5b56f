// moegraph-bench's expert-parallel mode: a config with parallel.expert_parallel > 1, one process per
// GPU (scripts/launch -n R -- moegraph-bench CONFIG); rank 0 prints.
#pragma once

#include "moegraph/config.hpp"
#include "tools/bench/step_bench.hpp"

namespace moegraph::bench {

int run_ep_bench(const Config& config, const StepBenchOptions& options);

}  // namespace moegraph::bench
