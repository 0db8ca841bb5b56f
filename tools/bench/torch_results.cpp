#include "tools/bench/torch_results.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "src/config/json_reader.hpp"

namespace moegraph::bench {
namespace {

using config_detail::Json;

std::string key_path(const std::string& object, const std::string& key) {
  return object.empty() ? key : object + "." + key;
}

// `object[key]`, which must be there; `path` names the object in messages.
const Json& member(const Json& object, const std::string& path, const std::string& key) {
  MG_CONFIG_CHECK(object.is_object(), (path.empty() ? "the document" : path), " must be an object, got ",
                  config_detail::describe(object));
  const auto it = object.find(key);
  MG_CONFIG_CHECK(it != object.end(), "missing key \"", key_path(path, key), "\"");
  return *it;
}

// `object[key]` as a string, or "" when absent (fields that only describe the run).
std::string optional_string(const Json& object, const std::string& key) {
  const auto it = object.find(key);
  return it != object.end() && it->is_string() ? it->get<std::string>() : std::string();
}

std::string list(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// The single entry of `configs` that holds the results of the config named `name`.
const Json& entry_of(const Json& configs, const std::string& name) {
  const Json* found = nullptr;
  int count = 0;
  std::string names;
  const std::vector<Json>& entries = config_detail::array(configs, "configs");
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const std::string at = "configs[" + std::to_string(i) + "]";
    const std::string entry_name =
        config_detail::string(member(member(entries[i], at, "config"), at + ".config", "name"), at + ".config.name");
    names += (names.empty() ? "" : ", ") + config_detail::quoted_excerpt(entry_name);
    if (entry_name == name) found = &entries[i], ++count;
  }
  MG_CONFIG_CHECK(count > 0, "no results of config ", config_detail::quoted_excerpt(name), " (it holds ",
                  names.empty() ? "none" : names, "); run scripts/torch-moe-bench --json on the same config");
  MG_CONFIG_CHECK(count == 1, count, " results of config ", config_detail::quoted_excerpt(name),
                  "; give --torch a file with one");
  return *found;
}

// The layer and phase the PyTorch run timed must be this config's (a stale file of the same name
// would otherwise compare two different layers).
void check_same_layer(const Json& cfg, const Config& c) {
  auto integer = [&](const char* key, const char* config_key, int64_t want) {
    const int64_t got = config_detail::integer_in(member(cfg, "config", key), std::string("config.") + key, 1,
                                                  int64_t{1} << 40);
    MG_CONFIG_CHECK(got == want, "it was run with ", config_key, " ", got, ", this config has ", want);
  };
  integer("experts", "layer.experts", c.layer.experts);
  integer("hidden", "layer.hidden", c.layer.hidden);
  integer("ffn", "layer.ffn", c.layer.ffn);
  integer("top_k", "layer.top_k", c.layer.top_k);
  const bool training = config_detail::boolean(member(cfg, "config", "training"), "config.training");
  MG_CONFIG_CHECK(training == c.training.enabled, "it timed ", training ? "training" : "inference",
                  ", this config ", c.training.enabled ? "training" : "inference", " (training.enabled)");
  const std::string dtype = config_detail::string(member(cfg, "config", "dtype"), "config.dtype");
  MG_CONFIG_CHECK(dtype == dtype_name(c.precision.dtype), "it was run in ", dtype, ", this config in ",
                  dtype_name(c.precision.dtype), " (precision.dtype)");
  // The router and the experts' bias change what the layer computes (and its cost).
  auto flag = [&](const char* key, const char* config_key, bool want) {
    const bool got = config_detail::boolean(member(cfg, "config", key), std::string("config.") + key);
    MG_CONFIG_CHECK(got == want, "it was run with ", config_key, " ", got ? "true" : "false", ", this config has ",
                    want ? "true" : "false");
  };
  flag("bias", "layer.bias", c.layer.bias);
  flag("renormalize", "router.renormalize", c.router.renormalize);
  const std::string score = config_detail::string(member(cfg, "config", "score"), "config.score");
  MG_CONFIG_CHECK(score == router_score_name(c.router.score), "it was run with router.score \"", score,
                  "\", this config has \"", router_score_name(c.router.score), "\"");
  const double aux = config_detail::number(member(cfg, "config", "aux_coef"), "config.aux_coef");
  MG_CONFIG_CHECK(aux == c.router.aux_loss_coef, "it was run with router.aux_loss_coef ", aux, ", this config has ",
                  c.router.aux_loss_coef);
  // What the PyTorch layer does not model: its times would be of another layer.
  MG_CONFIG_CHECK(c.step == StepKind::kMoeLayer, "the PyTorch layer is the whole MoE layer; this config's step is \"",
                  step_kind_name(c.step), "\"");
  MG_CONFIG_CHECK(c.router.capacity_factor == 0.0, "the PyTorch layer routes dropless; this config has "
                  "router.capacity_factor ", c.router.capacity_factor);
  std::vector<int64_t> buckets;
  for (const Json& b : config_detail::array(member(cfg, "config", "buckets"), "config.buckets"))
    buckets.push_back(config_detail::integer_in(b, "config.buckets[]", 1, int64_t{1} << 40));
  MG_CONFIG_CHECK(buckets == c.buckets, "its buckets are ", list(buckets), ", this config's ", list(c.buckets));
}

}  // namespace

TorchResults load_torch_results(const std::string& path, const Config& c) {
  const std::string text = config_detail::read_document_file(path, "torch results file");  // names the file
  try {
    const Json doc = config_detail::parse_document(text);
    const Json& entry = entry_of(member(doc, "", "configs"), c.name);
    check_same_layer(member(entry, "", "config"), c);
    TorchResults r;
    r.path = path;
    r.device = optional_string(doc, "device");
    r.torch_version = optional_string(doc, "torch");
    r.grouped_mm = optional_string(entry, "grouped_mm");
    const std::vector<Json>& records = config_detail::array(member(entry, "", "buckets"), "buckets");
    for (std::size_t i = 0; i < records.size(); ++i) {
      const std::string at = "buckets[" + std::to_string(i) + "]";
      auto count = [&](const char* key) {
        return config_detail::integer_in(member(records[i], at, key), at + "." + key, 1, int64_t{1} << 40);
      };
      const int64_t bucket = count("bucket");
      TorchBucket b;
      b.tokens = count("tokens");
      const Json& ms = member(records[i], at, "graph_ms");  // null: the bucket or its capture failed
      if (!ms.is_null()) {
        b.graph_ms = config_detail::number(ms, at + ".graph_ms");
        MG_CONFIG_CHECK(*b.graph_ms > 0, at, ".graph_ms must be positive, got ", *b.graph_ms);
      }
      MG_CONFIG_CHECK(r.buckets.emplace(bucket, b).second, "the bucket of ", bucket, " tokens appears twice");
    }
    // Matched by token count: each bucket of the config, and the tokens routed in it (bench.fill
    // truncated, as run_bucket routes them).
    for (const int64_t bucket : c.buckets) {
      const auto it = r.buckets.find(bucket);
      MG_CONFIG_CHECK(it != r.buckets.end(), "no result for the bucket of ", bucket,
                      " tokens (was it run with --buckets?)");
      const int64_t routed = std::max<int64_t>(1, static_cast<int64_t>(bucket * c.bench.fill));
      MG_CONFIG_CHECK(it->second.tokens == routed, "its bucket of ", bucket, " tokens routed ", it->second.tokens,
                      " tokens, this config routes ", routed, " (bench.fill differs)");
    }
    return r;
  } catch (const Error& e) {
    throw ConfigError(__FILE__, __LINE__, "torch results file \"" + path + "\": " + e.message());
  }
}

}  // namespace moegraph::bench
