// Set-up errors: unsupported shapes are refused before any GPU work, naming field, value and rule.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>

#include "moegraph/error.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/moe_layer.hpp"
#include "moegraph/moegraph.h"
#include "moegraph/nccl_ep.hpp"
#include "moegraph/step_graphs.hpp"
#include "src/comm/ep_environment.hpp"

namespace moegraph {
namespace {

GroupedLinearOptions good() {
  GroupedLinearOptions o;
  o.num_groups = 8;
  o.in_features = 256;
  o.out_features = 512;
  o.capacity_rows = 1024;
  return o;
}

std::string error_of(const GroupedLinearOptions& o) {
  try {
    validate(o);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    return e.message();
  }
  return "";
}

TEST(Validation, GoodOptionsPass) { EXPECT_NO_THROW(validate(good())); }

struct BadCase {
  const char* name;
  void (*mutate)(GroupedLinearOptions&);
  const char* expected;
};

class InvalidOptions : public ::testing::TestWithParam<BadCase> {};

TEST_P(InvalidOptions, NamesFieldValueAndRule) {
  GroupedLinearOptions o = good();
  GetParam().mutate(o);
  const std::string msg = error_of(o);
  EXPECT_NE(msg.find(GetParam().expected), std::string::npos) << "message: " << msg;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, InvalidOptions,
    ::testing::Values(
        BadCase{"k_not_multiple_of_16", [](auto& o) { o.in_features = 100; },
                "in_features (K) must be a positive multiple of 16, got 100"},
        BadCase{"n_zero", [](auto& o) { o.out_features = 0; }, "out_features (N) must be a positive multiple of 16, got 0"},
        BadCase{"k_too_wide", [](auto& o) { o.in_features = int64_t{1} << 33; },
                "in_features (K) must be at most 2097152, got 8589934592"},
        BadCase{"n_too_wide", [](auto& o) { o.out_features = int64_t{1} << 22; },
                "out_features (N) must be at most 2097152, got 4194304"},
        BadCase{"no_groups", [](auto& o) { o.num_groups = 0; }, "num_groups must be in [1, 1024], got 0"},
        BadCase{"too_many_groups", [](auto& o) { o.num_groups = 4096; }, "num_groups must be in [1, 1024], got 4096"},
        BadCase{"bad_align", [](auto& o) { o.row_align = 8; }, "row_align must be 1, 16, 32 or 128, got 8"},
        BadCase{"capacity_not_aligned", [](auto& o) { o.row_align = 128; o.capacity_rows = 1000; },
                "capacity_rows must be a multiple of row_align (128), got 1000"},
        BadCase{"no_capacity", [](auto& o) { o.capacity_rows = 0; }, "capacity_rows must be at least 1, got 0"},
        BadCase{"fp32_activations", [](auto& o) { o.dtype = DType::kFP32; }, "dtype must be bf16 or fp16, got fp32"},
        BadCase{"no_slots", [](auto& o) { o.wgrad_slots = 0; }, "wgrad_slots must be in [1, 64], got 0"},
        BadCase{"bad_tile", [](auto& o) { o.tile_n = 64; }, "tile_n must be 0 (automatic), 128 or 256, got 64"},
        BadCase{"bad_pipeline", [](auto& o) { o.pipeline = static_cast<GemmPipeline>(9); },
                "pipeline: unknown value 9 (auto, cp_async or tma)"}),
    [](const auto& info) { return info.param.name; });

// The C++ options' enums are checked too (the C ABI checks its own): an unknown router score ran
// sigmoid, the router kernel testing only for softmax.
TEST(Validation, MoeLayerRefusesAnUnknownScore) {
  MoeLayerOptions o;
  o.experts = 8, o.hidden = 256, o.ffn = 256, o.top_k = 2, o.max_tokens = 64;
  EXPECT_NO_THROW(validate(o));
  o.score = static_cast<RouterScore>(2);
  try {
    validate(o);
    ADD_FAILURE() << "an unknown score was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("score: unknown value 2 (softmax or sigmoid)"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(MoeLayer::workspace_bytes(o), Error);
}

// The step's own enums: an unknown sharding policy or unit was planned as another, an unknown step
// kind failed only when its buckets were made.
TEST(Validation, StepGraphsRefuseUnknownEnumValues) {
  StepGraphsOptions good_step;
  good_step.layer.experts = 8, good_step.layer.hidden = 256, good_step.layer.ffn = 256, good_step.layer.top_k = 2;
  good_step.layer.max_tokens = 64;
  good_step.buckets = {64};
  EXPECT_NO_THROW(validate(good_step));
  const auto refusal = [](const StepGraphsOptions& o) {
    try {
      validate(o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  StepGraphsOptions o = good_step;
  o.step = static_cast<StepKind>(5);
  EXPECT_NE(refusal(o).find("step: unknown value 5"), std::string::npos) << refusal(o);
  o = good_step, o.capture_mode = static_cast<cudaStreamCaptureMode>(42);
  EXPECT_NE(refusal(o).find("capture_mode: unknown value 42"), std::string::npos) << refusal(o);
  o = good_step, o.sharding.policy = static_cast<ShardPolicy>(7);
  EXPECT_NE(refusal(o).find("sharding.policy: unknown value 7"), std::string::npos) << refusal(o);
  o = good_step, o.sharding.unit = static_cast<ShardUnit>(9);
  EXPECT_NE(refusal(o).find("sharding.unit: unknown value 9"), std::string::npos) << refusal(o);
}

TEST(Validation, ErrorCarriesFileAndLine) {
  GroupedLinearOptions o = good();
  o.in_features = 7;
  try {
    validate(o);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_GT(e.line(), 0);
    EXPECT_NE(std::string(e.file()).find("grouped_linear.cpp"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("grouped_linear.cpp:"), std::string::npos);
  }
}

TEST(Validation, MgCheckBuildsMessageFromParts) {
  try {
    const int h = 100;
    MG_CHECK(h % 16 == 0, "layer.hidden must be a multiple of 16, got ", h);
    FAIL() << "MG_CHECK did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "layer.hidden must be a multiple of 16, got 100");
  }
}

TEST(CAbi, BadOptionsGiveInvalidArgumentWithoutTouchingTheGpu) {
  mg_grouped_linear_options o;
  mg_grouped_linear_options_init(&o);
  o.num_groups = 8;
  o.in_features = 100;
  o.out_features = 64;
  o.capacity_rows = 64;
  mg_grouped_linear* op = reinterpret_cast<mg_grouped_linear*>(0x1);
  EXPECT_EQ(mg_grouped_linear_create(&o, nullptr, &op), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(op, nullptr);
  EXPECT_NE(std::string(mg_last_error()).find("in_features (K) must be a positive multiple of 16, got 100"),
            std::string::npos)
      << mg_last_error();
  EXPECT_EQ(mg_grouped_linear_create(nullptr, nullptr, &op), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_grouped_linear_backward_dw(nullptr, nullptr), MG_ERR_INVALID_HANDLE);
  EXPECT_NE(std::string(mg_last_error()).find("null mg_grouped_linear handle"), std::string::npos);
}

mg_moe_layer_options good_moe() {
  mg_moe_layer_options o;
  mg_moe_layer_options_init(&o);
  o.experts = 8;
  o.hidden = 256;
  o.ffn = 512;
  o.top_k = 2;
  o.max_tokens = 1024;
  return o;
}

TEST(CAbi, MoeLayerOptionsInitGivesTheCppDefaults) {
  mg_moe_layer_options o;
  std::memset(&o, 0x5a, sizeof o);
  mg_moe_layer_options_init(&o);
  const MoeLayerOptions d;
  EXPECT_EQ(o.experts, d.experts);
  EXPECT_EQ(o.hidden, d.hidden);
  EXPECT_EQ(o.ffn, d.ffn);
  EXPECT_EQ(o.top_k, 1);
  EXPECT_EQ(o.top_k, d.top_k);
  EXPECT_EQ(o.bias, 0);
  EXPECT_EQ(o.score, MG_ROUTER_SOFTMAX);
  EXPECT_EQ(o.renormalize, 0);
  EXPECT_EQ(o.aux_loss_coef, d.aux_loss_coef);
  EXPECT_EQ(o.capacity_factor, d.capacity_factor);
  EXPECT_EQ(o.fuse_weights, 0);
  EXPECT_EQ(o.max_tokens, d.max_tokens);
  EXPECT_EQ(o.row_align, 1);
  EXPECT_EQ(o.dtype, MG_DTYPE_BF16);
  EXPECT_EQ(o.training, 1);
  EXPECT_EQ(o.wgrad_slots, 1);
  EXPECT_EQ(o.delay_wgrad, 0);
  EXPECT_EQ(o.main_grad_fp32, 1);
  (mg_moe_layer_options_init)(nullptr);  // the function: a no-op, no crash
  EXPECT_EQ(mg_moe_layer_options_init_sized(nullptr, sizeof(mg_moe_layer_options)), MG_ERR_INVALID_ARGUMENT);
}

TEST(CAbi, MoeLayerWorkspaceBytesMatchesTheCppApi) {
  mg_moe_layer_options o = good_moe();
  o.bias = 1;
  o.score = MG_ROUTER_SIGMOID;
  o.renormalize = 1;
  o.capacity_factor = 1.25;
  o.row_align = 128;
  o.dtype = MG_DTYPE_FP16;
  o.wgrad_slots = 2;
  o.delay_wgrad = 1;
  size_t bytes = 0;
  ASSERT_EQ(mg_moe_layer_workspace_bytes(&o, &bytes), MG_OK) << mg_last_error();
  EXPECT_GT(bytes, 0u);
  EXPECT_STREQ(mg_last_error(), "");

  MoeLayerOptions cpp;
  cpp.experts = 8;
  cpp.hidden = 256;
  cpp.ffn = 512;
  cpp.top_k = 2;
  cpp.max_tokens = 1024;
  cpp.bias = true;
  cpp.score = RouterScore::kSigmoid;
  cpp.renormalize = true;
  cpp.capacity_factor = 1.25;
  cpp.row_align = 128;
  cpp.dtype = DType::kFP16;
  cpp.wgrad_slots = 2;
  cpp.delay_wgrad = true;
  EXPECT_EQ(bytes, MoeLayer::workspace_bytes(cpp));

  // Inference-only options need less.
  mg_moe_layer_options inference = good_moe();
  inference.training = 0;
  size_t inference_bytes = 0;
  ASSERT_EQ(mg_moe_layer_workspace_bytes(&inference, &inference_bytes), MG_OK) << mg_last_error();
  EXPECT_GT(inference_bytes, 0u);
  size_t training_bytes = 0;
  const mg_moe_layer_options training = good_moe();
  ASSERT_EQ(mg_moe_layer_workspace_bytes(&training, &training_bytes), MG_OK) << mg_last_error();
  EXPECT_LT(inference_bytes, training_bytes);
}

struct MoeBadCase {
  const char* name;
  void (*mutate)(mg_moe_layer_options&);
  const char* expected;
};

class CAbiInvalidMoeOptions : public ::testing::TestWithParam<MoeBadCase> {};

// Both workspace_bytes and create refuse, before any GPU work, naming the field.
TEST_P(CAbiInvalidMoeOptions, GiveInvalidArgumentNamingTheField) {
  mg_moe_layer_options o = good_moe();
  GetParam().mutate(o);
  size_t bytes = 123;
  EXPECT_EQ(mg_moe_layer_workspace_bytes(&o, &bytes), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bytes, 0u);
  EXPECT_NE(std::string(mg_last_error()).find(GetParam().expected), std::string::npos) << mg_last_error();

  mg_moe_layer_weights w{};
  w.struct_size = sizeof(w);
  mg_moe_layer* layer = reinterpret_cast<mg_moe_layer*>(0x1);
  EXPECT_EQ(mg_moe_layer_create(&o, &w, nullptr, &layer), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(layer, nullptr);
  EXPECT_NE(std::string(mg_last_error()).find(GetParam().expected), std::string::npos) << mg_last_error();
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CAbiInvalidMoeOptions,
    ::testing::Values(
        MoeBadCase{"hidden_not_multiple_of_16", [](auto& o) { o.hidden = 100; },
                   "hidden must be a positive multiple of 16, got 100"},
        MoeBadCase{"no_experts", [](auto& o) { o.experts = 0; }, "experts must be in [1, 1024], got 0"},
        MoeBadCase{"hidden_too_wide", [](auto& o) { o.hidden = int64_t{1} << 43; },
                   "hidden must be at most 1048576, got 8796093022208"},
        MoeBadCase{"ffn_too_wide", [](auto& o) { o.ffn = int64_t{1} << 21; },
                   "ffn must be at most 1048576, got 2097152"},
        MoeBadCase{"top_k_over_experts", [](auto& o) { o.experts = 2; o.top_k = 4; }, "top_k must be in"},
        MoeBadCase{"no_max_tokens", [](auto& o) { o.max_tokens = 0; }, "max_tokens must be in [1, 2^24], got 0"},
        MoeBadCase{"bad_score", [](auto& o) { o.score = static_cast<mg_router_score>(7); },
                   "score must be MG_ROUTER_SOFTMAX or MG_ROUTER_SIGMOID, got 7"},
        MoeBadCase{"bad_dtype", [](auto& o) { o.dtype = static_cast<mg_dtype>(2); },
                   "dtype must be MG_DTYPE_BF16 or MG_DTYPE_FP16, got 2"},
        MoeBadCase{"negative_capacity_factor", [](auto& o) { o.capacity_factor = -1; }, "capacity_factor must be"},
        MoeBadCase{"delay_without_training", [](auto& o) { o.training = 0; o.delay_wgrad = 1; },
                   "delay_wgrad needs training"}),
    [](const auto& info) { return info.param.name; });

TEST(CAbi, RecipeIsCheckedAndMxfp8SizesItsWorkspace) {
  mg_moe_layer_options o;
  mg_moe_layer_options_init(&o);
  EXPECT_EQ(o.recipe, MG_RECIPE_BF16);
  o.experts = 8, o.hidden = 256, o.ffn = 256, o.top_k = 2, o.max_tokens = 64, o.wgrad_slots = 2;
  std::size_t bf16 = 0, mxfp8 = 0;
  ASSERT_EQ(mg_moe_layer_workspace_bytes(&o, &bf16), MG_OK) << mg_last_error();
  o.recipe = MG_RECIPE_MXFP8;
  EXPECT_EQ(mg_moe_layer_workspace_bytes(&o, &mxfp8), MG_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mg_last_error()).find("row_align 32 or 128"), std::string::npos) << mg_last_error();
  // Inference runs at any row_align: only wgrad's column-wise copies need groups on 32-row blocks.
  o.training = 0;
  std::size_t serving = 0;
  ASSERT_EQ(mg_moe_layer_workspace_bytes(&o, &serving), MG_OK) << mg_last_error();
  EXPECT_GT(serving, 0u);
  o.training = 1;
  o.row_align = 32;
  ASSERT_EQ(mg_moe_layer_workspace_bytes(&o, &mxfp8), MG_OK) << mg_last_error();
  EXPECT_GT(mxfp8, 0u);
  o.recipe = static_cast<mg_recipe>(7);
  EXPECT_EQ(mg_moe_layer_workspace_bytes(&o, &mxfp8), MG_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mg_last_error()).find("recipe must be MG_RECIPE_BF16 or MG_RECIPE_MXFP8, got 7"),
            std::string::npos) << mg_last_error();
  mg_grouped_linear_options g;
  mg_grouped_linear_options_init(&g);
  EXPECT_EQ(g.recipe, MG_RECIPE_BF16);
  g.num_groups = 4, g.in_features = 96, g.out_features = 128, g.capacity_rows = 256, g.row_align = 32;
  g.recipe = MG_RECIPE_MXFP8;
  mg_grouped_linear* op = nullptr;
  EXPECT_EQ(mg_grouped_linear_create(&g, nullptr, &op), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(op, nullptr);
  EXPECT_NE(std::string(mg_last_error()).find("in_features (K) and out_features (N) multiples of 128, got K 96 and N 128"), std::string::npos)
      << mg_last_error();
}

TEST(CAbi, MoeLayerNullArgumentsAndHandles) {
  const mg_moe_layer_options o = good_moe();
  mg_moe_layer_weights w{};
  w.struct_size = sizeof(w);
  mg_moe_layer* layer = nullptr;
  size_t bytes = 0;
  EXPECT_EQ(mg_moe_layer_workspace_bytes(nullptr, &bytes), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_moe_layer_workspace_bytes(&o, nullptr), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_moe_layer_create(nullptr, &w, nullptr, &layer), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_moe_layer_create(&o, nullptr, nullptr, &layer), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_moe_layer_create(&o, &w, nullptr, nullptr), MG_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mg_last_error()).find("mg_moe_layer_create needs"), std::string::npos) << mg_last_error();

  const auto null_handle = [] { return std::string(mg_last_error()).find("null mg_moe_layer handle") != std::string::npos; };
  mg_moe_layer_io io{};
  io.struct_size = sizeof(io);
  EXPECT_EQ(mg_moe_layer_forward(nullptr, &io, 0, nullptr), MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(null_handle()) << mg_last_error();
  EXPECT_EQ(mg_moe_layer_forward(nullptr, &io, 1, nullptr), MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(null_handle()) << mg_last_error();
  EXPECT_EQ(mg_moe_layer_backward(nullptr, &io, nullptr), MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(null_handle()) << mg_last_error();
  EXPECT_EQ(mg_moe_layer_backward_dw(nullptr, nullptr), MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(null_handle()) << mg_last_error();
  mg_moe_layer_weights weights{};
  weights.struct_size = sizeof(weights);
  EXPECT_EQ(mg_moe_layer_set_weights(nullptr, &weights), MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(null_handle()) << mg_last_error();
  uint64_t dropped = 99;
  EXPECT_EQ(mg_moe_layer_read_dropped(nullptr, nullptr, &dropped), MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(null_handle()) << mg_last_error();
  EXPECT_EQ(dropped, 0u);
  EXPECT_EQ(mg_moe_layer_check_device_errors(nullptr, nullptr), MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(null_handle()) << mg_last_error();
  mg_moe_layer_destroy(nullptr);  // no-op, no crash
}

}  // namespace
}  // namespace moegraph

// Expert parallelism: the receive rows and the window are sized without a GPU, the worst case
// holds every rank's rows on one rank, and a bound shrinks the window by exactly its rows.
TEST(ExpertParallelOptions, ReceiveRowsAndWindow) {
  using namespace moegraph;
  MoeLayerOptions o;
  o.experts = 64, o.hidden = 256, o.ffn = 128, o.top_k = 8, o.max_tokens = 100, o.row_align = 16;
  EXPECT_EQ(MoeLayer::window_bytes(o), 0u);
  o.expert_parallel = 4;
  validate(o);
  EXPECT_EQ(moe_local_experts(o), 16);
  // 4 ranks * 100 tokens * 8 rows, plus 15 gap rows per local expert, aligned up.
  EXPECT_EQ(moe_ep_worst_case_rows(o), (4 * 100 * 8 + 16 * 15 + 15) / 16 * 16);
  EXPECT_EQ(moe_expert_rows(o), moe_ep_worst_case_rows(o));
  const std::size_t worst = MoeLayer::window_bytes(o);
  bool has_receive = false;
  for (const auto& b : MoeLayer::window_buffers(o)) has_receive |= b.name == "x_perm";
  EXPECT_TRUE(has_receive);
  o.ep_recv_rows = 1024;
  validate(o);
  EXPECT_EQ(moe_expert_rows(o), 1024);
  EXPECT_EQ(worst - MoeLayer::window_bytes(o), (moe_ep_worst_case_rows(o) - 1024) * 256 * 2);
  o.ep_recv_rows = 1000;  // not a multiple of row_align
  EXPECT_THROW(validate(o), Error);
  o.ep_recv_rows = 0;
  o.fuse_weights = true;
  EXPECT_THROW(validate(o), Error);
}

// NVLink multicast must be off now and must have been since the process started: NCCL reads
// NCCL_NVLS_ENABLE once, when it first starts, so a value set later may not reach a communicator.
TEST(ExpertParallelOptions, NvlsMustBeOffSinceTheProcessStarted) {
  using namespace std::string_literals;
  using moegraph::comm::nvls_refusal;
  const std::string at_start = "PATH=/bin\0NCCL_NVLS_ENABLE=0\0HOME=/root\0"s;
  EXPECT_EQ(nvls_refusal("0", at_start), "");
  EXPECT_EQ(nvls_refusal("0", "A=1\0NCCL_NVLS_ENABLE=0"s), "") << "the last entry without its NUL";
  EXPECT_NE(nvls_refusal(nullptr, at_start).find("got unset"), std::string::npos);
  EXPECT_NE(nvls_refusal("1", at_start).find("got \"1\""), std::string::npos);
  for (const std::string& initial : {"PATH=/bin\0HOME=/root\0"s, "NCCL_NVLS_ENABLE=1\0"s, "XNCCL_NVLS_ENABLE=0\0"s,
                                     "NCCL_NVLS_ENABLE=00\0"s, ""s}) {
    const std::string why = nvls_refusal("0", initial);
    EXPECT_NE(why.find("the environment the process starts with"), std::string::npos) << why;
    EXPECT_NE(why.find("NCCL_NVLS_ENABLE=0"), std::string::npos) << why;
  }
}

// An NCCL environment plugin (NCCL_ENV_PLUGIN other than "none", now or at the start) answers NCCL's
// reads of NCCL_NVLS_ENABLE, so the check above would not be what NCCL uses: refused.
TEST(ExpertParallelOptions, NoNcclEnvironmentPlugin) {
  using namespace std::string_literals;
  using moegraph::comm::env_plugin_refusal;
  const std::string none = "PATH=/bin\0NCCL_ENV_PLUGIN=none\0"s, unset = "PATH=/bin\0NCCL_ENV_PLUGINX=a\0"s,
                    named = "PATH=/bin\0NCCL_ENV_PLUGIN=libnccl-env-site.so\0HOME=/root"s;
  EXPECT_EQ(env_plugin_refusal(nullptr, &unset), "");
  EXPECT_EQ(env_plugin_refusal(nullptr, nullptr), "");
  EXPECT_EQ(env_plugin_refusal("none", &none), "");
  EXPECT_EQ(env_plugin_refusal("none", &unset), "") << "set to none later: NCCL, if it started, had no plugin named";
  const std::string now = env_plugin_refusal("site", &none);
  EXPECT_NE(now.find("NCCL_ENV_PLUGIN=\"site\""), std::string::npos) << now;
  EXPECT_NE(now.find("NCCL_NVLS_ENABLE"), std::string::npos) << now;
  const std::string before = env_plugin_refusal("none", &named);
  EXPECT_NE(before.find("\"libnccl-env-site.so\" (set when the process started)"), std::string::npos) << before;
  EXPECT_NE(env_plugin_refusal(nullptr, &named), "") << "unset later: NCCL may have loaded it already";
  // As NCCL reads the variable: "none" in any case; empty as unset (NCCL's default library, as unset).
  EXPECT_EQ(env_plugin_refusal("NONE", &unset), "");
  EXPECT_EQ(env_plugin_refusal("None", &unset), "");
  EXPECT_EQ(env_plugin_refusal("", &unset), "");
}

// The send/recv exchange's NCCL variables: 0 now and at the start, with a plain reason when the start
// environment cannot be read (it read as "set later").
TEST(ExpertParallelOptions, RegistrationOffSinceTheProcessStarted) {
  using namespace std::string_literals;
  using moegraph::comm::zero_since_start_refusal;
  const std::string at_start = "PATH=/bin\0NCCL_GRAPH_REGISTER=0\0"s, later = "PATH=/bin\0"s;
  EXPECT_EQ(zero_since_start_refusal("NCCL_GRAPH_REGISTER", "0", &at_start, "x"), "");
  EXPECT_NE(zero_since_start_refusal("NCCL_GRAPH_REGISTER", nullptr, &at_start, "x").find("got unset"),
            std::string::npos);
  EXPECT_NE(zero_since_start_refusal("NCCL_GRAPH_REGISTER", "1", &at_start, "x").find("got \"1\""), std::string::npos);
  EXPECT_NE(zero_since_start_refusal("NCCL_GRAPH_REGISTER", "0", &later, "x").find("set now but was not at start"),
            std::string::npos);
  EXPECT_NE(zero_since_start_refusal("NCCL_GRAPH_REGISTER", "0", nullptr, "x").find("cannot be read"),
            std::string::npos);
  EXPECT_NE(moegraph::comm::start_environment(), nullptr) << "this process's /proc/self/environ";
}

// The NCCL transport refuses a process with NVLink multicast enabled, and bad ranks or ids, before it
// touches NCCL or a GPU; so does a StepGraphs without its communicator.
TEST(ExpertParallelOptions, NcclCommunicatorInputsAreCheckedFirst) {
  using namespace moegraph;
  const char* before = std::getenv("NCCL_NVLS_ENABLE");
  const std::string saved = before ? before : "";
  setenv("NCCL_NVLS_ENABLE", "1", 1);
  try {
    nccl_ep_comm_init(2, 0, std::string(256, '0'));
    ADD_FAILURE() << "NCCL_NVLS_ENABLE=1 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("NCCL_NVLS_ENABLE=0"), std::string::npos) << e.what();
  }
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  EXPECT_THROW(nccl_ep_comm_init(0, 0, std::string(256, '0')), Error);
  EXPECT_THROW(nccl_ep_comm_init(2, 2, std::string(256, '0')), Error);
  EXPECT_THROW(nccl_ep_comm_init(65, 0, std::string(256, '0')), Error);
  if (before) setenv("NCCL_NVLS_ENABLE", saved.c_str(), 1); else unsetenv("NCCL_NVLS_ENABLE");

  // Set only since the process started (as here, unless the runner exported it): refused, before
  // NCCL starts, for NCCL reads the variable once, when it first starts.
  std::ifstream environ_file("/proc/self/environ", std::ios::binary);
  const std::string initial((std::istreambuf_iterator<char>(environ_file)), std::istreambuf_iterator<char>());
  if (!comm::nvls_refusal("0", initial).empty()) {
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    try {
      nccl_ep_comm_init(2, 0, std::string(256, '0'));
      ADD_FAILURE() << "NCCL_NVLS_ENABLE=0 set only after the start was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("the environment the process starts with"), std::string::npos)
          << e.what();
    }
    if (before) setenv("NCCL_NVLS_ENABLE", saved.c_str(), 1); else unsetenv("NCCL_NVLS_ENABLE");
  }

  StepGraphsOptions o;
  o.layer.experts = 8, o.layer.hidden = 64, o.layer.ffn = 32, o.layer.top_k = 2, o.layer.expert_parallel = 2;
  o.buckets = {16};
  EXPECT_NO_THROW(plan_step(o));  // sizes need no communicator
  try {
    StepGraphs g(o, StepWeights{});
    ADD_FAILURE() << "a StepGraphs with expert_parallel = 2 was built without a communicator";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("communicator"), std::string::npos) << e.what();
  }
  o.step = StepKind::kExperts;
  EXPECT_THROW(validate(o), Error);

  // Prequantized weights belong to the mxfp8 recipe: each bucket's layer is given the flag by the
  // recipe, so the step checks what its caller asked (the plan sized the bf16 weights as MXFP8).
  StepGraphsOptions bf16;
  bf16.layer.experts = 8, bf16.layer.hidden = 256, bf16.layer.ffn = 256, bf16.layer.top_k = 2;
  bf16.buckets = {64, 128};
  EXPECT_NO_THROW(validate(bf16));
  bf16.layer.prequantized_weights = true;
  for (StepKind step : {StepKind::kMoeLayer, StepKind::kExperts}) {
    bf16.step = step;
    try {
      plan_step(bf16);
      ADD_FAILURE() << "prequantized bf16 weights were planned";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("layer.prequantized_weights needs the mxfp8 recipe, got recipe bf16"),
                std::string::npos)
          << e.what();
    }
  }
}
