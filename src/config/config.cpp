// The config schema: which keys exist, their types, defaults and rules (docs/config.md lists them).
// The generic strict JSON reading lives in json_reader.cpp.
#include "moegraph/config.hpp"

#include <cmath>
#include <sstream>

#include "moegraph/expert_parallel.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/moe_layer.hpp"
#include "src/config/json_reader.hpp"
#include "src/ops/moe/op_spec.hpp"

namespace moegraph {

using config_detail::Json;
using config_detail::JsonObject;

namespace {

// Hidden and FFN widths beyond this are not a real layer, and would overflow size arithmetic.
constexpr int64_t kMaxWidth = int64_t{1} << 20;
constexpr int64_t kMaxBucketTokens = int64_t{1} << 20;
constexpr int kMaxTopK = 8;

// Identical in content to configs/qwen3-30b-a3b.json (a host test compares the two).
constexpr const char* kDefaultConfigJson = R"json({
  "name": "qwen3-30b-a3b",
  "step": "moe_layer",
  "layer": {"experts": 128, "hidden": 2048, "ffn": 768, "top_k": 8, "bias": false, "activation": "swiglu"},
  "router": {"score": "softmax", "renormalize": true, "aux_loss_coef": 0.001,
             "capacity_factor": 0.0, "fuse_weights": false},
  "precision": {"recipe": "bf16", "dtype": "bf16"},
  "training": {"enabled": true, "delay_wgrad": true, "wgrad_slots": 2, "main_grad_fp32": true},
  "buckets": [1024, 2048, 4096],
  "row_align": 1,
  "routing": {"kind": "zipf", "skew": 1.2, "seed": 1234},
  "bench": {"replays": 50, "warmup": 3, "fill": 1.0}
})json";

LayerConfig read_layer(const Json& value) {
  const JsonObject o(value, "layer", {"experts", "hidden", "ffn", "top_k", "bias", "activation"});
  LayerConfig layer;
  layer.experts = static_cast<int>(config_detail::integer_in(o.required("experts"), o.path("experts"), 1, 1024));
  const std::string width_rule = detail::concat("a positive multiple of 16 (at most ", kMaxWidth, ")");
  for (auto [key, field] : {std::pair{"hidden", &layer.hidden}, std::pair{"ffn", &layer.ffn}}) {
    *field = config_detail::integer_in(o.required(key), o.path(key), 16, kMaxWidth, width_rule);
    MG_CONFIG_CHECK(*field % 16 == 0, o.path(key), " must be ", width_rule, ", got ", *field);
  }
  if (const Json* v = o.find("top_k"))
    layer.top_k = static_cast<int>(config_detail::integer_in(*v, o.path("top_k"), 1, kMaxTopK));
  MG_CONFIG_CHECK(layer.top_k <= layer.experts, "layer.top_k must be at most layer.experts (", layer.experts, "), got ",
                  layer.top_k);
  if (const Json* v = o.find("bias")) layer.bias = config_detail::boolean(*v, o.path("bias"));
  if (const Json* v = o.find("activation")) layer.activation = config_detail::string(*v, o.path("activation"));
  MG_CONFIG_CHECK(layer.activation == "swiglu", "layer.activation must be \"swiglu\" (the only one implemented), got ",
                  config_detail::quoted_excerpt(layer.activation));
  return layer;
}

StepKind step_kind_from(const std::string& name) {
  for (StepKind kind : {StepKind::kMoeLayer, StepKind::kExperts})
    if (step_kind_name(kind) == name) return kind;
  MG_CONFIG_FAIL("step must be \"moe_layer\" or \"experts\", got ", config_detail::quoted_excerpt(name));
}

RouterConfig read_router(const Json& value) {
  const JsonObject o(value, "router", {"score", "renormalize", "aux_loss_coef", "capacity_factor", "fuse_weights"});
  RouterConfig router;
  if (const Json* v = o.find("score")) {
    const std::string score = config_detail::string(*v, o.path("score"));
    MG_CONFIG_CHECK(score == "softmax" || score == "sigmoid", "router.score must be \"softmax\" or \"sigmoid\", got ",
                    config_detail::quoted_excerpt(score));
    router.score = score == "sigmoid" ? RouterScore::kSigmoid : RouterScore::kSoftmax;
  }
  if (const Json* v = o.find("renormalize")) router.renormalize = config_detail::boolean(*v, o.path("renormalize"));
  // JSON cannot write NaN or infinity (1e400 is a syntax error), so only the sign can be wrong in a
  // document; isfinite states the whole rule anyway, so a future reader cannot slip past it.
  if (const Json* v = o.find("aux_loss_coef"))
    router.aux_loss_coef = config_detail::number(*v, o.path("aux_loss_coef"));
  MG_CONFIG_CHECK(std::isfinite(router.aux_loss_coef) && router.aux_loss_coef >= 0,
                  "router.aux_loss_coef must be a finite number >= 0 (0 turns the auxiliary loss off), got ",
                  router.aux_loss_coef);
  if (const Json* v = o.find("capacity_factor"))
    router.capacity_factor = config_detail::number(*v, o.path("capacity_factor"));
  MG_CONFIG_CHECK(std::isfinite(router.capacity_factor) && router.capacity_factor >= 0,
                  "router.capacity_factor must be 0 (dropless) or a finite number > 0 (at most ceil(capacity_factor "
                  "* tokens * top_k / experts) rows per expert), got ",
                  router.capacity_factor);
  if (const Json* v = o.find("fuse_weights")) router.fuse_weights = config_detail::boolean(*v, o.path("fuse_weights"));
  return router;
}

PrecisionConfig read_precision(const Json& value) {
  const JsonObject o(value, "precision", {"recipe", "dtype", "prequantized_weights", "dequantized_weights"});
  PrecisionConfig precision;
  if (const Json* v = o.find("recipe")) {
    const std::string recipe = config_detail::string(*v, o.path("recipe"));
    MG_CONFIG_CHECK(recipe == "bf16" || recipe == "mxfp8", "precision.recipe must be \"bf16\" or \"mxfp8\", got ",
                    config_detail::quoted_excerpt(recipe));
    precision.recipe = recipe == "mxfp8" ? Recipe::kMXFP8 : Recipe::kBF16;
  }
  if (const Json* v = o.find("dtype")) {
    const std::string dtype = config_detail::string(*v, o.path("dtype"));
    MG_CONFIG_CHECK(dtype == "bf16" || dtype == "fp16", "precision.dtype must be \"bf16\" or \"fp16\", got ",
                    config_detail::quoted_excerpt(dtype));
    precision.dtype = dtype == "bf16" ? DType::kBF16 : DType::kFP16;
  }
  if (const Json* v = o.find("prequantized_weights"))
    precision.prequantized_weights = config_detail::boolean(*v, o.path("prequantized_weights"));
  MG_CONFIG_CHECK(!precision.prequantized_weights || precision.recipe == Recipe::kMXFP8,
                  "precision.prequantized_weights needs precision.recipe \"mxfp8\" (the weights it reads are MXFP8), "
                  "got recipe \"", recipe_name(precision.recipe), "\"");
  if (const Json* v = o.find("dequantized_weights"))
    precision.dequantized_weights = config_detail::boolean(*v, o.path("dequantized_weights"));
  MG_CONFIG_CHECK(!precision.dequantized_weights ||
                      (precision.recipe == Recipe::kMXFP8 && precision.dtype == DType::kBF16),
                  "precision.dequantized_weights needs precision.recipe \"mxfp8\" and dtype \"bf16\" (the kept "
                  "values are bf16), got recipe \"", recipe_name(precision.recipe), "\" and dtype \"",
                  dtype_name(precision.dtype), "\"");
  return precision;
}

TrainingConfig read_training(const Json& value) {
  const JsonObject o(value, "training", {"enabled", "delay_wgrad", "wgrad_slots", "main_grad_fp32"});
  TrainingConfig training;
  if (const Json* v = o.find("enabled")) training.enabled = config_detail::boolean(*v, o.path("enabled"));
  if (const Json* v = o.find("delay_wgrad")) training.delay_wgrad = config_detail::boolean(*v, o.path("delay_wgrad"));
  if (const Json* v = o.find("wgrad_slots"))
    training.wgrad_slots = static_cast<int>(config_detail::integer_in(*v, o.path("wgrad_slots"), 1, 64));
  if (const Json* v = o.find("main_grad_fp32"))
    training.main_grad_fp32 = config_detail::boolean(*v, o.path("main_grad_fp32"));
  // Without training there is no backward pass, so there is no weight gradient to delay.
  MG_CONFIG_CHECK(!training.delay_wgrad || training.enabled,
                  "training.delay_wgrad requires training.enabled, got delay_wgrad true with enabled false");
  return training;
}

WeightSharding read_sharding(const Json& value) {
  const JsonObject o(value, "parallel.sharding", {"ranks", "policy", "unit"});
  WeightSharding sharding;
  if (const Json* v = o.find("ranks"))
    sharding.ranks = static_cast<int>(config_detail::integer_in(*v, o.path("ranks"), 1, kMaxShardRanks));
  if (const Json* v = o.find("policy")) {
    const std::string policy = config_detail::string(*v, o.path("policy"));
    MG_CONFIG_CHECK(policy == "chunk" || policy == "balanced", "parallel.sharding.policy must be \"chunk\" or "
                    "\"balanced\", got ", config_detail::quoted_excerpt(policy));
    sharding.policy = policy == "chunk" ? ShardPolicy::kChunk : ShardPolicy::kBalanced;
  }
  if (const Json* v = o.find("unit")) {
    const std::string unit = config_detail::string(*v, o.path("unit"));
    MG_CONFIG_CHECK(unit == "expert" || unit == "row", "parallel.sharding.unit must be \"expert\" or \"row\", got ",
                    config_detail::quoted_excerpt(unit));
    sharding.unit = unit == "expert" ? ShardUnit::kExpert : ShardUnit::kRow;
  }
  return sharding;
}

ParallelConfig read_parallel(const Json& value, const LayerConfig& layer) {
  const JsonObject o(value, "parallel", {"expert_parallel", "recv_rows", "exchange", "chunk_rows", "sharding"});
  ParallelConfig parallel;
  if (const Json* v = o.find("expert_parallel"))
    parallel.expert_parallel =
        static_cast<int>(config_detail::integer_in(*v, o.path("expert_parallel"), 1, kMaxExpertParallel));
  MG_CONFIG_CHECK(layer.experts % parallel.expert_parallel == 0, "parallel.expert_parallel (",
                  parallel.expert_parallel, ") must divide layer.experts (", layer.experts, ")");
  if (const Json* v = o.find("recv_rows"))
    parallel.recv_rows = config_detail::integer_in(*v, o.path("recv_rows"), 0, kMaxCapacityRows);
  MG_CONFIG_CHECK(parallel.recv_rows == 0 || parallel.expert_parallel > 1,
                  "parallel.recv_rows needs parallel.expert_parallel > 1, got recv_rows ", parallel.recv_rows);
  if (const Json* v = o.find("exchange")) {
    const std::string exchange = config_detail::string(*v, o.path("exchange"));
    MG_CONFIG_CHECK(exchange == "peer_stores" || exchange == "send_recv",
                    "parallel.exchange must be \"peer_stores\" or \"send_recv\", got ",
                    config_detail::quoted_excerpt(exchange));
    parallel.exchange = exchange == "send_recv" ? EpExchange::kSendRecv : EpExchange::kPeerStores;
  }
  MG_CONFIG_CHECK(parallel.exchange == EpExchange::kPeerStores || parallel.expert_parallel > 1,
                  "parallel.exchange \"send_recv\" needs parallel.expert_parallel > 1");
  if (const Json* v = o.find("chunk_rows"))
    parallel.chunk_rows = config_detail::integer_in(*v, o.path("chunk_rows"), 0, kMaxCapacityRows);
  MG_CONFIG_CHECK(parallel.chunk_rows == 0 || parallel.exchange == EpExchange::kSendRecv,
                  "parallel.chunk_rows needs parallel.exchange \"send_recv\", got chunk_rows ", parallel.chunk_rows);
  // With expert_parallel R > 1 too, each rank's shards are rows of its own E/R experts.
  if (const Json* v = o.find("sharding")) parallel.sharding = read_sharding(*v);
  return parallel;
}

std::vector<int64_t> read_buckets(const Json& value) {
  const std::string path_of_buckets = "buckets";  // named: the reference returned must not outlive it
  const std::vector<Json>& items = config_detail::array(value, path_of_buckets);
  MG_CONFIG_CHECK(!items.empty(), "buckets must not be empty (give at least one capacity in tokens)");
  std::vector<int64_t> buckets;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const std::string path = detail::concat("buckets[", i, "]");
    buckets.push_back(config_detail::integer_in(items[i], path, 1, kMaxBucketTokens));
    MG_CONFIG_CHECK(i == 0 || buckets[i] > buckets[i - 1], "buckets must be strictly increasing, got ", path, " = ",
                    buckets[i], " after buckets[", i - 1, "] = ", buckets[i - 1]);
  }
  return buckets;
}

RoutingKind routing_kind_from(const std::string& name) {
  for (RoutingKind kind : {RoutingKind::kUniform, RoutingKind::kZipf, RoutingKind::kFixed})
    if (routing_kind_name(kind) == name) return kind;
  MG_CONFIG_FAIL("routing.kind must be \"uniform\", \"zipf\" or \"fixed\", got ", config_detail::quoted_excerpt(name));
}

// Needs the layer and the buckets: fixed splits give one row count per expert, and every bucket's
// rows (tokens * top_k) must be exactly what they add up to.
RoutingConfig read_routing(const Json& value, const LayerConfig& layer, const std::vector<int64_t>& buckets) {
  const JsonObject o(value, "routing", {"kind", "skew", "seed", "fixed_splits"});
  RoutingConfig routing;
  if (const Json* v = o.find("kind")) routing.kind = routing_kind_from(config_detail::string(*v, o.path("kind")));
  if (const Json* v = o.find("skew")) routing.skew = config_detail::number(*v, o.path("skew"));
  MG_CONFIG_CHECK(routing.skew > 0, "routing.skew must be greater than 0, got ", routing.skew);
  if (const Json* v = o.find("seed")) routing.seed = config_detail::non_negative_integer(*v, o.path("seed"));

  if (const Json* v = o.find("fixed_splits")) {
    const std::string path = o.path("fixed_splits");
    const std::vector<Json>& items = config_detail::array(*v, path);
    for (std::size_t e = 0; e < items.size(); ++e)
      routing.fixed_splits.push_back(config_detail::integer_in(
          items[e], detail::concat("routing.fixed_splits[", e, "]"), 0, kMaxBucketTokens * kMaxTopK));
  }
  if (routing.kind != RoutingKind::kFixed) {
    MG_CONFIG_CHECK(
        routing.fixed_splits.empty(), "routing.fixed_splits must be empty unless routing.kind is \"fixed\", got ",
        routing.fixed_splits.size(), " entries with routing.kind \"", routing_kind_name(routing.kind), "\"");
    return routing;
  }
  MG_CONFIG_CHECK(!routing.fixed_splits.empty(),
                  "routing.fixed_splits is required when routing.kind is \"fixed\" (one row count per expert)");
  MG_CONFIG_CHECK(routing.fixed_splits.size() == static_cast<std::size_t>(layer.experts),
                  "routing.fixed_splits must have one entry per expert (layer.experts = ", layer.experts, "), got ",
                  routing.fixed_splits.size(), " entries");
  int64_t rows = 0;
  for (int64_t split : routing.fixed_splits) rows += split;
  for (std::size_t i = 0; i < buckets.size(); ++i)
    MG_CONFIG_CHECK(buckets[i] * layer.top_k == rows, "routing.fixed_splits sum to ", rows, " rows but buckets[", i,
                    "] = ", buckets[i], " tokens * layer.top_k ", layer.top_k, " = ", buckets[i] * layer.top_k,
                    " rows; with routing.kind \"fixed\" every bucket must match the sum (use one bucket)");
  return routing;
}

BenchConfig read_bench(const Json& value) {
  const JsonObject o(value, "bench", {"replays", "warmup", "fill"});
  BenchConfig bench;
  if (const Json* v = o.find("replays"))
    bench.replays = static_cast<int>(config_detail::integer_in(*v, o.path("replays"), 1, kMaxBenchReplays));
  if (const Json* v = o.find("warmup"))
    bench.warmup = static_cast<int>(config_detail::integer_in(*v, o.path("warmup"), 0, kMaxBenchReplays));
  if (const Json* v = o.find("fill")) bench.fill = config_detail::number(*v, o.path("fill"));
  MG_CONFIG_CHECK(bench.fill > 0 && bench.fill <= 1, "bench.fill must be in (0, 1], got ", bench.fill);
  return bench;
}

Config read_config(const Json& document) {
  const JsonObject o(document, "",
                     {"name", "step", "layer", "router", "precision", "training", "parallel", "buckets", "row_align",
                      "routing", "bench"});
  Config config;
  if (const Json* v = o.find("name")) config.name = config_detail::string(*v, "name");
  MG_CONFIG_CHECK(!config.name.empty(), "name must not be empty");
  if (const Json* v = o.find("step")) config.step = step_kind_from(config_detail::string(*v, "step"));
  config.layer = read_layer(o.required("layer"));
  if (const Json* v = o.find("router")) config.router = read_router(*v);
  if (const Json* v = o.find("precision")) config.precision = read_precision(*v);
  if (const Json* v = o.find("training")) config.training = read_training(*v);
  if (const Json* v = o.find("parallel")) config.parallel = read_parallel(*v, config.layer);
  MG_CONFIG_CHECK(config.parallel.expert_parallel == 1 || config.step == StepKind::kMoeLayer,
                  "parallel.expert_parallel > 1 needs step \"moe_layer\" (the router decides which rank each row "
                  "goes to), got step \"", step_kind_name(config.step), "\"");
  MG_CONFIG_CHECK(config.parallel.sharding.ranks == 1 || !config.precision.prequantized_weights,
                  "parallel.sharding.ranks > 1 cannot take precision.prequantized_weights: the shards are the 16-bit "
                  "weights, and the step quantizes what it gathers");
  config.buckets = read_buckets(o.required("buckets"));
  if (const Json* v = o.find("row_align")) {
    const int64_t align = config_detail::integer_in(*v, "row_align", 1, 128, "1, 16, 32 or 128");
    MG_CONFIG_CHECK(align == 1 || align == 16 || align == 32 || align == 128,
                    "row_align must be 1, 16, 32 or 128, got ", align);
    config.row_align = static_cast<int>(align);
  }
  // An absent routing object still goes through the cross checks (it means kind "uniform").
  const Json no_routing = Json::object();
  const Json* routing = o.find("routing");
  config.routing = read_routing(routing ? *routing : no_routing, config.layer, config.buckets);
  // In the whole layer the router's choices are the splits; fixed ones could only be ignored.
  MG_CONFIG_CHECK(config.routing.kind != RoutingKind::kFixed || config.step == StepKind::kExperts,
                  "routing.kind \"fixed\" requires step \"experts\", got step \"", step_kind_name(config.step),
                  "\" (with the whole MoE layer the router decides the splits; fixed splits can only drive the "
                  "expert MLP alone)");
  if (const Json* v = o.find("bench")) config.bench = read_bench(*v);
  const MoeLayerOptions largest = moe_layer_options(config, config.buckets.back());
  if (config.parallel.expert_parallel > 1) {
    // The layer's expert-parallel rules, said with the config's keys (validate below names the
    // layer's fields).
    MG_CONFIG_CHECK(config.router.capacity_factor == 0.0, "router.capacity_factor must be 0 with "
                    "parallel.expert_parallel > 1 (not supported yet: bound the receive buffers with "
                    "parallel.recv_rows instead), got ", config.router.capacity_factor);
    MG_CONFIG_CHECK(!config.router.fuse_weights,
                    "router.fuse_weights is not supported with parallel.expert_parallel > 1 yet");
    MG_CONFIG_CHECK(config.parallel.recv_rows % config.row_align == 0, "parallel.recv_rows must be a multiple of "
                    "row_align (", config.row_align, "), got ", config.parallel.recv_rows);
  }
  // The recipe's own shape rules (one can_implement per recipe), on the experts' two grouped linears.
  for (int fc : {1, 2}) {
    const std::string reason = layer::expert_recipe_refusal(largest, fc, moe_expert_rows(largest));
    MG_CONFIG_CHECK(reason.empty(), "precision.recipe \"", recipe_name(config.precision.recipe), "\" cannot run fc", fc,
                    " (layer.hidden ", config.layer.hidden, ", layer.ffn ", config.layer.ffn, ", row_align ",
                    config.row_align, "): ", reason);
  }
  // The layer's own rules on every bucket, so that a config accepted here is one every bucket's
  // layer accepts (sizes past the layout's maximum, the receive bound). validate bounds each buffer;
  // laying the workspace and window out bounds their sums too (wgrad_slots multiplies the saved
  // activations: a config whose every buffer fits could still pass the maximum).
  for (int64_t tokens : config.buckets) {
    const MoeLayerOptions o = moe_layer_options(config, tokens);
    try {
      validate(o);
    } catch (const Error& e) {
      MG_CONFIG_CHECK(false, "bucket of ", tokens, " tokens: ", e.message());
    }
    if (config.step != StepKind::kMoeLayer) continue;  // the experts-only step lays out its own buffers (graphs/)
    try {
      (void)MoeLayer::workspace_bytes(o);
      (void)MoeLayer::window_bytes(o);
    } catch (const Error& e) {
      MG_CONFIG_CHECK(false, "bucket of ", tokens, " tokens: ", e.message(),
                      " (the layer sizes, the bucket and training.wgrad_slots set it)");
    }
  }
  // Fixed splits already say how many rows each expert gets: a partial fill would contradict them.
  MG_CONFIG_CHECK(config.routing.kind != RoutingKind::kFixed || config.bench.fill == 1.0,
                  "bench.fill must be 1 with routing.kind \"fixed\" (the fixed splits fill every bucket), got ",
                  config.bench.fill);
  return config;
}

}  // namespace

std::string_view routing_kind_name(RoutingKind kind) {
  switch (kind) {
    case RoutingKind::kUniform: return "uniform";
    case RoutingKind::kZipf: return "zipf";
    case RoutingKind::kFixed: return "fixed";
  }
  return "?";
}

Config parse_config(const std::string& json_text, const std::string& source) {
  try {
    return read_config(config_detail::parse_document(json_text));
  } catch (const ConfigError& e) {
    // Schema code does not know where the text came from; every message starts with the source.
    throw ConfigError(e.file(), e.line(), detail::concat(source, ": ", e.message()), e.kind());
  }
}

Config load_config(const std::string& path) {
  return parse_config(config_detail::read_document_file(path, "config file"), path);
}

Config default_config() { return parse_config(kDefaultConfigJson, "<built-in>"); }

std::string to_json(const Config& c) {
  Json splits = Json::array();
  for (int64_t s : c.routing.fixed_splits) splits.push_back(s);
  const Json document = {
      {"name", c.name},
      {"step", std::string(step_kind_name(c.step))},
      {"layer",
       {{"experts", c.layer.experts},
        {"hidden", c.layer.hidden},
        {"ffn", c.layer.ffn},
        {"top_k", c.layer.top_k},
        {"bias", c.layer.bias},
        {"activation", c.layer.activation}}},
      {"router",
       {{"score", std::string(router_score_name(c.router.score))},
        {"renormalize", c.router.renormalize},
        {"aux_loss_coef", c.router.aux_loss_coef},
        {"capacity_factor", c.router.capacity_factor},
        {"fuse_weights", c.router.fuse_weights}}},
      {"precision", {{"recipe", std::string(recipe_name(c.precision.recipe))}, {"dtype", std::string(dtype_name(c.precision.dtype))},
                     {"prequantized_weights", c.precision.prequantized_weights},
                     {"dequantized_weights", c.precision.dequantized_weights}}},
      {"training",
       {{"enabled", c.training.enabled},
        {"delay_wgrad", c.training.delay_wgrad},
        {"wgrad_slots", c.training.wgrad_slots},
        {"main_grad_fp32", c.training.main_grad_fp32}}},
      {"parallel", {{"expert_parallel", c.parallel.expert_parallel}, {"recv_rows", c.parallel.recv_rows},
                    {"exchange", std::string(ep_exchange_name(c.parallel.exchange))},
                    {"chunk_rows", c.parallel.chunk_rows},
                    {"sharding", {{"ranks", c.parallel.sharding.ranks},
                                  {"policy", std::string(shard_policy_name(c.parallel.sharding.policy))},
                                  {"unit", std::string(shard_unit_name(c.parallel.sharding.unit))}}}}},
      {"buckets", c.buckets},
      {"row_align", c.row_align},
      {"routing",
       {{"kind", std::string(routing_kind_name(c.routing.kind))},
        {"skew", c.routing.skew},
        {"seed", c.routing.seed},
        {"fixed_splits", splits}}},
      {"bench", {{"replays", c.bench.replays}, {"warmup", c.bench.warmup}, {"fill", c.bench.fill}}},
  };
  // A Config built in code may hold a name that is not UTF-8; never throw while printing it.
  return document.dump(2, ' ', false, Json::error_handler_t::replace);
}

}  // namespace moegraph
