// moegraph-bench's sharded-weights mode: a config with parallel.sharding.ranks = W > 1, one process
// per GPU (scripts/launch -n W -- moegraph-bench CONFIG), or W emulated ranks on one GPU without a
// launch (a check of the plumbing, not a multi-GPU measurement); rank 0 prints.
#pragma once

#include "moegraph/config.hpp"
#include "tools/bench/step_bench.hpp"

namespace moegraph::bench {

int run_shard_bench(const Config& config, const StepBenchOptions& options);

}  // namespace moegraph::bench
