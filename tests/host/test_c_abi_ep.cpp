// The C ABI of expert parallelism without a GPU: NCCL unique ids, communicator arguments and handles,
// emulated groups, the layer options' expert-parallel fields (and older struct sizes), window sizes,
// and the communicator checks of layer and step creation.
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
  out = reinterpret_cast<mg_ep_comm*>(0x1);
  EXPECT_EQ(mg_ep_comm_split(nullptr, 0, 0, &out), MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(last_error_has("null mg_ep_comm handle")) << mg_last_error();
  EXPECT_EQ(out, nullptr);
  EXPECT_EQ(mg_ep_comm_split(nullptr, 0, 0, nullptr), MG_ERR_INVALID_ARGUMENT);
  int completed = 7;
  EXPECT_EQ(mg_ep_comm_wait(nullptr, nullptr, 0, &completed), MG_ERR_INVALID_HANDLE);
  EXPECT_EQ(completed, 0) << "a refused wait reports nothing completed";
  EXPECT_EQ(mg_ep_comm_wait(nullptr, nullptr, 0, nullptr), MG_ERR_INVALID_ARGUMENT) << "the output is checked first";
  EXPECT_EQ(mg_ep_comm_abort(nullptr), MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(last_error_has("null mg_ep_comm handle")) << mg_last_error();
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
  {  // more ranks than hardware queues: refused before CUDA is touched, every entry NULL
    mg_ep_comm* nine[9];
    for (mg_ep_comm*& c : nine) c = reinterpret_cast<mg_ep_comm*>(0x1);
    ScopedEnv queues("CUDA_DEVICE_MAX_CONNECTIONS", nullptr);
    EXPECT_EQ(mg_ep_emulated_group_create(9, nine), MG_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(last_error_has("group of 9 ranks needs as many hardware queues, and this process has 8"))
        << mg_last_error();
    for (mg_ep_comm* c : nine) EXPECT_EQ(c, nullptr);
  }
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

// The send/recv exchange: its fields reach the C++ options (same sizes), are validated by name, and a
// caller whose struct ends before them gets peer stores.
TEST(CAbiEp, SendRecvExchangeFollowsTheCppApi) {
  mg_moe_layer_options o = small_moe();
  EXPECT_EQ(o.ep_exchange, MG_EP_PEER_STORES);
  EXPECT_EQ(o.ep_chunk_rows, 0);
  MoeLayerOptions cpp;
  cpp.experts = 8, cpp.hidden = 256, cpp.ffn = 256, cpp.top_k = 2, cpp.max_tokens = 64, cpp.expert_parallel = 2;
  cpp.ep_exchange = EpExchange::kSendRecv;
  o.expert_parallel = 2;
  o.ep_exchange = MG_EP_SEND_RECV;
  size_t window = 0, workspace = 0;
  ASSERT_EQ(mg_moe_layer_window_bytes(&o, &window), MG_OK) << mg_last_error();
  ASSERT_EQ(mg_moe_layer_workspace_bytes(&o, &workspace), MG_OK) << mg_last_error();
  EXPECT_EQ(window, MoeLayer::window_bytes(cpp));
  EXPECT_EQ(workspace, MoeLayer::workspace_bytes(cpp));
  // Chunks of 16 rows instead of the worst case (64 * 2): less staging and a smaller receive buffer.
  o.ep_chunk_rows = 16;
  cpp.ep_chunk_rows = 16;
  size_t chunked_window = 0, chunked_workspace = 0;
  ASSERT_EQ(mg_moe_layer_window_bytes(&o, &chunked_window), MG_OK) << mg_last_error();
  ASSERT_EQ(mg_moe_layer_workspace_bytes(&o, &chunked_workspace), MG_OK) << mg_last_error();
  EXPECT_EQ(chunked_window, MoeLayer::window_bytes(cpp));
  EXPECT_EQ(chunked_workspace, MoeLayer::workspace_bytes(cpp));
  EXPECT_LT(chunked_window, window);
  EXPECT_LT(chunked_workspace, workspace);
  EXPECT_EQ(moe_ep_worst_case_rows(cpp), 2 * 16);

  size_t bytes = 7;
  o.ep_exchange = static_cast<mg_ep_exchange>(5);
  EXPECT_EQ(mg_moe_layer_workspace_bytes(&o, &bytes), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("ep_exchange must be MG_EP_PEER_STORES or MG_EP_SEND_RECV, got 5")) << mg_last_error();
  o.ep_exchange = MG_EP_PEER_STORES;
  EXPECT_EQ(mg_moe_layer_workspace_bytes(&o, &bytes), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("ep_chunk_rows needs ep_exchange send_recv, got 16")) << mg_last_error();
  o.ep_exchange = MG_EP_SEND_RECV;
  o.ep_chunk_rows = -1;
  EXPECT_EQ(mg_moe_layer_workspace_bytes(&o, &bytes), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("ep_chunk_rows must be 0 (the worst case) or a positive bound, got -1"))
      << mg_last_error();
  o.ep_chunk_rows = 0;
  o.expert_parallel = 1;
  EXPECT_EQ(mg_moe_layer_workspace_bytes(&o, &bytes), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("ep_exchange send_recv needs expert_parallel > 1")) << mg_last_error();

  // A struct that ends at prequantized_weights: the exchange fields are not read, whatever follows.
  mg_moe_layer_options old = small_moe();
  old.expert_parallel = 2;
  const size_t fields_end = offsetof(mg_moe_layer_options, ep_exchange);
  std::memset(reinterpret_cast<unsigned char*>(&old) + fields_end, 0x5a, sizeof(old) - fields_end);
  old.struct_size = fields_end;
  size_t old_window = 0;
  ASSERT_EQ(mg_moe_layer_window_bytes(&old, &old_window), MG_OK) << mg_last_error();
  cpp.ep_exchange = EpExchange::kPeerStores;
  cpp.ep_chunk_rows = 0;
  EXPECT_EQ(old_window, MoeLayer::window_bytes(cpp));
  // The release before keeps its own last field: prequantized_weights is read (bf16 refuses it by
  // name) at that release's end and at its sizeof, which may cover the new field's first bytes.
  const size_t old_sizeof = (fields_end + alignof(int64_t) - 1) / alignof(int64_t) * alignof(int64_t);
  for (size_t size : {fields_end, old_sizeof}) {
    SCOPED_TRACE(size);
    mg_moe_layer_options pre = small_moe();
    pre.prequantized_weights = 1;
    std::memset(reinterpret_cast<unsigned char*>(&pre) + fields_end, 0x5a, sizeof(pre) - fields_end);
    pre.struct_size = size;
    EXPECT_EQ(mg_moe_layer_workspace_bytes(&pre, &bytes), MG_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(last_error_has("prequantized_weights needs the mxfp8 recipe")) << mg_last_error();
  }
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

// With sharded weights, mg_step_graphs_options.shard_comm is the data-parallel group's communicator;
// with expert parallelism too, comm is needed as well.
TEST(CAbiEp, ShardedStepCreateNeedsTheDataParallelCommunicator) {
  mg_config* c = nullptr;
  ASSERT_EQ(mg_config_parse(R"({"layer": {"experts": 8, "hidden": 256, "ffn": 256, "top_k": 2},
                                "parallel": {"sharding": {"ranks": 3}}, "buckets": [64]})",
                            &c),
            MG_OK)
      << mg_last_error();
  const mg_step_weights w = sized<mg_step_weights>();
  mg_step_graphs* step = reinterpret_cast<mg_step_graphs*>(0x1);
  EXPECT_EQ(mg_step_graphs_create(c, &w, nullptr, &step), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("parallel.sharding.ranks = 3 needs this rank's communicator in "
                             "mg_step_graphs_options.shard_comm, got no options"))
      << mg_last_error();
  EXPECT_EQ(step, nullptr);
  mg_config_destroy(c);

  ASSERT_EQ(mg_config_parse(R"({"layer": {"experts": 8, "hidden": 256, "ffn": 256, "top_k": 2},
                                "parallel": {"expert_parallel": 2, "sharding": {"ranks": 3}}, "buckets": [64]})",
                            &c),
            MG_OK)
      << mg_last_error();
  mg_step_graphs_options o = sized<mg_step_graphs_options>();
  EXPECT_EQ(mg_step_graphs_create(c, &w, &o, &step), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("parallel.expert_parallel = 2 needs this rank's communicator in "
                             "mg_step_graphs_options.comm, got NULL"))
      << mg_last_error();
  o.comm = reinterpret_cast<mg_ep_comm*>(c);  // not a communicator
  EXPECT_EQ(mg_step_graphs_create(c, &w, &o, &step), MG_ERR_INVALID_HANDLE);
  o.comm = nullptr;
  o.shard_comm = reinterpret_cast<mg_ep_comm*>(c);
  EXPECT_EQ(mg_step_graphs_create(c, &w, &o, &step), MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(last_error_has("mg_ep_comm handle that is not live")) << mg_last_error();
  EXPECT_EQ(step, nullptr);
  mg_config_destroy(c);
}

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
  EXPECT_TRUE(last_error_has("mg_step_graphs_options.comm, got NULL")) << mg_last_error();
  o.comm = reinterpret_cast<mg_ep_comm*>(c);  // not a communicator
  EXPECT_EQ(mg_step_graphs_create(c, &w, &o, &step), MG_ERR_INVALID_HANDLE);
  EXPECT_TRUE(last_error_has("mg_ep_comm handle that is not live")) << mg_last_error();
  EXPECT_EQ(step, nullptr);
  // A caller of the release before shard_comm (its struct ends there) has its comm read: the same
  // refusal of the handle, not "got NULL" (a release list without that end dropped comm).
  mg_step_graphs_options before_shards = o;
  before_shards.struct_size = offsetof(mg_step_graphs_options, shard_comm);
  EXPECT_EQ(mg_step_graphs_create(c, &w, &before_shards, &step), MG_ERR_INVALID_HANDLE);
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
