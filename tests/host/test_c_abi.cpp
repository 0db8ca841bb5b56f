// The C ABI's conventions on paths that never reach a GPU: version, status strings, size-prefixed
// structs (and structs that grew), live-handle checks, configs, the StepGraphs entry points'
// refusals, and expert parallelism's communicators and options.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "moegraph/config.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/moe_layer.hpp"
#include "moegraph/moegraph.h"

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
  for (size_t size : {size_t{0}, size_t{8}, sizeof(o) - 4}) {
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

}  // namespace
}  // namespace moegraph
