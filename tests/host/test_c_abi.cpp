// The C ABI's conventions on paths that never reach a GPU: version, status strings, size-prefixed
// structs (and structs that grew), live-handle checks, configs and the StepGraphs entry points'
// refusals. Expert parallelism: test_c_abi_ep.cpp; MXFP8 weights: test_c_abi_mxfp8.cpp.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "moegraph/config.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/moe_layer.hpp"
#include "moegraph/moegraph.h"
#include "moegraph/mxfp8_weights.hpp"
#include "src/c_api/c_api_common.hpp"
#include "tests/host/c_abi_helpers.hpp"

namespace moegraph {
namespace {

using namespace c_abi_test;

TEST(CAbiVersion, MacrosAndQueryAgree) {
  EXPECT_EQ(mg_version(), MOEGRAPH_VERSION);
  EXPECT_EQ(MOEGRAPH_VERSION, MOEGRAPH_VERSION_MAJOR * 10000 + MOEGRAPH_VERSION_MINOR * 100 + MOEGRAPH_VERSION_PATCH);
  const std::string text = std::to_string(MOEGRAPH_VERSION_MAJOR) + "." + std::to_string(MOEGRAPH_VERSION_MINOR) +
                           "." + std::to_string(MOEGRAPH_VERSION_PATCH);
  EXPECT_EQ(text, MOEGRAPH_VERSION_STRING);
  EXPECT_GT(mg_nccl_version(), 0);
}

TEST(CAbiStatus, EveryStatusHasItsOwnString) {
  std::set<std::string> seen;
  for (int s = MG_OK; s <= MG_ERR_INVALID_HANDLE; ++s) {
    const std::string text = mg_status_string(static_cast<mg_status>(s));
    EXPECT_NE(text, "unknown status") << s;
    EXPECT_TRUE(seen.insert(text).second) << "status " << s << " repeats \"" << text << "\"";
  }
  EXPECT_STREQ(mg_status_string(static_cast<mg_status>(MG_ERR_INVALID_HANDLE + 1)), "unknown status");
  EXPECT_STREQ(mg_status_string(static_cast<mg_status>(-1)), "unknown status");
}

TEST(CAbiStructs, InitSetsTheSizeAndTheSizeQueryMatchesTheCppApi) {
  const mg_grouped_linear_options o = small_linear();
  EXPECT_EQ(o.struct_size, sizeof(mg_grouped_linear_options));
  size_t bytes = 0;
  ASSERT_EQ(mg_grouped_linear_workspace_bytes(&o, &bytes), MG_OK) << mg_last_error();
  GroupedLinearOptions cpp;
  cpp.num_groups = 8, cpp.in_features = 256, cpp.out_features = 512, cpp.capacity_rows = 1024;
  EXPECT_EQ(bytes, GroupedLinear::workspace_bytes(cpp));
  EXPECT_EQ(mg_grouped_linear_workspace_bytes(&o, nullptr), MG_ERR_INVALID_ARGUMENT);
  mg_grouped_linear_options bad = o;
  bad.in_features = 100;
  bytes = 7;
  EXPECT_EQ(mg_grouped_linear_workspace_bytes(&bad, &bytes), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bytes, 0u);
  EXPECT_TRUE(last_error_has("in_features (K) must be a positive multiple of 16, got 100")) << mg_last_error();
}

TEST(CAbiStructs, AMissingOrShortSizeIsRefusedNamingTheStruct) {
  mg_grouped_linear_options o = small_linear();
  size_t bytes = 0;
  for (size_t size : {size_t{0}, size_t{8}, offsetof(mg_grouped_linear_options, prequantized_weights) - 4}) {
    o.struct_size = size;
    EXPECT_EQ(mg_grouped_linear_workspace_bytes(&o, &bytes), MG_ERR_INVALID_ARGUMENT) << size;
    EXPECT_TRUE(last_error_has("mg_grouped_linear_options.struct_size must be sizeof(mg_grouped_linear_options)"))
        << mg_last_error();
  }
  mg_moe_layer_options m;
  std::memset(&m, 0, sizeof(m));  // never initialized: struct_size 0
  EXPECT_EQ(mg_moe_layer_workspace_bytes(&m, &bytes), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("mg_moe_layer_options.struct_size")) << mg_last_error();
}

// A caller built against newer headers passes a larger struct: a zero tail (fields at their
// defaults) is accepted with the same result, a set unknown field is refused.
TEST(CAbiStructs, ALargerStructNeedsAZeroTail) {
  struct Newer {
    mg_grouped_linear_options known;
    int64_t future_field;
  };
  Newer n{small_linear(), 0};
  n.known.struct_size = sizeof(Newer);
  size_t expected = 0, got = 0;
  const mg_grouped_linear_options o = small_linear();
  ASSERT_EQ(mg_grouped_linear_workspace_bytes(&o, &expected), MG_OK) << mg_last_error();
  ASSERT_EQ(mg_grouped_linear_workspace_bytes(&n.known, &got), MG_OK) << mg_last_error();
  EXPECT_EQ(got, expected);
  n.future_field = 3;
  EXPECT_EQ(mg_grouped_linear_workspace_bytes(&n.known, &got), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("does not know set at byte")) << mg_last_error();
}

TEST(CAbiHandles, NullHandlesAreRefusedAsInvalidHandles) {
  EXPECT_EQ(mg_grouped_linear_backward_dw(nullptr, nullptr), MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(last_error_has("null mg_grouped_linear handle")) << mg_last_error();
  EXPECT_EQ(mg_step_graphs_replay(nullptr, 0, MG_PHASE_FORWARD, nullptr), MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(last_error_has("null mg_step_graphs handle")) << mg_last_error();
  int n = 5;
  EXPECT_EQ(mg_step_graphs_num_buckets(nullptr, &n), MG_ERR_INVALID_HANDLE);
  EXPECT_EQ(n, 0) << "a refused call leaves its output 0";
  int64_t tokens = 5;
  EXPECT_EQ(mg_step_graphs_bucket_tokens(nullptr, 0, &tokens), MG_ERR_INVALID_HANDLE);
  EXPECT_EQ(tokens, 0);
  mg_config_shape shape = sized<mg_config_shape>();
  EXPECT_EQ(mg_config_shape_of(nullptr, &shape), MG_ERR_INVALID_HANDLE);
  mg_grouped_linear_destroy(nullptr);  // no-ops
  mg_moe_layer_destroy(nullptr);
  mg_config_destroy(nullptr);
  mg_step_graphs_destroy(nullptr);
}

TEST(CAbiConfig, ParseLoadAndShape) {
  mg_config* c = nullptr;
  ASSERT_EQ(mg_config_default(&c), MG_OK) << mg_last_error();
  mg_config_shape s = sized<mg_config_shape>();
  ASSERT_EQ(mg_config_shape_of(c, &s), MG_OK) << mg_last_error();
  const Config d = default_config();
  EXPECT_EQ(s.whole_layer, 1);
  EXPECT_EQ(s.experts, d.layer.experts);
  EXPECT_EQ(s.hidden, d.layer.hidden);
  EXPECT_EQ(s.ffn, d.layer.ffn);
  EXPECT_EQ(s.top_k, d.layer.top_k);
  EXPECT_EQ(s.num_buckets, static_cast<int>(d.buckets.size()));
  EXPECT_EQ(s.max_tokens, d.buckets.back());
  EXPECT_EQ(s.training, d.training.enabled ? 1 : 0);
  EXPECT_EQ(s.delay_wgrad, 1);  // the preset delays its wgrad
  ASSERT_EQ(mg_config_set_training(c, 0), MG_OK);
  ASSERT_EQ(mg_config_shape_of(c, &s), MG_OK);
  EXPECT_EQ(s.training, 0);
  EXPECT_EQ(s.delay_wgrad, 0) << "a forward-only config delays no wgrad";
  ASSERT_EQ(mg_config_set_training(c, 0), MG_OK);  // again: still restores the preset's setting
  ASSERT_EQ(mg_config_set_training(c, 1), MG_OK) << mg_last_error();
  ASSERT_EQ(mg_config_shape_of(c, &s), MG_OK);
  EXPECT_EQ(s.training, 1);
  EXPECT_EQ(s.delay_wgrad, 1) << "training on again restores the delayed wgrad";
  mg_config_destroy(c);

  // A config that can only serve: training is refused and the config stays forward-only.
  ASSERT_EQ(mg_config_parse(R"({"layer": {"experts": 8, "hidden": 256, "ffn": 512, "top_k": 2},
                               "precision": {"recipe": "mxfp8"}, "training": {"enabled": false},
                               "buckets": [16]})",
                            &c),
            MG_OK)
      << mg_last_error();
  EXPECT_EQ(mg_config_set_training(c, 1), MG_ERR_CONFIG);
  EXPECT_NE(std::string(mg_last_error()).find("row_align"), std::string::npos) << mg_last_error();
  ASSERT_EQ(mg_config_shape_of(c, &s), MG_OK);
  EXPECT_EQ(s.training, 0);
  mg_config_destroy(c);

  const char* text = R"({"layer": {"experts": 16, "hidden": 512, "ffn": 256, "top_k": 2, "bias": true},
                         "precision": {"dtype": "fp16"}, "buckets": [32, 96]})";
  ASSERT_EQ(mg_config_parse(text, &c), MG_OK) << mg_last_error();
  ASSERT_EQ(mg_config_shape_of(c, &s), MG_OK);
  EXPECT_EQ(s.experts, 16);
  EXPECT_EQ(s.hidden, 512);
  EXPECT_EQ(s.ffn, 256);
  EXPECT_EQ(s.bias, 1);
  EXPECT_EQ(s.dtype, MG_DTYPE_FP16);
  EXPECT_EQ(s.num_buckets, 2);
  EXPECT_EQ(s.max_tokens, 96);
  // A short output struct is refused, a larger one gets a zeroed tail.
  mg_config_shape tiny = sized<mg_config_shape>();
  tiny.struct_size = 8;
  EXPECT_EQ(mg_config_shape_of(c, &tiny), MG_ERR_INVALID_ARGUMENT);
  struct Newer {
    mg_config_shape known;
    int64_t future;
  } n{};
  n.known.struct_size = sizeof(Newer);
  n.future = -1;
  ASSERT_EQ(mg_config_shape_of(c, &n.known), MG_OK) << mg_last_error();
  EXPECT_EQ(n.known.struct_size, sizeof(Newer));
  EXPECT_EQ(n.known.experts, 16);
  EXPECT_EQ(n.future, 0);
  EXPECT_EQ(n.known.shard_ranks, 1);  // not sharded
  mg_config_destroy(c);
}

// A sharded config says how its shards are cut, so that a C caller can size them (mg_shard_rows);
// a caller of the release before these fields keeps its struct as it was past its end.
TEST(CAbiConfig, ShapeCarriesTheSharding) {
  mg_config* c = nullptr;
  ASSERT_EQ(mg_config_parse(R"({"layer": {"experts": 8, "hidden": 256, "ffn": 128, "top_k": 2}, "buckets": [32],
                               "parallel": {"sharding": {"ranks": 4, "policy": "balanced", "unit": "row"}}})",
                            &c),
            MG_OK)
      << mg_last_error();
  mg_config_shape s = sized<mg_config_shape>();
  ASSERT_EQ(mg_config_shape_of(c, &s), MG_OK) << mg_last_error();
  EXPECT_EQ(s.shard_ranks, 4);
  EXPECT_EQ(s.shard_policy, MG_SHARD_BALANCED);
  EXPECT_EQ(s.shard_unit, MG_SHARD_UNIT_ROW);
  mg_config_destroy(c);
  ASSERT_EQ(mg_config_parse(R"({"layer": {"experts": 8, "hidden": 256, "ffn": 128, "top_k": 2}, "buckets": [32],
                               "parallel": {"sharding": {"ranks": 2}}})",
                            &c),
            MG_OK);
  s = sized<mg_config_shape>();
  ASSERT_EQ(mg_config_shape_of(c, &s), MG_OK);
  EXPECT_EQ(s.shard_ranks, 2);
  EXPECT_EQ(s.shard_policy, MG_SHARD_CHUNK);
  EXPECT_EQ(s.shard_unit, MG_SHARD_UNIT_EXPERT);

  mg_config_shape older;
  std::memset(&older, 0x5a, sizeof older);
  older.struct_size = offsetof(mg_config_shape, shard_ranks);
  ASSERT_EQ(mg_config_shape_of(c, &older), MG_OK) << mg_last_error();
  EXPECT_EQ(older.experts, 8);
  const auto* bytes = reinterpret_cast<const unsigned char*>(&older);
  for (std::size_t i = offsetof(mg_config_shape, shard_ranks); i < sizeof older; ++i)
    EXPECT_EQ(bytes[i], 0x5a) << "byte " << i << " past an older caller's struct was written";
  mg_config_destroy(c);
}

TEST(CAbiConfig, BadConfigsAreRefusedWithTheReason) {
  mg_config* c = reinterpret_cast<mg_config*>(0x1);
  EXPECT_EQ(mg_config_parse("{\"layer\": {\"experts\": 8,}", &c), MG_ERR_CONFIG);
  EXPECT_EQ(c, nullptr);
  EXPECT_TRUE(last_error_has("line 1")) << mg_last_error();
  EXPECT_EQ(mg_config_parse(R"({"layer": {"expertz": 8}})", &c), MG_ERR_CONFIG);
  EXPECT_TRUE(last_error_has("expertz")) << mg_last_error();
  EXPECT_EQ(mg_config_parse(R"({"layer": {"experts": 8, "hidden": 256, "ffn": 256}, "buckets": [64, 32]})", &c),
            MG_ERR_CONFIG);
  EXPECT_TRUE(last_error_has("buckets")) << mg_last_error();
  EXPECT_EQ(mg_config_load("/nonexistent/moegraph-config.json", &c), MG_ERR_CONFIG);
  EXPECT_TRUE(last_error_has("/nonexistent/moegraph-config.json")) << mg_last_error();
  EXPECT_EQ(mg_config_parse(nullptr, &c), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_config_load(nullptr, &c), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_config_parse("{}", nullptr), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_config_default(nullptr), MG_ERR_INVALID_ARGUMENT);
}

TEST(CAbiHandles, ADestroyedHandleIsRefusedAndDestroyingItAgainIsHarmless) {
  mg_config* c = nullptr;
  ASSERT_EQ(mg_config_default(&c), MG_OK);
  mg_config_destroy(c);
  mg_config_shape s = sized<mg_config_shape>();
  EXPECT_EQ(mg_config_shape_of(c, &s), MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(last_error_has("mg_config handle that is not live")) << mg_last_error();
  EXPECT_EQ(mg_config_set_training(c, 0), MG_ERR_INVALID_HANDLE);
  mg_step_graphs* step = reinterpret_cast<mg_step_graphs*>(0x1);
  const mg_step_weights w = sized<mg_step_weights>();
  EXPECT_EQ(mg_step_graphs_create(c, &w, nullptr, &step), MG_ERR_INVALID_HANDLE);
  EXPECT_EQ(step, nullptr);
  mg_config_destroy(c);  // again: nothing happens
}

TEST(CAbiHandles, AHandleOfAnotherKindIsRefused) {
  mg_config* c = nullptr;
  ASSERT_EQ(mg_config_default(&c), MG_OK);
  int n = 0;
  EXPECT_EQ(mg_step_graphs_num_buckets(reinterpret_cast<mg_step_graphs*>(c), &n), MG_ERR_INVALID_HANDLE);
  EXPECT_EQ(mg_moe_layer_backward_dw(reinterpret_cast<mg_moe_layer*>(c), nullptr), MG_ERR_INVALID_HANDLE);
  mg_step_graphs_destroy(reinterpret_cast<mg_step_graphs*>(c));  // not a step: left alone
  mg_config_shape s = sized<mg_config_shape>();
  EXPECT_EQ(mg_config_shape_of(c, &s), MG_OK) << mg_last_error();
  mg_config_destroy(c);
}

// Refusals that come before the step touches a GPU.
TEST(CAbiStepGraphs, CreateRefusesMissingArguments) {
  mg_config* c = nullptr;
  ASSERT_EQ(mg_config_parse(R"({"layer": {"experts": 8, "hidden": 256, "ffn": 256}, "buckets": [64]})", &c), MG_OK);
  mg_step_graphs* step = reinterpret_cast<mg_step_graphs*>(0x1);
  EXPECT_EQ(mg_step_graphs_create(c, nullptr, nullptr, &step), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(step, nullptr);
  EXPECT_TRUE(last_error_has("null mg_step_weights")) << mg_last_error();
  const mg_step_weights empty = sized<mg_step_weights>();
  EXPECT_EQ(mg_step_graphs_create(c, &empty, nullptr, nullptr), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_step_graphs_create(c, &empty, nullptr, &step), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("StepWeights needs w1 and w2")) << mg_last_error();
  const mg_step_graphs_options unsized{};
  EXPECT_EQ(mg_step_graphs_create(c, &empty, &unsized, &step), MG_ERR_INVALID_ARGUMENT);
  mg_config_destroy(c);
}

}  // namespace
}  // namespace moegraph
