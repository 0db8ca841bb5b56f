// The C ABI's conventions on paths that never reach a GPU: version, status strings, size-prefixed
// structs (and structs that grew), live-handle checks, configs, the StepGraphs entry points'
// refusals, expert parallelism's communicators and options, and MXFP8 weights given by the caller.
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

namespace moegraph {
namespace {

// A C struct zeroed with its size set, as a C caller writes `T t = {0}; t.struct_size = sizeof t;`.
template <class T>
T sized() {
  T t{};
  t.struct_size = sizeof(T);
  return t;
}

bool last_error_has(const std::string& part) { return std::string(mg_last_error()).find(part) != std::string::npos; }

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

mg_grouped_linear_options linear() {
  mg_grouped_linear_options o;
  mg_grouped_linear_options_init(&o);
  o.num_groups = 8, o.in_features = 256, o.out_features = 512, o.capacity_rows = 1024;
  return o;
}

TEST(CAbiStructs, InitSetsTheSizeAndTheSizeQueryMatchesTheCppApi) {
  const mg_grouped_linear_options o = linear();
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
  mg_grouped_linear_options o = linear();
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
  Newer n{linear(), 0};
  n.known.struct_size = sizeof(Newer);
  size_t expected = 0, got = 0;
  const mg_grouped_linear_options o = linear();
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
  int n = 0;
  EXPECT_EQ(mg_step_graphs_num_buckets(nullptr, &n), MG_ERR_INVALID_HANDLE);
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
  ASSERT_EQ(mg_config_set_training(c, 0), MG_OK);
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

// ---- Expert parallelism ------------------------------------------------------------------------

TEST(CAbiEp, UniqueIdNeedsRoomFor256DigitsAndANul) {
  char small[256];
  std::memset(small, 'x', sizeof small);
  EXPECT_EQ(mg_nccl_unique_id(small, sizeof small), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("size must be at least 257")) << mg_last_error();
  EXPECT_TRUE(last_error_has("got 256")) << mg_last_error();
  EXPECT_EQ(small[0], '\0') << "a refused call leaves an empty string";
  EXPECT_EQ(mg_nccl_unique_id(nullptr, 300), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_nccl_unique_id(small, 0), MG_ERR_INVALID_ARGUMENT);

  // NCCL's bootstrap needs a network interface, not a GPU: where it finds none the call fails with
  // a message instead.
  char id[300];
  std::memset(id, 'x', sizeof id);
  const mg_status status = mg_nccl_unique_id(id, sizeof id);
  if (status == MG_OK) {
    EXPECT_STREQ(mg_last_error(), "");
    ASSERT_EQ(std::strlen(id), 256u);
    for (int i = 0; i < 256; ++i) EXPECT_NE(std::strchr("0123456789abcdef", id[i]), nullptr) << i << ": " << id[i];
    char other[257];
    ASSERT_EQ(mg_nccl_unique_id(other, sizeof other), MG_OK) << mg_last_error();
    EXPECT_STRNE(id, other) << "every id is fresh";
  } else {
    std::printf("mg_nccl_unique_id: %s: %s\n", mg_status_string(status), mg_last_error());
    EXPECT_STRNE(mg_last_error(), "");
  }
}

// Sets an environment variable for the scope, restoring the previous value (or its absence).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) setenv(name, value, 1);
    else unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) setenv(name_.c_str(), old_->c_str(), 1);
    else unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// The arguments are refused before NCCL, CUDA or the environment is consulted, each by name; then
// the environment: NVLink multicast must be off. (Never with NCCL_NVLS_ENABLE=0 here: a valid call
// would wait for the other ranks.)
TEST(CAbiEp, CreateNcclRefusesBadArgumentsByName) {
  const std::string id(256, 'a');
  mg_ep_comm* comm = reinterpret_cast<mg_ep_comm*>(0x1);
  struct Case {
    int ranks, rank;
    const char* id;
    const char* expected;
  };
  const std::string short_id(255, '0'), long_id(257, '0'), not_hex = std::string(255, '0') + "g";
  const Case cases[] = {
      {0, 0, id.c_str(), "ranks must be in [1, 64], got 0"},
      {65, 0, id.c_str(), "ranks must be in [1, 64], got 65"},
      {2, -1, id.c_str(), "rank must be in [0, ranks - 1 = 1], got -1"},
      {2, 2, id.c_str(), "rank must be in [0, ranks - 1 = 1], got 2"},
      {2, 0, nullptr, "unique_id_hex is NULL"},
      {2, 0, short_id.c_str(), "unique_id_hex must be 256 hex digits (mg_nccl_unique_id), got 255 characters"},
      {2, 0, long_id.c_str(), "unique_id_hex must be 256 hex digits (mg_nccl_unique_id), got a longer string"},
      {2, 0, not_hex.c_str(), "unique_id_hex must hold hex digits only, got character 103 at position 255"},
  };
  for (const Case& c : cases) {
    comm = reinterpret_cast<mg_ep_comm*>(0x1);
    EXPECT_EQ(mg_ep_comm_create_nccl(c.ranks, c.rank, c.id, &comm), MG_ERR_INVALID_ARGUMENT) << c.expected;
    EXPECT_TRUE(last_error_has(c.expected)) << mg_last_error();
    EXPECT_EQ(comm, nullptr);
  }
  EXPECT_EQ(mg_ep_comm_create_nccl(2, 0, id.c_str(), nullptr), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("mg_ep_comm_create_nccl needs an output handle")) << mg_last_error();

  for (const char* nvls : {"1", static_cast<const char*>(nullptr)}) {
    const char* before = std::getenv("NCCL_NVLS_ENABLE");
    const std::optional<std::string> saved = before ? std::optional<std::string>(before) : std::nullopt;
    {
      ScopedEnv env("NCCL_NVLS_ENABLE", nvls);
      comm = reinterpret_cast<mg_ep_comm*>(0x1);
      EXPECT_EQ(mg_ep_comm_create_nccl(2, 0, id.c_str(), &comm), MG_ERR_INVALID_ARGUMENT);
      EXPECT_TRUE(last_error_has("NCCL_NVLS_ENABLE=0")) << mg_last_error();
      EXPECT_TRUE(last_error_has(nvls ? "got \"1\"" : "got unset")) << mg_last_error();
      EXPECT_EQ(comm, nullptr);
    }
    const char* after = std::getenv("NCCL_NVLS_ENABLE");
    EXPECT_EQ(after ? std::optional<std::string>(after) : std::nullopt, saved) << "the environment is restored";
  }
}

TEST(CAbiEp, CommHandlesAreChecked) {
  mg_ep_comm_destroy(nullptr);  // nothing happens
  int value = 7;
  EXPECT_EQ(mg_ep_comm_rank(nullptr, &value), MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(last_error_has("null mg_ep_comm handle")) << mg_last_error();
  EXPECT_EQ(mg_ep_comm_ranks(nullptr, &value), MG_ERR_INVALID_HANDLE);
  mg_config* c = nullptr;
  ASSERT_EQ(mg_config_default(&c), MG_OK);
  const auto* not_a_comm = reinterpret_cast<const mg_ep_comm*>(c);
  EXPECT_EQ(mg_ep_comm_ranks(not_a_comm, &value), MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(last_error_has("mg_ep_comm handle that is not live")) << mg_last_error();
  mg_ep_comm_destroy(reinterpret_cast<mg_ep_comm*>(c));  // not a communicator: left alone
  mg_config_shape s = sized<mg_config_shape>();
  EXPECT_EQ(mg_config_shape_of(c, &s), MG_OK) << mg_last_error();
  mg_config_destroy(c);
  mg_ep_comm* out = reinterpret_cast<mg_ep_comm*>(0x1);
  EXPECT_EQ(mg_ep_comm_wrap_nccl(nullptr, &out), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("nccl_comm is NULL")) << mg_last_error();
  EXPECT_EQ(out, nullptr);
  EXPECT_EQ(mg_ep_comm_create_from_environment(nullptr), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_ep_comm_rank(nullptr, nullptr), MG_ERR_INVALID_ARGUMENT) << "the output is checked first";
}

// A group of one needs no CUDA_MODULE_LOADING and runs wherever a Hopper GPU is; without one it is
// refused, and every entry of the array stays NULL.
TEST(CAbiEp, EmulatedGroupHandsOutOneHandlePerRank) {
  mg_ep_comm* comms[3] = {reinterpret_cast<mg_ep_comm*>(0x1), reinterpret_cast<mg_ep_comm*>(0x1),
                          reinterpret_cast<mg_ep_comm*>(0x1)};
  for (int ranks : {0, 65}) {
    EXPECT_EQ(mg_ep_emulated_group_create(ranks, comms), MG_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(last_error_has("ranks must be in [1, 64], got " + std::to_string(ranks))) << mg_last_error();
  }
  EXPECT_EQ(mg_ep_emulated_group_create(2, nullptr), MG_ERR_INVALID_ARGUMENT);
  const mg_status status = mg_ep_emulated_group_create(1, comms);
  if (status != MG_OK) {
    EXPECT_TRUE(status == MG_ERR_NO_DEVICE || status == MG_ERR_UNSUPPORTED_DEVICE || status == MG_ERR_CUDA)
        << mg_status_string(status) << ": " << mg_last_error();
    EXPECT_STRNE(mg_last_error(), "");
    EXPECT_EQ(comms[0], nullptr);
    return;
  }
  int rank = -1, ranks = -1;
  ASSERT_EQ(mg_ep_comm_rank(comms[0], &rank), MG_OK) << mg_last_error();
  ASSERT_EQ(mg_ep_comm_ranks(comms[0], &ranks), MG_OK) << mg_last_error();
  EXPECT_EQ(rank, 0);
  EXPECT_EQ(ranks, 1);
  mg_ep_comm_destroy(comms[0]);
  EXPECT_EQ(mg_ep_comm_rank(comms[0], &rank), MG_ERR_INVALID_HANDLE);
  mg_ep_comm_destroy(comms[0]);  // again: nothing happens
}

mg_moe_layer_options small_moe() {
  mg_moe_layer_options o;
  mg_moe_layer_options_init(&o);
  o.experts = 8, o.hidden = 256, o.ffn = 256, o.top_k = 2, o.max_tokens = 64;
  return o;
}

TEST(CAbiEp, LayerOptionsDefaultToNoExpertParallelism) {
  mg_moe_layer_options o;
  std::memset(&o, 0x5a, sizeof o);
  mg_moe_layer_options_init(&o);
  const MoeLayerOptions d;
  EXPECT_EQ(o.expert_parallel, 1);
  EXPECT_EQ(o.expert_parallel, d.expert_parallel);
  EXPECT_EQ(o.ep_recv_rows, 0);
  EXPECT_EQ(o.ep_recv_rows, d.ep_recv_rows);
}

// A caller built before the expert-parallel fields were appended passes its own, smaller size: the
// fields it knows are read, the new ones take their defaults. Its sizeof may end in padding where
// expert_parallel now lies: those bytes are not a field to it, whatever they hold.
TEST(CAbiEp, AnOlderLayerOptionsSizeGetsTheDefaults) {
  const mg_moe_layer_options current = small_moe();
  size_t want = 0;
  ASSERT_EQ(mg_moe_layer_workspace_bytes(&current, &want), MG_OK) << mg_last_error();
  const size_t fields_end = offsetof(mg_moe_layer_options, expert_parallel);
  const size_t old_sizeof = (fields_end + alignof(size_t) - 1) / alignof(size_t) * alignof(size_t);
  ASSERT_LT(old_sizeof, sizeof(mg_moe_layer_options));
  for (size_t size : {fields_end, old_sizeof}) {
    SCOPED_TRACE(size);
    mg_moe_layer_options old = current;
    std::memset(reinterpret_cast<unsigned char*>(&old) + fields_end, 0x5a, sizeof(old) - fields_end);
    old.struct_size = size;
    size_t got = 1, window = 1;
    ASSERT_EQ(mg_moe_layer_workspace_bytes(&old, &got), MG_OK) << mg_last_error();
    EXPECT_EQ(got, want);
    ASSERT_EQ(mg_moe_layer_window_bytes(&old, &window), MG_OK) << mg_last_error();
    EXPECT_EQ(window, 0u) << "no expert parallelism";
  }
  mg_moe_layer_options shorter = current;
  shorter.struct_size = fields_end - 4;
  size_t bytes = 0;
  EXPECT_EQ(mg_moe_layer_workspace_bytes(&shorter, &bytes), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("mg_moe_layer_options.struct_size")) << mg_last_error();
}

TEST(CAbiEp, ExpertParallelOptionsAreValidated) {
  mg_moe_layer_options o = small_moe();
  size_t bytes = 7;
  o.expert_parallel = 3;
  EXPECT_EQ(mg_moe_layer_workspace_bytes(&o, &bytes), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bytes, 0u);
  EXPECT_TRUE(last_error_has("experts (8) must be divisible by expert_parallel (3)")) << mg_last_error();
  EXPECT_EQ(mg_moe_layer_window_bytes(&o, &bytes), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("expert_parallel (3)")) << mg_last_error();
  for (int bad : {-1, 65}) {
    o.expert_parallel = bad;
    EXPECT_EQ(mg_moe_layer_workspace_bytes(&o, &bytes), MG_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(last_error_has("expert_parallel must be in [1, 64], got " + std::to_string(bad))) << mg_last_error();
  }
  o.expert_parallel = 1;
  o.ep_recv_rows = 64;
  EXPECT_EQ(mg_moe_layer_workspace_bytes(&o, &bytes), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("ep_recv_rows needs expert_parallel > 1, got 64")) << mg_last_error();
  o.expert_parallel = 2;
  o.capacity_factor = 1.25;
  o.ep_recv_rows = 0;
  EXPECT_EQ(mg_moe_layer_workspace_bytes(&o, &bytes), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("capacity_factor is not supported with expert_parallel > 1")) << mg_last_error();

  // 0, a zeroed struct's value, is no expert parallelism, as 1.
  mg_moe_layer_options zero = small_moe(), one = small_moe();
  zero.expert_parallel = 0;
  size_t zero_bytes = 0, one_bytes = 0;
  ASSERT_EQ(mg_moe_layer_workspace_bytes(&zero, &zero_bytes), MG_OK) << mg_last_error();
  ASSERT_EQ(mg_moe_layer_workspace_bytes(&one, &one_bytes), MG_OK) << mg_last_error();
  EXPECT_EQ(zero_bytes, one_bytes);
}

TEST(CAbiEp, WindowBytesFollowTheCppApi) {
  mg_moe_layer_options o = small_moe();
  size_t window = 7;
  ASSERT_EQ(mg_moe_layer_window_bytes(&o, &window), MG_OK) << mg_last_error();
  EXPECT_EQ(window, 0u);
  EXPECT_EQ(mg_moe_layer_window_bytes(&o, nullptr), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_moe_layer_window_bytes(nullptr, &window), MG_ERR_INVALID_ARGUMENT);

  MoeLayerOptions cpp;
  cpp.experts = 8, cpp.hidden = 256, cpp.ffn = 256, cpp.top_k = 2, cpp.max_tokens = 64, cpp.expert_parallel = 2;
  o.expert_parallel = 2;
  ASSERT_EQ(mg_moe_layer_window_bytes(&o, &window), MG_OK) << mg_last_error();
  EXPECT_GT(window, 0u);
  EXPECT_EQ(window, MoeLayer::window_bytes(cpp));
  size_t workspace = 0;
  ASSERT_EQ(mg_moe_layer_workspace_bytes(&o, &workspace), MG_OK) << mg_last_error();
  EXPECT_EQ(workspace, MoeLayer::workspace_bytes(cpp));

  // A receive bound shrinks the window.
  o.ep_recv_rows = 32;
  cpp.ep_recv_rows = 32;
  size_t bounded = 0;
  ASSERT_EQ(mg_moe_layer_window_bytes(&o, &bounded), MG_OK) << mg_last_error();
  EXPECT_EQ(bounded, MoeLayer::window_bytes(cpp));
  EXPECT_LT(bounded, window);
}

// The communicator is checked with the options, before the layer looks for a device.
TEST(CAbiEp, LayerCreateNeedsACommunicatorForExpertParallelism) {
  mg_moe_layer_options o = small_moe();
  o.expert_parallel = 2;
  const mg_moe_layer_weights w = sized<mg_moe_layer_weights>();
  mg_moe_layer* layer = reinterpret_cast<mg_moe_layer*>(0x1);
  EXPECT_EQ(mg_moe_layer_create_ep(&o, &w, nullptr, nullptr, &layer), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("mg_moe_layer_create_ep: expert_parallel = 2 needs this rank's communicator, got comm "
                             "NULL"))
      << mg_last_error();
  EXPECT_EQ(layer, nullptr);
  layer = reinterpret_cast<mg_moe_layer*>(0x1);
  EXPECT_EQ(mg_moe_layer_create(&o, &w, nullptr, &layer), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("create the layer with mg_moe_layer_create_ep")) << mg_last_error();
  EXPECT_EQ(layer, nullptr);
  EXPECT_EQ(mg_moe_layer_create_ep(&o, &w, nullptr, nullptr, nullptr), MG_ERR_INVALID_ARGUMENT);

  // Bad options are refused first, with the message of the size queries.
  o.expert_parallel = 3;
  EXPECT_EQ(mg_moe_layer_create_ep(&o, &w, nullptr, nullptr, &layer), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("must be divisible by expert_parallel (3)")) << mg_last_error();

  // A shape too large to lay out is refused for its size before the missing communicator, by both
  // entry points, with the message of the size query (a fuzz finding).
  mg_moe_layer_options huge = small_moe();
  huge.experts = 64, huge.hidden = 1 << 18, huge.ffn = 1 << 17, huge.max_tokens = 1 << 24, huge.expert_parallel = 8;
  size_t bytes = 1;
  ASSERT_EQ(mg_moe_layer_workspace_bytes(&huge, &bytes), MG_ERR_INVALID_ARGUMENT);
  const std::string sizing = mg_last_error();
  EXPECT_NE(sizing.find("layout maximum"), std::string::npos) << sizing;
  EXPECT_EQ(mg_moe_layer_create(&huge, &w, nullptr, &layer), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(sizing, mg_last_error());
  EXPECT_EQ(mg_moe_layer_create_ep(&huge, &w, nullptr, nullptr, &layer), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(sizing, mg_last_error());

  // A handle that is not a live communicator.
  mg_config* c = nullptr;
  ASSERT_EQ(mg_config_default(&c), MG_OK);
  o.expert_parallel = 2;
  EXPECT_EQ(mg_moe_layer_create_ep(&o, &w, nullptr, reinterpret_cast<mg_ep_comm*>(c), &layer),
            MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(last_error_has("mg_ep_comm handle that is not live")) << mg_last_error();
  EXPECT_EQ(layer, nullptr);
  mg_config_destroy(c);
}

constexpr const char* kEpConfig = R"({"layer": {"experts": 8, "hidden": 256, "ffn": 256, "top_k": 2},
                                      "parallel": {"expert_parallel": 2}, "buckets": [64]})";

TEST(CAbiEp, ConfigShapeNamesTheRanks) {
  mg_config* c = nullptr;
  ASSERT_EQ(mg_config_parse(kEpConfig, &c), MG_OK) << mg_last_error();
  mg_config_shape s = sized<mg_config_shape>();
  ASSERT_EQ(mg_config_shape_of(c, &s), MG_OK) << mg_last_error();
  EXPECT_EQ(s.expert_parallel, 2);
  EXPECT_EQ(s.experts, 8) << "the whole layer's experts";
  // An older caller's struct ends before the field: it is left alone.
  mg_config_shape old = sized<mg_config_shape>();
  old.struct_size = offsetof(mg_config_shape, expert_parallel);
  old.expert_parallel = -5;
  ASSERT_EQ(mg_config_shape_of(c, &old), MG_OK) << mg_last_error();
  EXPECT_EQ(old.experts, 8);
  EXPECT_EQ(old.expert_parallel, -5);
  EXPECT_EQ(old.struct_size, offsetof(mg_config_shape, expert_parallel));
  mg_config_destroy(c);
  ASSERT_EQ(mg_config_default(&c), MG_OK);
  ASSERT_EQ(mg_config_shape_of(c, &s), MG_OK);
  EXPECT_EQ(s.expert_parallel, 1);
  mg_config_destroy(c);
}

TEST(CAbiEp, StepCreateNeedsTheCommunicatorTheConfigAsksFor) {
  mg_config* c = nullptr;
  ASSERT_EQ(mg_config_parse(kEpConfig, &c), MG_OK) << mg_last_error();
  const mg_step_weights w = sized<mg_step_weights>();
  mg_step_graphs* step = reinterpret_cast<mg_step_graphs*>(0x1);
  EXPECT_EQ(mg_step_graphs_create(c, &w, nullptr, &step), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("parallel.expert_parallel = 2 needs this rank's communicator in "
                             "mg_step_graphs_options.comm, got no options"))
      << mg_last_error();
  EXPECT_EQ(step, nullptr);
  mg_step_graphs_options o = sized<mg_step_graphs_options>();
  EXPECT_EQ(mg_step_graphs_create(c, &w, &o, &step), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("got comm NULL")) << mg_last_error();
  o.comm = reinterpret_cast<mg_ep_comm*>(c);  // not a communicator
  EXPECT_EQ(mg_step_graphs_create(c, &w, &o, &step), MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(last_error_has("mg_ep_comm handle that is not live")) << mg_last_error();
  EXPECT_EQ(step, nullptr);
  mg_config_destroy(c);

  // Without expert parallelism an older options struct (before comm) is read as it was: the create
  // goes on to the weights, which are missing.
  ASSERT_EQ(mg_config_parse(R"({"layer": {"experts": 8, "hidden": 256, "ffn": 256}, "buckets": [64]})", &c), MG_OK);
  mg_step_graphs_options old = sized<mg_step_graphs_options>();
  old.struct_size = offsetof(mg_step_graphs_options, comm);
  EXPECT_EQ(mg_step_graphs_create(c, &w, &old, &step), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("StepWeights needs w1 and w2")) << mg_last_error();
  old.struct_size = offsetof(mg_step_graphs_options, comm) - 8;
  EXPECT_EQ(mg_step_graphs_create(c, &w, &old, &step), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("mg_step_graphs_options.struct_size")) << mg_last_error();
  mg_config_destroy(c);
}

// ---- MXFP8 weights given by the caller --------------------------------------------------------

// What the C++ API throws for the same arguments: what(), file and line included, as mg_last_error
// gives it.
template <class F>
std::string cpp_error(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(CAbiMxfp8, OptionsDefaultToWeightsQuantizedByTheOperator) {
  mg_grouped_linear_options g;
  std::memset(&g, 0x5a, sizeof g);
  mg_grouped_linear_options_init(&g);
  mg_moe_layer_options m;
  std::memset(&m, 0x5a, sizeof m);
  mg_moe_layer_options_init(&m);
  EXPECT_EQ(g.prequantized_weights, 0);
  EXPECT_EQ(m.prequantized_weights, 0);
  EXPECT_FALSE(GroupedLinearOptions{}.prequantized_weights);
  EXPECT_FALSE(MoeLayerOptions{}.prequantized_weights);
}

TEST(CAbiMxfp8, WeightBytesFollowTheCppApi) {
  struct Shape {
    int groups;
    int64_t n, k;
  };
  const Shape shapes[] = {{1, 32, 32}, {3, 96, 160}, {128, 1536, 2048}, {1024, 32, int64_t{1} << 21}};
  for (const Shape& z : shapes) {
    SCOPED_TRACE(detail::concat(z.groups, " x ", z.n, " x ", z.k));
    size_t data = 1, scales = 1;
    ASSERT_EQ(mg_mxfp8_weight_bytes(z.groups, z.n, z.k, &data, &scales), MG_OK) << mg_last_error();
    EXPECT_STREQ(mg_last_error(), "");
    EXPECT_EQ(data, static_cast<size_t>(z.groups) * z.n * z.k);
    EXPECT_EQ(scales, data / 32);
    EXPECT_EQ(data, mxfp8_weight_data_bytes(z.groups, z.n, z.k));
    EXPECT_EQ(scales, mxfp8_weight_scale_bytes(z.groups, z.n, z.k));
  }
  struct Bad {
    int groups;
    int64_t n, k;
    const char* expected;
  };
  const Bad bad[] = {
      {0, 32, 32, "MXFP8 weights: groups must be in [1, 1024], got 0"},
      {1025, 32, 32, "MXFP8 weights: groups must be in [1, 1024], got 1025"},
      {1, 48, 32, "MXFP8 weights: n must be a multiple of 32 in [32, 2097152], got 48"},
      {1, 0, 32, "MXFP8 weights: n must be a multiple of 32 in [32, 2097152], got 0"},
      {1, 32, -32, "MXFP8 weights: k must be a multiple of 32 in [32, 2097152], got -32"},
      {1, 32, (int64_t{1} << 21) + 32, "MXFP8 weights: k must be a multiple of 32 in [32, 2097152], got 2097184"},
  };
  for (const Bad& b : bad) {
    size_t data = 1, scales = 1;
    EXPECT_EQ(mg_mxfp8_weight_bytes(b.groups, b.n, b.k, &data, &scales), MG_ERR_INVALID_ARGUMENT) << b.expected;
    EXPECT_TRUE(last_error_has(b.expected)) << mg_last_error();
    EXPECT_EQ(std::string(mg_last_error()), cpp_error([&] { mxfp8_weight_data_bytes(b.groups, b.n, b.k); }));
    EXPECT_EQ(data, 0u);
    EXPECT_EQ(scales, 0u);
  }
  size_t one = 1;
  EXPECT_EQ(mg_mxfp8_weight_bytes(1, 32, 32, &one, nullptr), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("mg_mxfp8_weight_bytes needs both outputs (data_bytes and scale_bytes)"))
      << mg_last_error();
  EXPECT_EQ(one, 1u) << "nothing is written when an output is missing";
  EXPECT_EQ(mg_mxfp8_weight_bytes(1, 32, 32, nullptr, &one), MG_ERR_INVALID_ARGUMENT);
}

// Every refusal comes before the quantizer touches a device (the pointers below are never read),
// with the C++ quantizer's message; only a value outside mg_dtype is the ABI's own refusal.
TEST(CAbiMxfp8, QuantizerRefusesBadArgumentsBeforeAnyGpuUse) {
  alignas(16) static uint8_t fake[64];
  uint8_t* const p = fake;
  struct Case {
    const char* name;
    mg_dtype dtype;
    const void* w;
    int groups;
    int64_t n, k;
    uint8_t *data, *scales, *data_t, *scales_t;
    const char* expected;
  };
  const Case cases[] = {
      {"groups", MG_DTYPE_BF16, p, 0, 32, 32, p, p, p, p, "MXFP8 weights: groups must be in [1, 1024], got 0"},
      {"n", MG_DTYPE_BF16, p, 1, 40, 32, p, p, p, p, "MXFP8 weights: n must be a multiple of 32"},
      {"w null", MG_DTYPE_BF16, nullptr, 1, 32, 32, p, p, p, p,
       "quantize_mxfp8_weights: w must be a 16-byte aligned device pointer"},
      {"w misaligned", MG_DTYPE_FP16, p + 2, 1, 32, 32, p, p, p, p,
       "quantize_mxfp8_weights: w must be a 16-byte aligned device pointer"},
      {"no pair", MG_DTYPE_BF16, p, 1, 32, 32, nullptr, nullptr, nullptr, nullptr,
       "quantize_mxfp8_weights: nothing to write (give data and scales, data_t and scales_t, or both)"},
      {"data alone", MG_DTYPE_BF16, p, 1, 32, 32, p, nullptr, nullptr, nullptr,
       "MXFP8 weights: data and its scales come together"},
      {"scales_t alone", MG_DTYPE_BF16, p, 1, 32, 32, p, p, nullptr, p,
       "MXFP8 weights: data_t and its scales come together"},
      {"scales misaligned", MG_DTYPE_BF16, p, 1, 32, 32, p, p + 1, nullptr, nullptr,
       "MXFP8 weights: data and its scales must be 16-byte aligned"},
      {"data_t misaligned", MG_DTYPE_BF16, p, 1, 32, 32, nullptr, nullptr, p + 8, p,
       "MXFP8 weights: data_t and its scales must be 16-byte aligned"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(mg_quantize_mxfp8_weights(c.dtype, c.w, c.groups, c.n, c.k, c.data, c.scales, c.data_t, c.scales_t,
                                        nullptr),
              MG_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(last_error_has(c.expected)) << mg_last_error();
    const DType dtype = c.dtype == MG_DTYPE_FP16 ? DType::kFP16 : DType::kBF16;
    const Mxfp8Weights out{c.data, c.scales, c.data_t, c.scales_t};
    EXPECT_EQ(std::string(mg_last_error()),
              cpp_error([&] { quantize_mxfp8_weights(dtype, c.w, c.groups, c.n, c.k, out, nullptr); }));
  }
  // A value outside mg_dtype is refused by name, before the sizes are looked at.
  EXPECT_EQ(mg_quantize_mxfp8_weights(static_cast<mg_dtype>(2), p, 0, 32, 32, p, p, nullptr, nullptr, nullptr),
            MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("dtype must be MG_DTYPE_BF16 or MG_DTYPE_FP16, got 2")) << mg_last_error();
}

TEST(CAbiMxfp8, PrequantizedWeightsNeedTheMxfp8RecipeAsInTheCppApi) {
  mg_grouped_linear_options g = linear();
  g.row_align = 32, g.prequantized_weights = 1;
  GroupedLinearOptions cg;
  cg.num_groups = 8, cg.in_features = 256, cg.out_features = 512, cg.capacity_rows = 1024, cg.row_align = 32;
  cg.prequantized_weights = true;
  const std::string linear_expected = cpp_error([&] { validate(cg); });
  EXPECT_NE(linear_expected.find(
                "prequantized_weights needs the mxfp8 recipe (the weights it reads are MXFP8), got recipe bf16"),
            std::string::npos)
      << linear_expected;
  size_t bytes = 7;
  EXPECT_EQ(mg_grouped_linear_workspace_bytes(&g, &bytes), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bytes, 0u);
  EXPECT_EQ(std::string(mg_last_error()), linear_expected);
  mg_grouped_linear* op = reinterpret_cast<mg_grouped_linear*>(0x1);
  EXPECT_EQ(mg_grouped_linear_create(&g, nullptr, &op), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(mg_last_error()), linear_expected);
  EXPECT_EQ(op, nullptr);
  g.recipe = MG_RECIPE_MXFP8;
  cg.recipe = Recipe::kMXFP8;
  ASSERT_EQ(mg_grouped_linear_workspace_bytes(&g, &bytes), MG_OK) << mg_last_error();
  EXPECT_EQ(bytes, GroupedLinear::workspace_bytes(cg));

  mg_moe_layer_options m = small_moe();
  m.row_align = 32, m.prequantized_weights = 1;
  MoeLayerOptions cm;
  cm.experts = 8, cm.hidden = 256, cm.ffn = 256, cm.top_k = 2, cm.max_tokens = 64, cm.row_align = 32;
  cm.prequantized_weights = true;
  const std::string layer_expected = cpp_error([&] { validate(cm); });
  EXPECT_NE(layer_expected.find(
                "prequantized_weights needs the mxfp8 recipe (the weights it reads are MXFP8), got recipe bf16"),
            std::string::npos)
      << layer_expected;
  EXPECT_EQ(mg_moe_layer_workspace_bytes(&m, &bytes), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(mg_last_error()), layer_expected);
  const mg_moe_layer_weights w = sized<mg_moe_layer_weights>();
  mg_moe_layer* layer = reinterpret_cast<mg_moe_layer*>(0x1);
  EXPECT_EQ(mg_moe_layer_create(&m, &w, nullptr, &layer), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(mg_last_error()), layer_expected);
  EXPECT_EQ(layer, nullptr);
  m.recipe = MG_RECIPE_MXFP8;
  cm.recipe = Recipe::kMXFP8;
  ASSERT_EQ(mg_moe_layer_workspace_bytes(&m, &bytes), MG_OK) << mg_last_error();
  EXPECT_EQ(bytes, MoeLayer::workspace_bytes(cm));
}

// Callers built before prequantized_weights was appended: whatever their memory holds where the
// field now lies is not read (a set field with the bf16 recipe would be refused).
TEST(CAbiMxfp8, AnOlderOptionsSizeIsNotPrequantized) {
  const mg_grouped_linear_options plain = linear();
  size_t want = 0, got = 1;
  ASSERT_EQ(mg_grouped_linear_workspace_bytes(&plain, &want), MG_OK) << mg_last_error();
  mg_grouped_linear_options g = linear();
  g.prequantized_weights = 1;
  g.struct_size = offsetof(mg_grouped_linear_options, prequantized_weights);
  ASSERT_EQ(mg_grouped_linear_workspace_bytes(&g, &got), MG_OK) << mg_last_error();
  EXPECT_EQ(got, want);
  g.struct_size = sizeof g;
  EXPECT_EQ(mg_grouped_linear_workspace_bytes(&g, &got), MG_ERR_INVALID_ARGUMENT) << "read at the current size";
  EXPECT_TRUE(last_error_has("prequantized_weights needs the mxfp8 recipe")) << mg_last_error();

  // mg_moe_layer_options grew twice: the expert-parallel release's size reads expert_parallel but not
  // prequantized_weights; a size inside that release's fields reads the first release's alone.
  mg_moe_layer_options m = small_moe();
  m.expert_parallel = 2, m.prequantized_weights = 1;
  const size_t previous = offsetof(mg_moe_layer_options, prequantized_weights);
  size_t window = 0;
  for (size_t size : {previous, previous + 4}) {
    m.struct_size = size;
    ASSERT_EQ(mg_moe_layer_window_bytes(&m, &window), MG_OK) << size << ": " << mg_last_error();
    EXPECT_GT(window, 0u) << size << ": expert_parallel is read";
  }
  m.struct_size = previous - 4;
  ASSERT_EQ(mg_moe_layer_window_bytes(&m, &window), MG_OK) << mg_last_error();
  EXPECT_EQ(window, 0u) << "the first release's fields alone: no expert parallelism";
  m.struct_size = sizeof m;
  EXPECT_EQ(mg_moe_layer_window_bytes(&m, &window), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("prequantized_weights needs the mxfp8 recipe")) << mg_last_error();
}

// The operators' argument and weight structs grew MXFP8 pointers; the entry points that read them
// need a GPU, so their reading is checked directly: an older size takes the older fields as given
// and leaves the new pointers NULL, whatever the caller's memory holds past its struct.
template <class T>
void expect_older_size_leaves_the_new_fields_null(const char* type, size_t appended_at) {
  SCOPED_TRACE(type);
  T in;
  std::memset(&in, 0x5a, sizeof in);
  const auto* given = reinterpret_cast<const unsigned char*>(&in);
  const size_t first = sizeof in.struct_size;
  in.struct_size = appended_at;
  const T older = c_api::read_struct(&in, type, T{});
  const auto* read = reinterpret_cast<const unsigned char*>(&older);
  EXPECT_EQ(older.struct_size, sizeof(T));
  EXPECT_EQ(std::memcmp(given + first, read + first, appended_at - first), 0) << "the older fields";
  for (size_t i = appended_at; i < sizeof(T); ++i) ASSERT_EQ(read[i], 0) << "byte " << i;
  in.struct_size = sizeof(T);
  const T current = c_api::read_struct(&in, type, T{});
  EXPECT_EQ(std::memcmp(given + first, reinterpret_cast<const unsigned char*>(&current) + first, sizeof(T) - first), 0)
      << "every field at the current size";
}

TEST(CAbiMxfp8, OlderArgumentAndWeightStructsCarryNoMxfp8Weights) {
  expect_older_size_leaves_the_new_fields_null<mg_forward_args>("mg_forward_args",
                                                                offsetof(mg_forward_args, mxfp8_data));
  expect_older_size_leaves_the_new_fields_null<mg_backward_args>("mg_backward_args",
                                                                 offsetof(mg_backward_args, mxfp8_data));
  expect_older_size_leaves_the_new_fields_null<mg_moe_layer_weights>("mg_moe_layer_weights",
                                                                     offsetof(mg_moe_layer_weights, w1_mxfp8_data));
  expect_older_size_leaves_the_new_fields_null<mg_step_weights>("mg_step_weights",
                                                                offsetof(mg_step_weights, w1_mxfp8_data));
  // The MXFP8 pointers close each struct, four per weight, in the order of moegraph::Mxfp8Weights.
  EXPECT_EQ(offsetof(mg_forward_args, mxfp8_scales_t) + sizeof(void*), sizeof(mg_forward_args));
  EXPECT_EQ(offsetof(mg_backward_args, mxfp8_scales_t) + sizeof(void*), sizeof(mg_backward_args));
  EXPECT_EQ(offsetof(mg_moe_layer_weights, w2_mxfp8_scales_t) + sizeof(void*), sizeof(mg_moe_layer_weights));
  EXPECT_EQ(offsetof(mg_step_weights, w2_mxfp8_scales_t) + sizeof(void*), sizeof(mg_step_weights));
}

constexpr const char* kPrequantizedConfig = R"({"layer": {"experts": 8, "hidden": 256, "ffn": 256, "top_k": 2},
                                               "precision": {"recipe": "mxfp8", "prequantized_weights": true},
                                               "row_align": 32, "buckets": [64]})";

TEST(CAbiMxfp8, ConfigShapeSaysTheWeightsArePrequantized) {
  mg_config* c = nullptr;
  ASSERT_EQ(mg_config_parse(kPrequantizedConfig, &c), MG_OK) << mg_last_error();
  mg_config_shape s = sized<mg_config_shape>();
  ASSERT_EQ(mg_config_shape_of(c, &s), MG_OK) << mg_last_error();
  EXPECT_EQ(s.prequantized_weights, 1);
  EXPECT_EQ(s.recipe, MG_RECIPE_MXFP8);
  // An older caller's struct ends before the field: it is left alone, the fields before it written.
  mg_config_shape old = sized<mg_config_shape>();
  old.struct_size = offsetof(mg_config_shape, prequantized_weights);
  old.prequantized_weights = -5, old.expert_parallel = -5;
  ASSERT_EQ(mg_config_shape_of(c, &old), MG_OK) << mg_last_error();
  EXPECT_EQ(old.expert_parallel, 1);
  EXPECT_EQ(old.prequantized_weights, -5);
  EXPECT_EQ(old.struct_size, offsetof(mg_config_shape, prequantized_weights));
  mg_config_destroy(c);

  ASSERT_EQ(mg_config_default(&c), MG_OK);
  ASSERT_EQ(mg_config_shape_of(c, &s), MG_OK);
  EXPECT_EQ(s.prequantized_weights, 0);
  mg_config_destroy(c);
  c = reinterpret_cast<mg_config*>(0x1);
  EXPECT_EQ(mg_config_parse(R"({"layer": {"experts": 8, "hidden": 256, "ffn": 256, "top_k": 2},
                                "precision": {"prequantized_weights": true}, "buckets": [64]})",
                            &c),
            MG_ERR_CONFIG);
  EXPECT_TRUE(last_error_has("precision.prequantized_weights needs precision.recipe \"mxfp8\"")) << mg_last_error();
  EXPECT_EQ(c, nullptr);
}

// Each MXFP8 pointer of mg_step_weights reaches its own StepWeights field: the step's weight check
// names the first one missing, before any device is looked for (the pointers are never read).
TEST(CAbiMxfp8, StepWeightsCarryEachMxfp8Pointer) {
  mg_config* c = nullptr;
  ASSERT_EQ(mg_config_parse(kPrequantizedConfig, &c), MG_OK) << mg_last_error();
  alignas(16) static uint8_t fake[16];
  mg_step_weights w = sized<mg_step_weights>();
  w.w1 = fake, w.w2 = fake;  // 16-bit weights: not what a prequantized step reads
  const char* const needs_w1 = "StepWeights needs w1_mxfp8.data and .scales (prequantized_weights)";
  const char* const needs_w1_t = "StepWeights needs w1_mxfp8.data_t and .scales_t for training (dgrad reads them)";
  const char* const needs_w2 = "StepWeights needs w2_mxfp8.data and .scales (prequantized_weights)";
  const char* const needs_w2_t = "StepWeights needs w2_mxfp8.data_t and .scales_t for training (dgrad reads them)";
  const std::pair<uint8_t* mg_step_weights::*, const char*> fields[] = {
      {&mg_step_weights::w1_mxfp8_data, needs_w1},      {&mg_step_weights::w1_mxfp8_scales, needs_w1_t},
      {&mg_step_weights::w1_mxfp8_data_t, needs_w1_t},  {&mg_step_weights::w1_mxfp8_scales_t, needs_w2},
      {&mg_step_weights::w2_mxfp8_data, needs_w2},      {&mg_step_weights::w2_mxfp8_scales, needs_w2_t},
      {&mg_step_weights::w2_mxfp8_data_t, needs_w2_t},
      {&mg_step_weights::w2_mxfp8_scales_t, "StepWeights needs the router weight for the whole-layer step"},
  };
  mg_step_graphs* step = reinterpret_cast<mg_step_graphs*>(0x1);
  EXPECT_EQ(mg_step_graphs_create(c, &w, nullptr, &step), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has(needs_w1)) << mg_last_error();
  for (const auto& [field, then_missing] : fields) {
    w.*field = fake;
    step = reinterpret_cast<mg_step_graphs*>(0x1);
    EXPECT_EQ(mg_step_graphs_create(c, &w, nullptr, &step), MG_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(last_error_has(then_missing)) << mg_last_error();
    EXPECT_EQ(step, nullptr);
  }
  // An older caller's size ends before the MXFP8 pointers: they are not read.
  w.struct_size = offsetof(mg_step_weights, w1_mxfp8_data);
  EXPECT_EQ(mg_step_graphs_create(c, &w, nullptr, &step), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has(needs_w1)) << mg_last_error();
  mg_config_destroy(c);
}

}  // namespace
}  // namespace moegraph
