// moegraph-bench CONFIG --torch T.json: the PyTorch layer's times (scripts/torch-moe-bench --json)
// beside moegraph's, bucket by bucket. The file is read and checked against the config before any
// GPU is touched, so a wrong or stale file fails at once with a reason (exit 2).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "moegraph/config.hpp"

namespace moegraph::bench {

struct TorchBucket {
  int64_t tokens = 0;               // the tokens it routed (the bucket at bench.fill)
  std::optional<double> graph_ms;   // its CUDA-graph replay; empty when the bucket or its capture failed
};

struct TorchResults {
  std::string path, device, torch_version, grouped_mm;
  std::map<int64_t, TorchBucket> buckets;  // by bucket capacity in tokens, as moegraph's buckets

  const TorchBucket& at(int64_t bucket) const { return buckets.at(bucket); }
};

// The results of `config` in a torch-moe-bench JSON file. Throws (ConfigError or Error, the message
// naming the file) when the file cannot be read, is not such a file, holds no or several results of
// a config of this name, or when their layer, phase, buckets or routed tokens differ from `config`.
TorchResults load_torch_results(const std::string& path, const Config& config);

}  // namespace moegraph::bench
