// Checked sizes: every entry point that turns options into sizes refuses values that would wrap
// 64-bit arithmetic or pass the documented limits, naming the field, its value and the limit; and
// realistic shapes keep exactly the sizes they had before the checks.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kernels/quantize/mxfp8.hpp"
#include "moegraph/config.hpp"
#include "moegraph/error.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/moe_layer.hpp"
#include "moegraph/moegraph.h"
#include "moegraph/step_graphs.hpp"
#include "src/core/checked.hpp"
#include "src/core/deadline.hpp"
#include "src/core/layout.hpp"

namespace moegraph {
namespace {

constexpr int64_t kPow2_20 = int64_t{1} << 20;
constexpr int64_t kPow2_43 = int64_t{1} << 43;
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
const std::string kLayoutMax = "281474976710656";  // 2^48, LayoutWalker::kMaxBytes as messages print it

// The message of the moegraph::Error `f` throws (which must be an invalid argument), or "" when it
// returns normally.
std::string refusal(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
    return e.message();
  }
  return "";
}

// Every part (field, value, limit) must appear in the message.
void expect_names(const std::string& message, const std::vector<std::string>& parts) {
  EXPECT_FALSE(message.empty()) << "accepted, expected a refusal naming " << parts.front();
  for (const std::string& part : parts) EXPECT_NE(message.find(part), std::string::npos) << "message: " << message;
}

// ---- the helper and the layout walk ----

TEST(CheckedSizes, MulAndAddAreExactOrRefuseNamingWhatAndOperands) {
  EXPECT_EQ(checked_mul("x", kPow2_20, int64_t{4096}, sizeof(uint16_t)), int64_t{1} << 33);
  EXPECT_EQ(checked_add("sum", int64_t{1} << 62, (int64_t{1} << 62) - 1), kInt64Max);
  EXPECT_EQ(checked_align_up("rows", 1000, 128), 1024);
  expect_names(refusal([] { checked_mul("x", kPow2_20, kPow2_43, sizeof(uint16_t)); }),
               {"x: ", "1048576 * 8796093022208 * 2", "9223372036854775807"});
  expect_names(refusal([] { checked_add("sum", kInt64Max, int64_t{1}); }), {"sum: ", "9223372036854775807 + 1"});
  // size_t operands past int64: the result must convert to int64_t and size_t unchanged.
  expect_names(refusal([] { checked_mul("big", std::numeric_limits<std::size_t>::max(), 1); }),
               {"big: ", "18446744073709551615 * 1"});
  expect_names(refusal([] { checked_mul("rows", int64_t{-3}, 4); }), {"rows: ", "-3", "negative"});
  expect_names(refusal([] { checked_align_up("rows", kInt64Max - 10, 128); }), {"rows: "});
}

TEST(CheckedSizes, LayoutWalkerRefusesPastItsMaximumNamingTheBuffer) {
  static_assert(LayoutWalker::kMaxBytes == std::size_t{1} << 48);
  {
    LayoutWalker walk;
    walk.take("all", LayoutWalker::kMaxBytes);  // exactly the maximum fits
    EXPECT_EQ(walk.bytes(), LayoutWalker::kMaxBytes);
    walk.take("empty", 0);
    expect_names(refusal([&] { walk.take("one_more", 1); }),
                 {"\"one_more\"", "1 bytes", "offset 281474976710656", kLayoutMax});
  }
  {
    LayoutWalker walk;
    walk.take("a", 100);
    expect_names(refusal([&] { walk.take("huge", std::size_t{1} << 62); }),
                 {"\"huge\"", "4611686018427387904 bytes", "offset 256", kLayoutMax});
    // The old walk added this to its offset and wrapped to a total of 256 bytes.
    expect_names(refusal([&] { walk.take("wraps", std::numeric_limits<std::size_t>::max() - 64); }),
                 {"wraps: ", "18446744073709551551", "9223372036854775807"});
    EXPECT_EQ(walk.bytes(), 256u) << "refused buffers take no room";
  }
  {
    // The rounding up of the offset is what passes the maximum here.
    LayoutWalker walk;
    walk.take("a", LayoutWalker::kMaxBytes - 1);
    expect_names(refusal([&] { walk.take("b", 1); }), {"\"b\"", "offset 281474976710656", kLayoutMax});
  }
  {
    // A size given as extents: their product is checked before the walk sees it.
    LayoutWalker walk;
    expect_names(refusal([&] { walk.take("x", kPow2_20, kPow2_43, sizeof(uint16_t)); }),
                 {"x: ", "1048576 * 8796093022208 * 2", "9223372036854775807"});
    EXPECT_TRUE(walk.entries().empty()) << "a refused buffer is not recorded";
  }
}

// ---- GroupedLinear ----

GroupedLinearOptions linear(int64_t k, int64_t n, int64_t rows, int groups = 8) {
  GroupedLinearOptions o;
  o.num_groups = groups;
  o.in_features = k;
  o.out_features = n;
  o.capacity_rows = rows;
  return o;
}

// Each entry point that sizes GroupedLinearOptions refuses with the same message.
void expect_linear_refused(const GroupedLinearOptions& o, const std::vector<std::string>& parts) {
  SCOPED_TRACE(::testing::Message() << "K " << o.in_features << " N " << o.out_features << " rows "
                                    << o.capacity_rows);
  expect_names(refusal([&] { validate(o); }), parts);
  expect_names(refusal([&] { GroupedLinear::workspace_bytes(o); }), parts);
  expect_names(refusal([&] { GroupedLinear::workspace_buffers(o); }), parts);
}

TEST(CheckedSizes, GroupedLinearIssueExampleIsRefusedNotWrapped) {
  // Before: workspace_bytes returned 18446744056529683200 (a wrapped 1.8e19).
  expect_linear_refused(linear(int64_t{1} << 33, int64_t{1} << 33, (int64_t{1} << 31) - 1),
                        {"in_features (K) must be at most 2097152, got 8589934592"});
}

TEST(CheckedSizes, GroupedLinearFieldsAndProductsHaveUpperBounds) {
  EXPECT_EQ(kMaxFeatures, int64_t{1} << 21);
  EXPECT_EQ(kMaxCapacityRows, (int64_t{1} << 31) - 1);
  expect_linear_refused(linear(4096, int64_t{1} << 40, 1024),
                        {"out_features (N) must be at most 2097152, got 1099511627776"});
  expect_linear_refused(linear(kInt64Max - 15, 4096, 1024),
                        {"in_features (K) must be at most 2097152, got 9223372036854775792"});
  expect_linear_refused(linear(kMaxFeatures + 16, 4096, 1024),
                        {"in_features (K) must be at most 2097152, got 2097168"});
  expect_linear_refused(linear(4096, 4096, kInt64Max), {"capacity_rows must be below 2^31, got 9223372036854775807"});
  // Each field within its bound, their product past one layout.
  expect_linear_refused(linear(kMaxFeatures, kMaxFeatures, kMaxCapacityRows - 127),
                        {"capacity_rows * max(in_features, out_features) * 2 bytes (the largest row buffer) must be "
                         "at most " + kLayoutMax + ", got 2147483520 * 2097152 * 2 = 9007198717870080"});
  expect_linear_refused(linear(kMaxFeatures, kMaxFeatures, 128, kMaxGroups),
                        {"num_groups * out_features * in_features * 4 bytes (an fp32 main_grad) must be at most " +
                         kLayoutMax + ", got 1024 * 2097152 * 2097152 * 4 = 18014398509481984"});
  // At the bounds exactly: accepted.
  EXPECT_NO_THROW(validate(linear(kMaxFeatures, kMaxFeatures, 16)));
  EXPECT_NO_THROW(validate(linear(16, 16, kMaxCapacityRows)));
}

// Every row buffer within the maximum, the workspace as a whole past it: validate() accepts, the
// walk refuses, naming the buffer that would pass.
GroupedLinearOptions linear_with_too_large_workspace() { return linear(kPow2_20, kPow2_20, int64_t{1} << 27); }

TEST(CheckedSizes, GroupedLinearWorkspacePastTheMaximumNamesTheBuffer) {
  const GroupedLinearOptions o = linear_with_too_large_workspace();
  EXPECT_NO_THROW(validate(o));
  const std::vector<std::string> parts = {"workspace buffer \"slot0.x\" of 281474976710656 bytes at offset 256",
                                          "layout maximum of " + kLayoutMax};
  expect_names(refusal([&] { GroupedLinear::workspace_bytes(o); }), parts);
  expect_names(refusal([&] { GroupedLinear::workspace_buffers(o); }), parts);
  // The constructor sizes before it looks for a device or allocates: an invalid argument here, GPU or not.
  expect_names(refusal([&] { GroupedLinear op(o); }), parts);
}

mg_grouped_linear_options c_linear(int64_t k, int64_t n, int64_t rows) {
  mg_grouped_linear_options o;
  mg_grouped_linear_options_init(&o);
  o.num_groups = 8;
  o.in_features = k;
  o.out_features = n;
  o.capacity_rows = rows;
  return o;
}

void expect_c_create_refused(const mg_grouped_linear_options& o, const std::vector<std::string>& parts) {
  mg_grouped_linear* op = reinterpret_cast<mg_grouped_linear*>(0x1);
  EXPECT_EQ(mg_grouped_linear_create(&o, nullptr, &op), MG_ERR_INVALID_ARGUMENT) << mg_last_error();
  EXPECT_EQ(op, nullptr);
  expect_names(mg_last_error(), parts);
}

TEST(CheckedSizes, CAbiGroupedLinearCreateRefusesBeforeTouchingTheGpu) {
  expect_c_create_refused(c_linear(int64_t{1} << 33, int64_t{1} << 33, (int64_t{1} << 31) - 1),
                          {"in_features (K) must be at most 2097152, got 8589934592"});
  expect_c_create_refused(c_linear(4096, kInt64Max - 15, 1024),
                          {"out_features (N) must be at most 2097152, got 9223372036854775792"});
  // No GPU on the host: MG_ERR_INVALID_ARGUMENT rather than MG_ERR_NO_DEVICE shows that the
  // workspace was sized (and refused) before the device was looked at.
  expect_c_create_refused(c_linear(kPow2_20, kPow2_20, int64_t{1} << 27),
                          {"workspace buffer \"slot0.x\"", "layout maximum of " + kLayoutMax});
}

// ---- MoeLayer ----

MoeLayerOptions moe(int experts, int64_t hidden, int64_t ffn, int top_k, int64_t max_tokens) {
  MoeLayerOptions o;
  o.experts = experts;
  o.hidden = hidden;
  o.ffn = ffn;
  o.top_k = top_k;
  o.max_tokens = max_tokens;
  return o;
}

mg_moe_layer_options c_moe(const MoeLayerOptions& cpp) {
  mg_moe_layer_options o;
  mg_moe_layer_options_init(&o);
  o.experts = cpp.experts;
  o.hidden = cpp.hidden;
  o.ffn = cpp.ffn;
  o.top_k = cpp.top_k;
  o.max_tokens = cpp.max_tokens;
  o.row_align = cpp.row_align;
  o.training = cpp.training;
  return o;
}

// Each entry point that sizes MoeLayerOptions (C++ and C) refuses with the same message; the C
// create with a NULL workspace refuses before it could allocate.
void expect_moe_refused(const MoeLayerOptions& o, const std::vector<std::string>& parts) {
  SCOPED_TRACE(::testing::Message() << "hidden " << o.hidden << " ffn " << o.ffn << " max_tokens " << o.max_tokens);
  expect_names(refusal([&] { MoeLayer::workspace_bytes(o); }), parts);
  expect_names(refusal([&] { MoeLayer::workspace_buffers(o); }), parts);
  const mg_moe_layer_options c = c_moe(o);
  std::size_t bytes = 123;
  EXPECT_EQ(mg_moe_layer_workspace_bytes(&c, &bytes), MG_ERR_INVALID_ARGUMENT) << "got " << bytes << " bytes";
  EXPECT_EQ(bytes, 0u);
  expect_names(mg_last_error(), parts);
  mg_moe_layer_weights weights{};
  weights.struct_size = sizeof(weights);
  mg_moe_layer* layer = reinterpret_cast<mg_moe_layer*>(0x1);
  EXPECT_EQ(mg_moe_layer_create(&c, &weights, nullptr, &layer), MG_ERR_INVALID_ARGUMENT) << mg_last_error();
  EXPECT_EQ(layer, nullptr);
  expect_names(mg_last_error(), parts);
}

// The quantizer's walk keeps a row, tile padding included, in 31 bits: capacity_rows past 2^31 - 32
// is refused on the host, naming the limit, before anything is launched (the pointers here are
// never dereferenced).
TEST(CheckedSizes, Mxfp8QuantizerRowsHaveAnUpperBound) {
  alignas(16) static uint8_t fake[64];
  const kernels::Mxfp8Rowwise row{fake, fake};
  const int64_t* offsets = reinterpret_cast<const int64_t*>(fake);
  const int64_t limit = (int64_t{1} << 31) - 32;
  expect_names(refusal([&] {
                 kernels::launch_quantize_mxfp8(DType::kBF16, fake, limit, 32, offsets, nullptr, 1, &row, nullptr,
                                                nullptr);
               }),
               {"capacity_rows", "2^31 - 32", std::to_string(limit)});
  expect_names(refusal([&] {
                 kernels::launch_quantize_mxfp8(DType::kBF16, fake, kMaxCapacityRows, 32, offsets, nullptr, 1, &row,
                                                nullptr, nullptr);
               }),
               {"capacity_rows", std::to_string(kMaxCapacityRows)});
}

TEST(CheckedSizes, MoeLayerIssueExampleIsRefusedNotWrapped) {
  // Before: MG_OK and 612379136 bytes, while x alone needs 2^20 * 2^43 * 2 = 2^64 bytes.
  const MoeLayerOptions o = moe(8, kPow2_43, 16, 2, kPow2_20);
  const std::string expected = "hidden must be at most 1048576, got 8796093022208";
  expect_names(refusal([&] { validate(o); }), {expected});
  expect_moe_refused(o, {expected});
}

TEST(CheckedSizes, MoeLayerFieldsAndProductsHaveUpperBounds) {
  EXPECT_EQ(kMaxLayerWidth, kPow2_20);
  EXPECT_EQ(kMaxLayerTokens, int64_t{1} << 24);
  const std::vector<std::pair<MoeLayerOptions, std::string>> cases = {
      {moe(8, 4096, int64_t{1} << 40, 2, 1024), "ffn must be at most 1048576, got 1099511627776"},
      {moe(8, kInt64Max - 15, 4096, 2, 1024), "hidden must be at most 1048576, got 9223372036854775792"},
      {moe(8, kMaxLayerWidth + 16, 4096, 2, 1024), "hidden must be at most 1048576, got 1048592"},
      {moe(8, 4096, 4096, 2, kInt64Max), "max_tokens must be in [1, 2^24], got 9223372036854775807"},
      {moe(kMaxGroups + 1, 4096, 4096, 2, 1024), "experts must be in [1, 1024], got 1025"},
      // Each field within its bound, their product past one layout.
      {moe(8, 16, kMaxLayerWidth, 8, kMaxLayerTokens),
       "rows * max(2 * ffn, hidden) * 2 bytes (the widest row buffer) must be at most " + kLayoutMax +
           ", got 134217728 * 2097152 * 2 = 562949953421312"},
      // The rows of x wider than FC1's output (hidden > 2 * ffn), padded past 2^27 rows.
      {[] {
         MoeLayerOptions o = moe(8, kMaxLayerWidth, 16, 8, kMaxLayerTokens);
         o.row_align = 16;
         return o;
       }(),
       "rows * max(2 * ffn, hidden) * 2 bytes (the widest row buffer) must be at most " + kLayoutMax +
           ", got 134217856 * 1048576 * 2 = 281475245146112"},
      {moe(kMaxGroups, kMaxLayerWidth, kMaxLayerWidth, 1, 16),
       "experts * 2 * ffn * hidden * 4 bytes (fc1's fp32 main_grad) must be at most " + kLayoutMax +
           ", got 1024 * 2 * 1048576 * 1048576 * 4 = 9007199254740992"},
  };
  for (const auto& [o, expected] : cases) {
    expect_names(refusal([&] { validate(o); }), {expected});
    expect_moe_refused(o, {expected});
  }
  EXPECT_NO_THROW(validate(moe(8, kMaxLayerWidth, 16, 2, 16)));
  EXPECT_NO_THROW(validate(moe(8, 16, kMaxLayerWidth, 2, 16)));
}

TEST(CheckedSizes, MoeLayerRowsAreCheckedBeforeValidation) {
  expect_names(refusal([] { moe_layer_rows(moe(8, 4096, 4096, 8, kInt64Max)); }),
               {"rows (max_tokens * top_k): ", "9223372036854775807 * 8"});
}

TEST(CheckedSizes, MoeLayerWorkspacePastTheMaximumNamesTheBuffer) {
  for (bool training : {true, false}) {
    MoeLayerOptions o = moe(8, 16, int64_t{1} << 19, 8, kMaxLayerTokens);
    o.training = training;
    EXPECT_NO_THROW(validate(o));
    expect_moe_refused(o, {"workspace buffer \"slot0.fc1_out\" of 281474976710656 bytes",
                           "layout maximum of " + kLayoutMax});
  }
}

// ---- the step plan ----

Config step_config(StepKind step, int experts, int64_t hidden, int64_t ffn, int top_k, std::vector<int64_t> buckets) {
  Config c;
  c.step = step;
  c.layer.experts = experts;
  c.layer.hidden = hidden;
  c.layer.ffn = ffn;
  c.layer.top_k = top_k;
  c.buckets = std::move(buckets);
  return c;
}

TEST(CheckedSizes, StepPlanRefusesWrappingOptionsNamingTheField) {
  for (StepKind step : {StepKind::kMoeLayer, StepKind::kExperts}) {
    SCOPED_TRACE(step_kind_name(step));
    // The issue's example as a step: the bucket's x alone would be 2^64 bytes.
    const StepGraphsOptions o = step_graphs_options(step_config(step, 8, kPow2_43, 16, 2, {1024, kPow2_20}));
    const std::string expected = "hidden must be at most 1048576, got 8796093022208";
    expect_names(refusal([&] { validate(o); }), {expected});
    expect_names(refusal([&] { plan_step(o); }), {expected});
  }
}

TEST(CheckedSizes, StepPlanPastTheLayoutMaximumNamesTheBuffer) {
  Config c = step_config(StepKind::kExperts, 8, 16, int64_t{1} << 18, 8, {kMaxLayerTokens});
  c.training.wgrad_slots = 4;
  const StepGraphsOptions o = step_graphs_options(c);
  EXPECT_NO_THROW(validate(o));
  expect_names(refusal([&] { plan_step(o); }),
               {"workspace buffer \"slot1.fc1_out\"", "layout maximum of " + kLayoutMax});
}

// ---- realistic shapes: accepted, with the sizes they had before the checks ----

TEST(CheckedSizes, RealisticShapesKeepTheirSizes) {
  // Mixtral 8x7B: 8 experts, hidden 4096, ffn 14336, top 2; 8192 tokens. The dispatch's chunk
  // counts grew when its chunks shrank to 256 assignments: 64 chunks instead of 8, x 8 experts x 4
  // bytes (1792 bytes more than before).
  const uint64_t mixtral_counts = (64 - 8) * 8 * 4;
  // bf16 training: FC1 and FC2 no longer copy their inputs into their slots (the layer saves x_perm
  // and swiglu_out per slot itself, caller_keeps_activations): 16384 rows x (4096 + 14336) x 2 bytes
  // less per bucket of 8192 tokens.
  const auto kept = [](uint64_t tokens) { return tokens * 2 * (4096 + 14336) * 2; };
  MoeLayerOptions mixtral = moe(8, 4096, 14336, 2, 8192);
  EXPECT_EQ(MoeLayer::workspace_bytes(mixtral), 4027648768u + mixtral_counts - kept(8192));
  const mg_moe_layer_options c = c_moe(mixtral);
  std::size_t bytes = 0;
  ASSERT_EQ(mg_moe_layer_workspace_bytes(&c, &bytes), MG_OK) << mg_last_error();
  EXPECT_EQ(bytes, 4027648768u + mixtral_counts - kept(8192));
  mixtral.training = false;
  // Plus the router's copy of x (8192 x 4096 x 2 bytes), which inference keeps too since the logits
  // GEMM stopped reading the caller's x past row n; less each expert linear's slot, which a
  // forward_only linear does not lay out: its copy of x (16384 rows x 4096, and x 14336, 2 bytes
  // each) and its splits and offsets (256 bytes each after alignment).
  const uint64_t slots = uint64_t{16384} * (4096 + 14336) * 2 + 2 * 2 * 256;
  EXPECT_EQ(MoeLayer::workspace_bytes(mixtral),
            2282556160u + uint64_t{8192} * 4096 * 2 + mixtral_counts - slots);

  // DeepSeek-V3-like: 256 experts of 2048 over hidden 7168, top 8, MXFP8, biases, two delayed slots.
  MoeLayerOptions deepseek = moe(256, 7168, 2048, 8, 16384);
  deepseek.row_align = 128, deepseek.recipe = Recipe::kMXFP8, deepseek.bias = true;
  deepseek.wgrad_slots = 2, deepseek.delay_wgrad = true;
  // 27001083392 before the staged MXFP8 route, plus each expert linear's bf16 staging of its wgrad
  // operands: 163584 capacity rows (16384 x 8 + 256 x 127) x (4096 + 7168), and x (7168 + 2048),
  // 2 bytes each; plus the dispatch's chunk counts at 512-wide chunks: 256 chunks instead of 64,
  // x 256 experts x 4 bytes; less the row-wise codes of x and dy (163584 x 7168 bytes and their
  // scales, 1/32 of that, in each expert linear), since every fprop and dgrad of this layer takes the
  // staged route, whose A the quantizer writes as bf16 values into the staging; less the dispatch's
  // permuted copy of x (163584 x 7168 x 2 bytes): FC1's quantizer reads the tokens through
  // token_of_row; less the SwiGLU's output (163584 x 2048 x 2 bytes): FC2's quantizer applies the
  // SwiGLU as it reads FC1's output.
  const uint64_t codes = uint64_t{163584} * 7168 * 33 / 32, x_perm = uint64_t{163584} * 7168 * 2,
                 swiglu_out = uint64_t{163584} * 2048 * 2;
  EXPECT_EQ(MoeLayer::workspace_bytes(deepseek), 27001083392u + uint64_t{163584} * (11264 + 9216) * 2 +
                                                     (256 - 64) * 256 * 4 - 2 * codes - x_perm - swiglu_out);

  // Mixtral's FC1 as a GroupedLinear (N = 2 * ffn), plain and with bias and two delayed slots.
  GroupedLinearOptions fc1 = linear(4096, 28672, 16384);
  EXPECT_EQ(GroupedLinear::workspace_bytes(fc1), 134218496u);
  fc1.bias = true, fc1.wgrad_slots = 2, fc1.delay_wgrad = true;
  EXPECT_EQ(GroupedLinear::workspace_bytes(fc1), 2155873536u);

  const auto mixtral_step = [](StepKind step) {
    return plan_step(step_graphs_options(step_config(step, 8, 4096, 14336, 2, {1024, 8192})));
  };
  const StepPlan layer = mixtral_step(StepKind::kMoeLayer);
  EXPECT_EQ(layer.arena_bytes, 4296084736u + mixtral_counts - kept(8192));  // the 1024-token bucket's growth fits its padding
  EXPECT_EQ(layer.sum_of_buckets, 4833098240u + mixtral_counts - kept(8192) - kept(1024));
  EXPECT_EQ(layer.weight_bytes, 8455913472u);
  const StepPlan experts = mixtral_step(StepKind::kExperts);
  EXPECT_EQ(experts.arena_bytes, 3959425536u);
  EXPECT_EQ(experts.sum_of_buckets, 4454355968u);
  EXPECT_EQ(experts.weight_bytes, 8455716864u);
}

// A wait's deadline from the caller's milliseconds: as given up to a century, a century past it
// ("forever" as INT64_MAX ms would overflow the clock's nanoseconds and end the wait at once).
TEST(Deadline, LargeTimeoutsWaitACenturyInsteadOfWrapping) {
  const auto now = std::chrono::steady_clock::now();
  EXPECT_EQ(deadline_after(now, 0), now);
  EXPECT_EQ(deadline_after(now, 250), now + std::chrono::milliseconds(250));
  EXPECT_EQ(deadline_after(now, kMaxWaitMs), now + std::chrono::milliseconds(kMaxWaitMs));
  for (long long big : {kMaxWaitMs + 1, 10'000'000'000'000LL, std::numeric_limits<long long>::max()}) {
    EXPECT_EQ(deadline_after(now, big), now + std::chrono::milliseconds(kMaxWaitMs)) << big;
    EXPECT_GT(deadline_after(now, big), now + std::chrono::hours(24 * 365)) << big;
  }
}

}  // namespace
}  // namespace moegraph
