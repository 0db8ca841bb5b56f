// moegraph's JSON configuration: one document describes the MoE layer, precision, training,
// shape buckets and the benchmark routing. Every key and its default: docs/config.md.
// Parsing never crashes and never accepts a partial config: any problem throws ConfigError.
#pragma once

#include "moegraph/export.h"

#include <cstdint>
#include <string>
#include <vector>

#include "moegraph/error.hpp"
#include "moegraph/sharding.hpp"
#include "moegraph/types.hpp"

namespace moegraph {

// A configuration problem: malformed JSON (with line and column), an unknown key (with the closest
// valid key), a wrong type, or an out-of-range / inconsistent value (key, value and rule).
// Tools exit with code 2 on it.
class MOEGRAPH_API ConfigError : public Error {
 public:
  using Error::Error;
};

struct LayerConfig {
  int experts = 0;                    // G, 1..1024
  int64_t hidden = 0;                 // multiple of 16
  int64_t ffn = 0;                    // per-expert FFN width, multiple of 16
  int top_k = 1;                      // 1..8, at most experts
  bool bias = false;
  std::string activation = "swiglu";  // only "swiglu" for now
};

struct PrecisionConfig {
  Recipe recipe = Recipe::kBF16;      // "bf16" or "mxfp8"
  DType dtype = DType::kBF16;         // "bf16" or "fp16"
  bool prequantized_weights = false;  // mxfp8: the caller gives the expert weights as MXFP8 (no 16-bit copy)
  bool dequantized_weights = false;   // mxfp8, bf16: the MXFP8 weights also kept dequantized to bf16
};

struct TrainingConfig {
  bool enabled = true;                // capture forward_train/backward/wgrad (else forward only)
  bool delay_wgrad = false;
  int wgrad_slots = 1;                // 1..64
  bool main_grad_fp32 = true;         // wgrad accumulates into fp32 main_grad (else writes bf16 dW)
};

enum class RoutingKind { kUniform, kZipf, kFixed };

struct RoutingConfig {
  RoutingKind kind = RoutingKind::kUniform;
  double skew = 1.2;                  // zipf exponent, > 0
  std::vector<int64_t> fixed_splits;  // kFixed: tokens*top_k rows per expert (sums to the bucket's rows)
  uint64_t seed = 1234;
};

// Most timed (or warm-up) replays a config or moegraph-bench --replays may ask for.
inline constexpr int kMaxBenchReplays = 1'000'000;

struct BenchConfig {
  int replays = 50;                   // timed replays per measurement, in [1, kMaxBenchReplays]
  int warmup = 3;                     // untimed replays first, >= 0
  double fill = 1.0;                  // fraction of each bucket's tokens actually routed, (0, 1]
};

struct RouterConfig {
  RouterScore score = RouterScore::kSoftmax;  // "softmax" or "sigmoid"
  bool renormalize = false;           // the chosen top-k weights are divided by their sum
  double aux_loss_coef = 0.0;         // >= 0; 0: no auxiliary load-balancing loss
  double capacity_factor = 0.0;       // 0: dropless; > 0: at most ceil(cf * tokens * top_k / experts) rows per expert
  bool fuse_weights = false;          // routing weights applied in the SwiGLU output (FC2 bias scaled) instead of at the combine
};

// Expert parallelism (moegraph/expert_parallel.hpp): one process per GPU, each running the same
// config; every bucket's token count is per rank.
struct ParallelConfig {
  int expert_parallel = 1;            // ranks the experts are spread over, 1..64, dividing layer.experts
  int64_t recv_rows = 0;              // 0: receive buffers for the worst case (dropless); else a bound
  EpExchange exchange = EpExchange::kPeerStores;  // "peer_stores" or "send_recv" (fixed chunks, ncclSend/Recv)
  int64_t chunk_rows = 0;             // send_recv: rows per chunk, 0 for the worst case (max_tokens * top_k)
  // Sharded expert weights (docs/sharding.md): ranks 1..64 of a data-parallel group, one process
  // per GPU, each holding its shard ("chunk" or "balanced" policy, "expert" or "row" unit).
  WeightSharding sharding;
};

struct Config {
  std::string name = "default";
  StepKind step = StepKind::kMoeLayer;
  LayerConfig layer;
  RouterConfig router;
  PrecisionConfig precision;
  TrainingConfig training;
  ParallelConfig parallel;
  std::vector<int64_t> buckets;       // capacities in tokens, strictly increasing, >= 1 (per rank)
  int row_align = 1;                  // 1, 16, 32, 128
  RoutingConfig routing;
  BenchConfig bench;
};

// `source` names the document in messages (a path, or "<built-in>").
MOEGRAPH_API Config parse_config(const std::string& json_text, const std::string& source);
MOEGRAPH_API Config load_config(const std::string& path);  // reads the file; a missing file is a ConfigError
// The built-in default (the Qwen3-30B-A3B-like preset), used when no config is given.
MOEGRAPH_API Config default_config();
// The config as JSON with every key (defaults filled in), e.g. for --plan and result files.
MOEGRAPH_API std::string to_json(const Config& config);

MOEGRAPH_API std::string_view routing_kind_name(RoutingKind kind);

}  // namespace moegraph
