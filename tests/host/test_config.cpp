// The JSON config layer: every error class names source, key path, value and rule; the presets
// parse, print with every key and round-trip; the built-in default is the Qwen3 preset file.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "moegraph/config.hpp"
#include "moegraph/moe_layer.hpp"
#include "moegraph/step_graphs.hpp"
#include "src/config/json_reader.hpp"

namespace moegraph {
namespace {

using Json = nlohmann::ordered_json;

// Plain gtest (gmock is not linked): assertions that print the message when they fail.
::testing::AssertionResult contains(const std::string& message, const std::string& part) {
  if (message.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "message:  " << message << "\nexpected: ..." << part << "...";
}
::testing::AssertionResult starts_with(const std::string& message, const std::string& prefix) {
  if (message.rfind(prefix, 0) == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "message:  " << message << "\nexpected: " << prefix << "...";
}

// Works from the build directory (meson test) and from the repository root: first relative to
// this source file's path as the compiler saw it, then walking up from the working directory.
std::filesystem::path configs_dir() {
  namespace fs = std::filesystem;
  std::vector<fs::path> candidates{fs::path(__FILE__).parent_path() / ".." / ".." / "configs"};
  for (fs::path dir = fs::current_path();; dir = dir.parent_path()) {
    candidates.push_back(dir / "configs");
    if (dir == dir.parent_path()) break;
  }
  for (const fs::path& dir : candidates)
    if (fs::exists(dir / "qwen3-30b-a3b.json")) return dir;
  ADD_FAILURE() << "configs/ not found from " << __FILE__ << " or " << fs::current_path();
  return {};
}

std::string preset_path(const std::string& name) { return (configs_dir() / (name + ".json")).string(); }

const std::vector<std::string> kPresets{"mixtral-8x7b", "deepseek-v3-ep-shard", "qwen3-30b-a3b", "qwen3-30b-a3b-sharded",
                                        "decode"};

Json base() {
  return Json::parse(R"({"layer": {"experts": 8, "hidden": 256, "ffn": 512, "top_k": 2}, "buckets": [64, 128]})");
}

// `base()` with each (JSON pointer, JSON text) set; a null text removes the key.
std::string with(std::initializer_list<std::pair<const char*, const char*>> edits, Json doc = base()) {
  for (const auto& [pointer, text] : edits) {
    const Json::json_pointer p(pointer);
    if (text == nullptr)
      doc.at(p.parent_pointer()).erase(p.back());
    else
      doc[p] = Json::parse(text);
  }
  return doc.dump();
}

Json fixed_base() {
  Json doc = base();
  doc["step"] = "experts";  // the whole layer's router would decide the splits itself
  doc["buckets"] = {64};
  doc["routing"] = Json::parse(R"({"kind": "fixed", "fixed_splits": [16, 16, 16, 16, 16, 16, 16, 16]})");
  return doc;
}

// The message of the ConfigError that parsing `text` raises ("" and a test failure when none).
std::string error_of(const std::string& text, const std::string& source = "test.json") {
  try {
    parse_config(text, source);
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_TRUE(starts_with(e.message(), source + ": "));
    return e.message();
  }
  ADD_FAILURE() << "no ConfigError for: " << text;
  return "";
}

struct BadDoc {
  std::string name;
  std::string json;
  std::string expected;  // a substring of the message
};
void PrintTo(const BadDoc& doc, std::ostream* os) { *os << doc.name << ": " << doc.json; }

std::vector<BadDoc> bad_docs() {
  return {
      // Wrong types.
      {"HiddenString", with({{"/layer/hidden", R"("4096")"}}), R"(layer.hidden must be an integer, got string "4096")"},
      {"HiddenFloat", with({{"/layer/hidden", "4096.0"}}), "layer.hidden must be an integer, got number 4096.0"},
      {"BiasInt", with({{"/layer/bias", "1"}}), "layer.bias must be a boolean (true or false), got number 1"},
      {"EnabledString", with({{"/training/enabled", R"("yes")"}}),
       R"(training.enabled must be a boolean (true or false), got string "yes")"},
      {"SkewString", with({{"/routing/skew", R"("1.2")"}}), R"(routing.skew must be a number, got string "1.2")"},
      {"NameNumber", with({{"/name", "5"}}), "name must be a string, got number 5"},
      {"LayerArray", with({{"/layer", "[]"}}), "layer must be an object, got array"},
      {"BucketsObject", with({{"/buckets", "{}"}}), "buckets must be an array, got object"},
      {"BucketString", with({{"/buckets/1", R"("128")"}}), R"(buckets[1] must be an integer, got string "128")"},
      {"TopKNull", with({{"/layer/top_k", "null"}}), "layer.top_k must be an integer, got null"},
      {"SeedFloat", with({{"/routing/seed", "1.5"}}), "routing.seed must be a non-negative integer, got number 1.5"},
      {"TopLevelArray", "[1, 2]", "the config must be a JSON object, got array"},
      {"TopLevelNull", "null", "the config must be a JSON object, got null"},
      // Out of range.
      {"ExpertsZero", with({{"/layer/experts", "0"}}), "layer.experts must be in [1, 1024], got 0"},
      {"ExpertsTooMany", with({{"/layer/experts", "1025"}}), "layer.experts must be in [1, 1024], got 1025"},
      {"ExpertsBeyondInt64", with({{"/layer/experts", "18446744073709551615"}}),
       "layer.experts must be in [1, 1024], got 18446744073709551615"},
      {"ExpertsBeyond64Bits", R"({"layer": {"experts": 99999999999999999999999}})",
       "layer.experts must be in [1, 1024], got 1e+23 (out of range)"},
      {"HiddenNotMultiple", with({{"/layer/hidden", "4100"}}),
       "layer.hidden must be a positive multiple of 16 (at most 1048576), got 4100"},
      {"FfnZero", with({{"/layer/ffn", "0"}}), "layer.ffn must be a positive multiple of 16 (at most 1048576), got 0"},
      {"FfnHuge", with({{"/layer/ffn", "9223372036854775792"}}),
       "layer.ffn must be a positive multiple of 16 (at most 1048576), got 9223372036854775792"},
      {"TopKNine", with({{"/layer/top_k", "9"}}), "layer.top_k must be in [1, 8], got 9"},
      {"TopKZero", with({{"/layer/top_k", "0"}}), "layer.top_k must be in [1, 8], got 0"},
      {"ActivationGelu", with({{"/layer/activation", R"("gelu")"}}),
       R"(layer.activation must be "swiglu" (the only one implemented), got "gelu")"},
      {"RecipeFp8", with({{"/precision/recipe", R"("fp8")"}}),
       R"(precision.recipe must be "bf16" or "mxfp8", got "fp8")"},
      {"Mxfp8RowAlign1", with({{"/precision/recipe", R"("mxfp8")"}}),
       R"(precision.recipe "mxfp8" cannot run fc1 (layer.hidden 256, layer.ffn 512, row_align 1): the mxfp8 recipe trains only at row_align 32 or 128 (a column-wise block of 32 rows must not straddle two groups), got 1; at row_align 1 or 16 it serves forward only)"},
      {"Mxfp8Ffn", with({{"/precision/recipe", R"("mxfp8")"}, {"/row_align", "32"}, {"/layer/ffn", "784"}}),
       R"(precision.recipe "mxfp8" cannot run fc1 (layer.hidden 256, layer.ffn 784, row_align 32): the mxfp8 recipe needs in_features (K) and out_features (N) multiples of 128, got K 256 and N 1568)"},
      {"DtypeFp32", with({{"/precision/dtype", R"("fp32")"}}),
       R"(precision.dtype must be "bf16" or "fp16", got "fp32")"},
      {"WgradSlotsZero", with({{"/training/wgrad_slots", "0"}}), "training.wgrad_slots must be in [1, 64], got 0"},
      {"WgradSlots65", with({{"/training/wgrad_slots", "65"}}), "training.wgrad_slots must be in [1, 64], got 65"},
      {"BucketZero", with({{"/buckets/0", "0"}}), "buckets[0] must be in [1, 1048576], got 0"},
      {"BucketTooBig", with({{"/buckets/1", "1048577"}}), "buckets[1] must be in [1, 1048576], got 1048577"},
      {"RowAlign8", with({{"/row_align", "8"}}), "row_align must be 1, 16, 32 or 128, got 8"},
      {"RowAlign256", with({{"/row_align", "256"}}), "row_align must be 1, 16, 32 or 128, got 256"},
      {"RoutingKindRandom", with({{"/routing/kind", R"("random")"}}),
       R"(routing.kind must be "uniform", "zipf" or "fixed", got "random")"},
      {"SkewZero", with({{"/routing/skew", "0"}}), "routing.skew must be greater than 0, got 0"},
      {"SkewNegative", with({{"/routing/skew", "-1.5"}}), "routing.skew must be greater than 0, got -1.5"},
      {"SeedBeyond64Bits", with({{"/routing/seed", "1e30"}}),
       "routing.seed must be a non-negative integer below 2^64, got 1e+30 (out of range)"},
      {"SeedNegative", with({{"/routing/seed", "-1"}}), "routing.seed must be a non-negative integer, got -1"},
      {"ReplaysZero", with({{"/bench/replays", "0"}}), "bench.replays must be in [1, 1000000], got 0"},
      {"ReplaysOverflowInt", with({{"/bench/replays", "99999999999"}}),
       "bench.replays must be in [1, 1000000], got 99999999999"},
      {"WarmupNegative", with({{"/bench/warmup", "-1"}}), "bench.warmup must be in [0, 1000000], got -1"},
      {"FillZero", with({{"/bench/fill", "0"}}), "bench.fill must be in (0, 1], got 0"},
      {"FillAboveOne", with({{"/bench/fill", "1.5"}}), "bench.fill must be in (0, 1], got 1.5"},
      {"NameEmpty", with({{"/name", R"("")"}}), "name must not be empty"},
      // The step and the router.
      {"StepUnknown", with({{"/step", R"("layer")"}}), R"(step must be "moe_layer" or "experts", got "layer")"},
      {"StepCase", with({{"/step", R"("MoE_Layer")"}}), R"(step must be "moe_layer" or "experts", got "MoE_Layer")"},
      {"StepNumber", with({{"/step", "1"}}), "step must be a string, got number 1"},
      {"RouterArray", with({{"/router", "[]"}}), "router must be an object, got array"},
      {"ScoreRelu", with({{"/router/score", R"("relu")"}}),
       R"(router.score must be "softmax" or "sigmoid", got "relu")"},
      {"ScoreNumber", with({{"/router/score", "0"}}), "router.score must be a string, got number 0"},
      {"RenormalizeInt", with({{"/router/renormalize", "1"}}),
       "router.renormalize must be a boolean (true or false), got number 1"},
      {"FuseWeightsString", with({{"/router/fuse_weights", R"("false")"}}),
       R"(router.fuse_weights must be a boolean (true or false), got string "false")"},
      {"AuxNegative", with({{"/router/aux_loss_coef", "-0.01"}}),
       "router.aux_loss_coef must be a finite number >= 0 (0 turns the auxiliary loss off), got -0.01"},
      {"AuxString", with({{"/router/aux_loss_coef", R"("0.01")"}}),
       R"(router.aux_loss_coef must be a number, got string "0.01")"},
      {"AuxNull", with({{"/router/aux_loss_coef", "null"}}), "router.aux_loss_coef must be a number, got null"},
      {"CapacityNegative", with({{"/router/capacity_factor", "-1.25"}}),
       "router.capacity_factor must be 0 (dropless) or a finite number > 0 (at most ceil(capacity_factor * tokens * "
       "top_k / experts) rows per expert), got -1.25"},
      {"CapacityTinyNegative", with({{"/router/capacity_factor", "-1e-300"}}),
       "router.capacity_factor must be 0 (dropless) or a finite number > 0"},
      {"CapacityBool", with({{"/router/capacity_factor", "true"}}),
       "router.capacity_factor must be a number, got boolean true"},
      // Inconsistent values.
      {"TopKAboveExperts", with({{"/layer/experts", "4"}, {"/layer/top_k", "6"}}),
       "layer.top_k must be at most layer.experts (4), got 6"},
      {"DelayWgradWithoutTraining", with({{"/training", R"({"enabled": false, "delay_wgrad": true})"}}),
       "training.delay_wgrad requires training.enabled"},
      {"BucketsEqual", with({{"/buckets", "[64, 64]"}}),
       "buckets must be strictly increasing, got buckets[1] = 64 after buckets[0] = 64"},
      {"BucketsDecreasing", with({{"/buckets", "[64, 256, 128]"}}),
       "buckets must be strictly increasing, got buckets[2] = 128 after buckets[1] = 256"},
      {"BucketsEmpty", with({{"/buckets", "[]"}}), "buckets must not be empty"},
      {"FixedSplitsLength", with({{"/routing/fixed_splits", "[16, 16, 16, 16, 16, 16, 32]"}}, fixed_base()),
       "routing.fixed_splits must have one entry per expert (layer.experts = 8), got 7 entries"},
      {"FixedSplitsSum", with({{"/buckets", "[64, 128]"}}, fixed_base()),
       "routing.fixed_splits sum to 128 rows but buckets[1] = 128 tokens * layer.top_k 2 = 256 rows"},
      {"FixedSplitsMissing", with({{"/routing/fixed_splits", nullptr}}, fixed_base()),
       R"(routing.fixed_splits is required when routing.kind is "fixed")"},
      {"FixedSplitsNegative", with({{"/routing/fixed_splits/3", "-5"}}, fixed_base()),
       "routing.fixed_splits[3] must be in [0, 8388608], got -5"},
      {"FixedSplitsWithPartialFill", with({{"/bench", R"({"fill": 0.5})"}}, fixed_base()),
       R"(bench.fill must be 1 with routing.kind "fixed" (the fixed splits fill every bucket), got 0.5)"},
      {"FixedWithMoeLayer", with({{"/step", R"("moe_layer")"}}, fixed_base()),
       R"(routing.kind "fixed" requires step "experts", got step "moe_layer" (with the whole MoE layer the router )"
       R"(decides the splits; fixed splits can only drive the expert MLP alone))"},
      {"FixedWithDefaultStep", with({{"/step", nullptr}}, fixed_base()),
       R"(routing.kind "fixed" requires step "experts", got step "moe_layer")"},
      {"SplitsWithZipf", with({{"/routing/kind", R"("zipf")"}}, fixed_base()),
       R"(routing.fixed_splits must be empty unless routing.kind is "fixed", got 8 entries with routing.kind "zipf")"},
      // Missing required keys.
      {"MissingLayer", with({{"/layer", nullptr}}), R"(missing required key "layer")"},
      {"MissingHidden", with({{"/layer/hidden", nullptr}}), R"(missing required key "layer.hidden")"},
      {"MissingBuckets", with({{"/buckets", nullptr}}), R"(missing required key "buckets")"},
      // Unknown keys; a typo is reported as a typo even when it hides a required key.
      {"UnknownTopLevel", with({{"/nmae", R"("x")"}}), R"(unknown key "nmae"; did you mean "name"?)"},
      {"UnknownNested", with({{"/layer/hidden", nullptr}, {"/layer/hiden", "256"}}),
       R"(unknown key "layer.hiden"; did you mean "layer.hidden"?)"},
      {"UnknownCase", with({{"/routing/Seed", "1"}}), R"(unknown key "routing.Seed"; did you mean "routing.seed"?)"},
      {"UnknownRouterKey", with({{"/router/renormalise", "true"}}),
       R"(unknown key "router.renormalise"; did you mean "router.renormalize"?)"},
      {"UnknownRouterKeyCase", with({{"/router/Capacity_Factor", "1.0"}}),
       R"(unknown key "router.Capacity_Factor"; did you mean "router.capacity_factor"?)"},
      {"UnknownRouterKeyTypo", with({{"/router/aux_loss_coeff", "0.01"}}),
       R"(unknown key "router.aux_loss_coeff"; did you mean "router.aux_loss_coef"?)"},
      {"UnknownRouterFar", with({{"/router/topk", "2"}}),
       R"(unknown key "router.topk"; valid keys in "router": score, renormalize, aux_loss_coef, capacity_factor, )"
       "fuse_weights"},
      {"UnknownStepTypo", with({{"/stpe", R"("experts")"}}), R"(unknown key "stpe"; did you mean "step"?)"},
      {"UnknownFarNested", with({{"/bench/x", "1"}}),
       R"(unknown key "bench.x"; valid keys in "bench": replays, warmup, fill)"},
      {"UnknownFarTopLevel", with({{"/zzzzzz", "1"}}),
       R"(unknown key "zzzzzz"; valid keys at the top level: name, step, layer, router, precision, training, )"
       "parallel, buckets, row_align, routing, bench"},
      // Expert parallelism.
      {"EpNotDividing", with({{"/parallel", R"({"expert_parallel": 3})"}}),
       "parallel.expert_parallel (3) must divide layer.experts (8)"},
      {"EpTooMany", with({{"/parallel", R"({"expert_parallel": 128})"}}), "parallel.expert_parallel"},
      {"EpRecvRowsAlone", with({{"/parallel", R"({"recv_rows": 64})"}}),
       "parallel.recv_rows needs parallel.expert_parallel > 1, got recv_rows 64"},
      {"EpWithExpertsStep", with({{"/parallel", R"({"expert_parallel": 2})"}, {"/step", R"("experts")"}}),
       R"(parallel.expert_parallel > 1 needs step "moe_layer")"},
      {"EpWithFusedWeights",
       with({{"/parallel", R"({"expert_parallel": 2})"}, {"/router", R"({"fuse_weights": true})"}}),
       "router.fuse_weights is not supported with parallel.expert_parallel > 1 yet"},
      {"EpRecvRowsNotAligned",
       with({{"/parallel", R"({"expert_parallel": 2, "recv_rows": 100})"}, {"/row_align", "16"}}),
       "parallel.recv_rows must be a multiple of row_align (16), got 100"},
      {"EpWithCapacityFactor",
       with({{"/parallel", R"({"expert_parallel": 2})"}, {"/router", R"({"capacity_factor": 1.0})"}}),
       "router.capacity_factor must be 0 with parallel.expert_parallel > 1 (not supported yet: bound the receive "
       "buffers with parallel.recv_rows instead), got 1"},
      // Sizes no bucket's layer could lay out are refused with the config, naming the bucket.
      {"WeightsPastTheLayout", with({{"/layer/experts", "1024"}, {"/layer/hidden", "1048576"},
                                     {"/layer/ffn", "1048576"}}),
       "bucket of 64 tokens: "},
      {"EpUnknownKey", with({{"/parallel", R"({"ep": 2})"}}), R"(unknown key "parallel.ep")"},
      {"EpBadExchange", with({{"/parallel", R"({"expert_parallel": 2, "exchange": "alltoall"})"}}),
       R"(parallel.exchange must be "peer_stores" or "send_recv", got "alltoall")"},
      {"EpSendRecvAlone", with({{"/parallel", R"({"exchange": "send_recv"})"}}),
       R"(parallel.exchange "send_recv" needs parallel.expert_parallel > 1)"},
      {"EpChunkRowsWithPeerStores", with({{"/parallel", R"({"expert_parallel": 2, "chunk_rows": 16})"}}),
       R"(parallel.chunk_rows needs parallel.exchange "send_recv", got chunk_rows 16)"},
      {"EpChunkRowsNegative",
       with({{"/parallel", R"({"expert_parallel": 2, "exchange": "send_recv", "chunk_rows": -1})"}}),
       "parallel.chunk_rows"},
      {"ShardRanksOutOfRange", with({{"/parallel", R"({"sharding": {"ranks": 65}})"}}), "parallel.sharding.ranks"},
      {"ShardBadPolicy", with({{"/parallel", R"({"sharding": {"ranks": 2, "policy": "even"}})"}}),
       R"(parallel.sharding.policy must be "chunk" or "balanced", got "even")"},
      {"ShardBadUnit", with({{"/parallel", R"({"sharding": {"ranks": 2, "unit": "column"}})"}}),
       R"(parallel.sharding.unit must be "expert" or "row", got "column")"},
      {"ShardUnknownKey", with({{"/parallel", R"({"sharding": {"world": 2}})"}}),
       R"(unknown key "parallel.sharding.world")"},
      {"ShardWithPrequantizedWeights",
       with({{"/parallel", R"({"sharding": {"ranks": 2}})"},
             {"/precision", R"({"recipe": "mxfp8", "prequantized_weights": true})"}, {"/row_align", "32"}}),
       "parallel.sharding.ranks > 1 cannot take precision.prequantized_weights"},
      // Each buffer within the layout's maximum, but 64 wgrad slots of saved activations past it.
      {"WorkspacePastTheLayoutMaximum",
       with({{"/layer", R"({"experts": 8, "hidden": 1048576, "ffn": 16, "top_k": 8})"}, {"/buckets", "[1048576]"},
             {"/training", R"({"delay_wgrad": true, "wgrad_slots": 64})"}}),
       "bucket of 1048576 tokens: workspace buffer"},
      // Duplicates would silently keep one value.
      {"DuplicateTopLevel", R"({"name": "a", "name": "b"})", R"(duplicate key "name")"},
      {"DuplicateNested", R"({"layer": {"experts": 8, "experts": 9}})", R"(duplicate key "layer.experts")"},
      {"DuplicateInArray", R"({"buckets": [1, {"a": 1, "a": 2}]})", R"(duplicate key "buckets[1].a")"},
  };
}

class ConfigErrors : public ::testing::TestWithParam<BadDoc> {};

TEST_P(ConfigErrors, NameKeyValueAndRule) { EXPECT_TRUE(contains(error_of(GetParam().json), GetParam().expected)); }

INSTANTIATE_TEST_SUITE_P(Config, ConfigErrors, ::testing::ValuesIn(bad_docs()),
                         [](const ::testing::TestParamInfo<BadDoc>& info) { return info.param.name; });

TEST(ConfigSyntax, ReportsLineAndColumnOfTheBadCharacter) {
  const std::string m = error_of("{\n  \"name\": x\n}", "bad.json");
  EXPECT_TRUE(starts_with(m, "bad.json: invalid JSON at line 2, column 11: "));
  EXPECT_TRUE(contains(m, "invalid literal"));
  EXPECT_FALSE(contains(m, "[json.exception"));
}

TEST(ConfigSyntax, TrailingCommaAndEndOfInput) {
  EXPECT_TRUE(contains(error_of(R"({"buckets": [1, 2,]})"), "line 1, column 19: "));
  const std::string m = error_of("{\n\"layer\": {");
  EXPECT_TRUE(contains(m, "line 2, column 11: "));
  EXPECT_TRUE(contains(m, "unexpected end of input"));
  EXPECT_TRUE(contains(error_of(""), "line 1, column 1: "));
}

TEST(ConfigSyntax, NumberOverflowIsASyntaxErrorWithPosition) {
  const std::string m = error_of("{\"bench\":\n {\"fill\": 1e400}}");
  EXPECT_TRUE(contains(m, "invalid JSON at line 2, column 15: "));
  EXPECT_TRUE(contains(m, "number overflow"));
}

TEST(ConfigSyntax, IllFormedUtf8IsNotCopiedIntoTheMessage) {
  const std::string m = error_of("{\"name\": \"ab\xff\"}");
  EXPECT_TRUE(contains(m, "line 1, column 13: "));
  EXPECT_TRUE(contains(m, "ill-formed UTF-8"));
  EXPECT_EQ(m.find('\xff'), std::string::npos);
}

TEST(ConfigSyntax, NeverCrashesOnTruncatedOrCorruptedText) {
  std::ifstream in(preset_path("qwen3-30b-a3b"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  ASSERT_FALSE(text.empty());
  std::mt19937 rng(7);
  for (std::size_t n = 0; n <= text.size(); ++n) {
    std::string corrupted = text;
    corrupted[rng() % corrupted.size()] = static_cast<char>(rng() % 256);
    for (const std::string& t : {text.substr(0, n), corrupted}) {
      try {
        parse_config(t, "fuzz");
      } catch (const ConfigError&) {
      }  // any other exception fails the test
    }
  }
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_TRUE(contains(error_of(deep), "nested deeper than 64 levels"));
  EXPECT_TRUE(contains(error_of(std::string(100000, '{')), "invalid JSON at line 1"));
  // Deep inside an object with later siblings: building the document copied the nest recursively
  // and overflowed the stack before the depth was bounded.
  const auto nested = [](std::size_t depth) {
    return "{\"a\":" + std::string(depth, '[') + std::string(depth, ']') + ",\"b\":1,\"c\":1}";
  };
  const std::string m = error_of(nested(100000));
  EXPECT_TRUE(contains(m, "nested deeper than 64 levels (at \"a[0][0]")) << m;
  EXPECT_TRUE(contains(error_of(nested(63)), "unknown key \"a\"")) << error_of(nested(63));  // 64 levels: read
}

TEST(ConfigErrorsMisc, MinusZeroIsZeroForEveryInteger) {
  EXPECT_EQ(parse_config(with({{"/routing/seed", "-0"}}), "t").routing.seed, 0u);
  EXPECT_EQ(parse_config(with({{"/bench/warmup", "-0"}}), "t").bench.warmup, 0);
}

TEST(ConfigErrorsMisc, ALongTokenInASyntaxErrorIsCutShort) {
  const std::string m = error_of("{\"name\": \"" + std::string(1000000, 'a') + "\x01\"}");
  EXPECT_TRUE(contains(m, "last read: '\"aaaa")) << m.substr(0, 300);
  EXPECT_LT(m.size(), 400u);
  // Only the token is cut: what nlohmann says after it (what it expected) stays whole.
  const std::string e = error_of("{\"layer\" \"" + std::string(100, 'x') + "\n\"}");
  EXPECT_TRUE(contains(e, "xxx...'")) << e;
  EXPECT_FALSE(contains(e, "<U+00")) << "the cut token keeps no half escape: " << e;
  EXPECT_LT(e.size(), 400u);
}

TEST(ConfigErrorsMisc, LongKeysAreCutShortInMessages) {
  const std::string key(10000, 'k');
  const std::string m = error_of(with({{("/" + key).c_str(), "1"}}));
  EXPECT_TRUE(contains(m, "unknown key \"kkkk"));
  EXPECT_LT(m.size(), 400u);
}

TEST(ConfigEditDistance, CountsInsertionsDeletionsAndSubstitutions) {
  EXPECT_EQ(config_detail::edit_distance("hidden", "hidden"), 0u);
  EXPECT_EQ(config_detail::edit_distance("hiden", "hidden"), 1u);
  EXPECT_EQ(config_detail::edit_distance("nmae", "name"), 2u);
  EXPECT_EQ(config_detail::edit_distance("", "ffn"), 3u);
  EXPECT_EQ(config_detail::edit_distance("kitten", "sitting"), 3u);
}

TEST(ConfigFile, MissingFileNamesThePath) {
  try {
    load_config("/nonexistent/moegraph/cfg.json");
    FAIL() << "no error for a missing file";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(contains(e.message(), "cannot open config file \"/nonexistent/moegraph/cfg.json\""));
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  }
  EXPECT_THROW(load_config(configs_dir().string()), ConfigError);
}

TEST(ConfigFile, ErrorsInAFileNameTheFile) {
  const auto path = std::filesystem::temp_directory_path() / "moegraph-test-config-bad.json";
  std::ofstream(path) << with({{"/layer/top_k", "9"}});
  try {
    load_config(path.string());
    FAIL() << "no error for top_k 9";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.message(), path.string() + ": layer.top_k must be in [1, 8], got 9");
  }
  std::filesystem::remove(path);
}

TEST(ConfigPresets, ParseWithExpectedValues) {
  const Config mixtral = load_config(preset_path("mixtral-8x7b"));
  EXPECT_EQ(mixtral.name, "mixtral-8x7b");
  EXPECT_EQ(mixtral.layer.experts, 8);
  EXPECT_EQ(mixtral.layer.hidden, 4096);
  EXPECT_EQ(mixtral.layer.ffn, 14336);
  EXPECT_EQ(mixtral.layer.top_k, 2);
  EXPECT_TRUE(mixtral.training.delay_wgrad);
  EXPECT_EQ(mixtral.training.wgrad_slots, 2);
  EXPECT_EQ(mixtral.routing.kind, RoutingKind::kZipf);
  EXPECT_DOUBLE_EQ(mixtral.routing.skew, 1.2);

  const Config deepseek = load_config(preset_path("deepseek-v3-ep-shard"));
  EXPECT_EQ(deepseek.layer.experts, 32);
  EXPECT_EQ(deepseek.layer.hidden, 7168);
  EXPECT_EQ(deepseek.layer.ffn, 2048);
  EXPECT_EQ(deepseek.layer.top_k, 8);

  const Config qwen = load_config(preset_path("qwen3-30b-a3b"));
  EXPECT_EQ(qwen.layer.experts, 128);
  EXPECT_EQ(qwen.layer.ffn, 768);
  EXPECT_EQ(qwen.buckets, (std::vector<int64_t>{1024, 2048, 4096}));
  EXPECT_EQ(qwen.precision.dtype, DType::kBF16);

  const Config decode = load_config(preset_path("decode"));
  EXPECT_EQ(decode.layer.experts, 64);
  EXPECT_EQ(decode.layer.ffn, 1408);
  EXPECT_EQ(decode.layer.top_k, 6);
  EXPECT_FALSE(decode.training.enabled);
  EXPECT_EQ(decode.routing.kind, RoutingKind::kUniform);
  EXPECT_EQ(decode.buckets, (std::vector<int64_t>{1, 8, 32, 64, 128, 256}));

  // Each preset's router is the model's: top-k renormalized softmax (Mixtral, Qwen3), renormalized
  // sigmoid (DeepSeek-V3), plain softmax weights without a balancing loss for decode.
  struct Router {
    const Config& config;
    RouterScore score;
    bool renormalize;
    double aux_loss_coef;
  };
  constexpr RouterScore kSoftmax = RouterScore::kSoftmax, kSigmoid = RouterScore::kSigmoid;
  for (const Router& r : {Router{mixtral, kSoftmax, true, 0.01}, Router{deepseek, kSigmoid, true, 0.0001},
                          Router{qwen, kSoftmax, true, 0.001}, Router{decode, kSoftmax, false, 0.0}}) {
    EXPECT_EQ(r.config.step, StepKind::kMoeLayer) << r.config.name;
    EXPECT_EQ(r.config.router.score, r.score) << r.config.name;
    EXPECT_EQ(r.config.router.renormalize, r.renormalize) << r.config.name;
    EXPECT_EQ(r.config.router.aux_loss_coef, r.aux_loss_coef) << r.config.name;
    EXPECT_EQ(r.config.router.capacity_factor, 0.0) << r.config.name;
    EXPECT_FALSE(r.config.router.fuse_weights) << r.config.name;
  }

  // The benchmark keeps every bucket's routed rows small enough to fit GPU memory quickly.
  for (const std::string& name : kPresets) {
    const Config c = load_config(preset_path(name));
    EXPECT_LE(c.buckets.back() * c.layer.top_k, 65536) << name;
  }
}

TEST(ConfigDefaults, MissingKeysTakeTheStructDefaults) {
  const Config c = parse_config(R"({"layer": {"experts": 4, "hidden": 64, "ffn": 128}, "buckets": [16]})", "min");
  const Config d;
  EXPECT_EQ(c.name, d.name);
  EXPECT_EQ(c.layer.top_k, d.layer.top_k);
  EXPECT_EQ(c.layer.bias, d.layer.bias);
  EXPECT_EQ(c.layer.activation, d.layer.activation);
  EXPECT_EQ(c.precision.recipe, d.precision.recipe);
  EXPECT_EQ(c.precision.dtype, d.precision.dtype);
  EXPECT_EQ(c.training.enabled, d.training.enabled);
  EXPECT_EQ(c.training.delay_wgrad, d.training.delay_wgrad);
  EXPECT_EQ(c.training.wgrad_slots, d.training.wgrad_slots);
  EXPECT_EQ(c.training.main_grad_fp32, d.training.main_grad_fp32);
  EXPECT_EQ(c.row_align, d.row_align);
  EXPECT_EQ(c.step, d.step);
  EXPECT_EQ(c.step, StepKind::kMoeLayer);
  EXPECT_EQ(c.router.score, d.router.score);
  EXPECT_EQ(c.router.score, RouterScore::kSoftmax);
  EXPECT_EQ(c.router.renormalize, d.router.renormalize);
  EXPECT_EQ(c.router.aux_loss_coef, d.router.aux_loss_coef);
  EXPECT_EQ(c.router.capacity_factor, d.router.capacity_factor);
  EXPECT_EQ(c.router.capacity_factor, 0.0);  // dropless unless asked
  EXPECT_EQ(c.router.fuse_weights, d.router.fuse_weights);
  EXPECT_EQ(c.routing.kind, d.routing.kind);
  EXPECT_EQ(c.routing.skew, d.routing.skew);
  EXPECT_EQ(c.routing.seed, d.routing.seed);
  EXPECT_EQ(c.bench.replays, d.bench.replays);
  EXPECT_EQ(c.bench.warmup, d.bench.warmup);
  EXPECT_EQ(c.bench.fill, d.bench.fill);

  // to_json writes every key, defaults included.
  const Json j = Json::parse(to_json(c));
  for (const char* pointer :
       {"/name", "/step", "/layer/top_k", "/layer/bias", "/layer/activation", "/router/score", "/router/renormalize",
        "/router/aux_loss_coef", "/router/capacity_factor", "/router/fuse_weights", "/precision/recipe",
        "/precision/dtype", "/training/enabled", "/training/delay_wgrad", "/training/wgrad_slots",
        "/training/main_grad_fp32", "/buckets", "/row_align", "/routing/kind", "/routing/skew", "/routing/seed",
        "/routing/fixed_splits", "/bench/replays", "/bench/warmup", "/bench/fill", "/parallel/exchange",
        "/parallel/chunk_rows", "/parallel/sharding/ranks", "/parallel/sharding/policy", "/parallel/sharding/unit"})
    EXPECT_TRUE(j.contains(Json::json_pointer(pointer))) << pointer;
  EXPECT_EQ(j["precision"]["dtype"], "bf16");
  EXPECT_EQ(j["routing"]["kind"], "uniform");
  EXPECT_EQ(j["step"], "moe_layer");
  EXPECT_EQ(j["router"]["score"], "softmax");
}

TEST(ConfigSharding, KeysReachTheStepOptionsAndRoundTrip) {
  const Config c =
      parse_config(with({{"/parallel", R"({"sharding": {"ranks": 4, "policy": "balanced", "unit": "row"}})"}}), "shard");
  EXPECT_EQ(c.parallel.sharding.ranks, 4);
  EXPECT_EQ(c.parallel.sharding.policy, ShardPolicy::kBalanced);
  EXPECT_EQ(c.parallel.sharding.unit, ShardUnit::kRow);
  const StepGraphsOptions o = step_graphs_options(c);
  EXPECT_EQ(o.sharding.ranks, 4);
  EXPECT_EQ(o.sharding.policy, ShardPolicy::kBalanced);
  EXPECT_EQ(o.sharding.unit, ShardUnit::kRow);
  const Config back = parse_config(to_json(c), "round trip");
  EXPECT_EQ(back.parallel.sharding.ranks, 4);
  EXPECT_EQ(back.parallel.sharding.policy, ShardPolicy::kBalanced);
  EXPECT_EQ(back.parallel.sharding.unit, ShardUnit::kRow);
  const Config d = parse_config(with({{"/parallel", R"({"sharding": {}})"}}), "defaults");
  EXPECT_EQ(d.parallel.sharding.ranks, 1);
  EXPECT_EQ(d.parallel.sharding.policy, ShardPolicy::kChunk);
  EXPECT_EQ(d.parallel.sharding.unit, ShardUnit::kExpert);
}

// With expert parallelism too, the shards are rows of the rank's own experts: the window a rank
// gathers into is that of a layer of E/R experts sharded the same way.
TEST(ConfigSharding, WithExpertParallelTheShardsAreOfTheLocalExperts) {
  const Config both = parse_config(
      with({{"/parallel", R"({"expert_parallel": 2, "sharding": {"ranks": 2, "unit": "row"}})"}}), "ep x dp");
  EXPECT_EQ(both.parallel.expert_parallel, 2);
  EXPECT_EQ(both.parallel.sharding.ranks, 2);
  const StepGraphsOptions o = step_graphs_options(both);
  EXPECT_EQ(o.layer.expert_parallel, 2);
  StepGraphsOptions local = o;
  local.layer.expert_parallel = 1;
  local.layer.experts = o.layer.experts / 2;
  const std::size_t window = plan_step(o).shard_window_bytes;
  EXPECT_GT(window, 0u);
  EXPECT_EQ(window, plan_step(local).shard_window_bytes);
  const Config back = parse_config(to_json(both), "round trip");
  EXPECT_EQ(back.parallel.expert_parallel, 2);
  EXPECT_EQ(back.parallel.sharding.ranks, 2);
}

// One receive bound for buckets of every size: a bucket whose worst case is at or below it sizes its
// worst case (nothing can be dropped there), the larger ones the bound. It used to be refused unless
// it fitted the smallest bucket, which left the large buckets no useful bound.
TEST(ConfigExpertParallel, OneReceiveBoundServesEveryBucket) {
  const Config c = parse_config(with({{"/parallel", R"({"expert_parallel": 2, "recv_rows": 300})"}}), "bound");
  ASSERT_EQ(c.buckets, (std::vector<int64_t>{64, 128}));
  const MoeLayerOptions small = moe_layer_options(c, 64), large = moe_layer_options(c, 128);
  EXPECT_EQ(moe_ep_worst_case_rows(small), 2 * 64 * 2);
  EXPECT_EQ(moe_expert_rows(small), 2 * 64 * 2) << "the bound is above this bucket's worst case";
  EXPECT_EQ(moe_expert_rows(large), 300);
  const StepGraphsOptions o = step_graphs_options(c);
  EXPECT_NO_THROW(validate(o));
  const StepPlan plan = plan_step(o);
  ASSERT_EQ(plan.buckets.size(), 2u);
  MoeLayerOptions dropless = small;
  dropless.ep_recv_rows = 0;
  EXPECT_EQ(plan.buckets[0].window_bytes, MoeLayer::window_bytes(dropless));
  EXPECT_EQ(plan.buckets[1].window_bytes, MoeLayer::window_bytes(large));
  EXPECT_LT(MoeLayer::window_bytes(large), MoeLayer::window_bytes(moe_layer_options(
                                               parse_config(with({{"/parallel", R"({"expert_parallel": 2})"}}), "w"),
                                               128)));
}

TEST(ConfigDefaults, AnEmptyRouterObjectIsTheDefaultRouter) {
  const Config c = parse_config(with({{"/router", "{}"}}), "empty router");
  const Config d;
  EXPECT_EQ(c.router.score, d.router.score);
  EXPECT_EQ(c.router.renormalize, d.router.renormalize);
  EXPECT_EQ(c.router.aux_loss_coef, d.router.aux_loss_coef);
  EXPECT_EQ(c.router.capacity_factor, d.router.capacity_factor);
  EXPECT_EQ(c.router.fuse_weights, d.router.fuse_weights);
}

TEST(ConfigRouter, BoundaryValuesAreAccepted) {
  // 0 is dropless / no loss; any positive factor, however small, is a (tiny) capacity.
  const Config zero = parse_config(with({{"/router/aux_loss_coef", "0"}, {"/router/capacity_factor", "0"}}), "zero");
  EXPECT_EQ(zero.router.aux_loss_coef, 0.0);
  EXPECT_EQ(zero.router.capacity_factor, 0.0);
  const Config tiny = parse_config(with({{"/router/capacity_factor", "1e-300"}}), "tiny");
  EXPECT_EQ(tiny.router.capacity_factor, 1e-300);
  // Integers are numbers.
  const Config integral = parse_config(with({{"/router/capacity_factor", "2"}, {"/router/aux_loss_coef", "1"}}), "int");
  EXPECT_EQ(integral.router.capacity_factor, 2.0);
  EXPECT_EQ(integral.router.aux_loss_coef, 1.0);
}

TEST(ConfigStep, ExpertsStepAcceptsFixedRoutingAndEveryOtherKind) {
  const Config fixed = parse_config(fixed_base().dump(), "fixed");
  EXPECT_EQ(fixed.step, StepKind::kExperts);
  EXPECT_EQ(fixed.routing.kind, RoutingKind::kFixed);
  for (const char* kind : {R"("uniform")", R"("zipf")"}) {
    const Config layer = parse_config(with({{"/step", R"("moe_layer")"}, {"/routing/kind", kind}}), kind);
    EXPECT_EQ(layer.step, StepKind::kMoeLayer);
    const Config experts = parse_config(with({{"/step", R"("experts")"}, {"/routing/kind", kind}}), kind);
    EXPECT_EQ(experts.step, StepKind::kExperts);
  }
}

TEST(ConfigRoundTrip, ToJsonParsesBackToTheSameJson) {
  std::vector<Config> configs;
  for (const std::string& name : kPresets) configs.push_back(load_config(preset_path(name)));
  // Also the values the presets do not exercise: fixed splits, fp16, bias, alignment, a large seed.
  configs.push_back(parse_config(with({{"/precision/dtype", R"("fp16")"},
                                       {"/layer/bias", "true"},
                                       {"/row_align", "128"},
                                       {"/routing/seed", "18446744073709551615"}},
                                      fixed_base()),
                                 "fixed"));
  configs.push_back(parse_config(with({{"/bench/fill", "0.25"}}), "partial fill"));
  // A router that no preset has: sigmoid without renormalization, a capacity, fused weights.
  configs.push_back(parse_config(with({{"/router", R"({"score": "sigmoid", "renormalize": false,
                                                       "aux_loss_coef": 0.02, "capacity_factor": 1.25,
                                                       "fuse_weights": true})"}}),
                                 "router"));
  // Expert parallelism over send/recv chunks of a bound.
  configs.push_back(parse_config(with({{"/parallel", R"({"expert_parallel": 2, "recv_rows": 64,
                                                         "exchange": "send_recv", "chunk_rows": 48})"}}),
                                 "send/recv"));
  const Config ep = configs.back();
  EXPECT_EQ(ep.parallel.exchange, EpExchange::kSendRecv);
  EXPECT_EQ(ep.parallel.chunk_rows, 48);
  EXPECT_EQ(moe_layer_options(ep, 64).ep_chunk_rows, 48);
  EXPECT_EQ(moe_layer_options(ep, 64).ep_exchange, EpExchange::kSendRecv);
  configs.pop_back();
  configs.insert(configs.end() - 3, ep);  // the indices below name the last three
  const Config& fixed = configs[configs.size() - 3];
  EXPECT_EQ(fixed.step, StepKind::kExperts);
  EXPECT_EQ(Json::parse(to_json(fixed))["step"], "experts");
  const Config& router = configs.back();
  EXPECT_EQ(router.router.score, RouterScore::kSigmoid);
  EXPECT_FALSE(router.router.renormalize);
  EXPECT_EQ(router.router.aux_loss_coef, 0.02);
  EXPECT_EQ(router.router.capacity_factor, 1.25);
  EXPECT_TRUE(router.router.fuse_weights);
  EXPECT_EQ(fixed.precision.dtype, DType::kFP16);
  EXPECT_EQ(fixed.routing.seed, 18446744073709551615u);
  EXPECT_EQ(fixed.routing.fixed_splits, std::vector<int64_t>(8, 16));
  EXPECT_EQ(configs[configs.size() - 2].bench.fill, 0.25);
  for (const Config& c : configs) {
    const std::string once = to_json(c);
    const Config again = parse_config(once, "round-trip");
    EXPECT_EQ(to_json(again), once) << c.name;
    // The text comparison would also pass if to_json dropped a key; compare the new fields directly.
    EXPECT_EQ(again.step, c.step) << c.name;
    EXPECT_EQ(again.router.score, c.router.score) << c.name;
    EXPECT_EQ(again.router.renormalize, c.router.renormalize) << c.name;
    EXPECT_EQ(again.router.aux_loss_coef, c.router.aux_loss_coef) << c.name;
    EXPECT_EQ(again.router.capacity_factor, c.router.capacity_factor) << c.name;
    EXPECT_EQ(again.router.fuse_weights, c.router.fuse_weights) << c.name;
    EXPECT_EQ(again.parallel.exchange, c.parallel.exchange) << c.name;
    EXPECT_EQ(again.parallel.chunk_rows, c.parallel.chunk_rows) << c.name;
  }
}

TEST(ConfigDefaults, BuiltInDefaultIsTheQwenPresetFile) {
  const Config d = default_config();
  EXPECT_EQ(d.name, "qwen3-30b-a3b");
  EXPECT_EQ(to_json(d), to_json(load_config(preset_path("qwen3-30b-a3b"))));
}

TEST(ConfigRoutingKind, Names) {
  EXPECT_EQ(routing_kind_name(RoutingKind::kUniform), "uniform");
  EXPECT_EQ(routing_kind_name(RoutingKind::kZipf), "zipf");
  EXPECT_EQ(routing_kind_name(RoutingKind::kFixed), "fixed");
}

TEST(ConfigRecipe, Mxfp8WithAlignedRowsParses) {
  Config c = default_config();
  std::string text = to_json(c);
  const std::string from = R"("recipe": "bf16")", to = R"("recipe": "mxfp8")";
  ASSERT_NE(text.find(from), std::string::npos) << text;
  text.replace(text.find(from), from.size(), to);
  const std::string align = R"("row_align": 1)";
  ASSERT_NE(text.find(align), std::string::npos) << text;
  text.replace(text.find(align), align.size(), R"("row_align": 32)");
  const Config m = parse_config(text, "mxfp8");
  EXPECT_EQ(m.precision.recipe, Recipe::kMXFP8);
  EXPECT_EQ(m.row_align, 32);
}

// Inference keeps no column-wise copies, so the mxfp8 recipe serves at any row_align; training at
// row_align 1 is refused (ConfigErrors.Mxfp8RowAlign1).
TEST(ConfigRecipe, Mxfp8InferenceParsesAtRowAlign1) {
  Config c = load_config((configs_dir() / "decode.json").string());
  ASSERT_FALSE(c.training.enabled);
  ASSERT_EQ(c.row_align, 1);
  c.precision.recipe = Recipe::kMXFP8;
  const Config m = parse_config(to_json(c), "mxfp8 decode");
  EXPECT_EQ(m.precision.recipe, Recipe::kMXFP8);
  EXPECT_EQ(m.row_align, 1);
  c.training.enabled = true;
  try {
    parse_config(to_json(c), "mxfp8 training");
    ADD_FAILURE() << "mxfp8 training at row_align 1 must be refused";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("trains only at row_align 32 or 128"), std::string::npos) << e.message();
  }
}

TEST(ConfigStepKind, Names) {
  EXPECT_EQ(step_kind_name(StepKind::kMoeLayer), "moe_layer");
  EXPECT_EQ(step_kind_name(StepKind::kExperts), "experts");
}

}  // namespace
}  // namespace moegraph
