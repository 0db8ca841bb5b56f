// The C ABI of MXFP8 weights given by the caller, without a GPU: defaults, sizes, the quantizer's
// refusals, prequantized_weights against the C++ API, and older struct sizes carrying none.
#include <gtest/gtest.h>

#include <algorithm>
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
#include "tests/common/thrown.hpp"
#include "tests/host/c_abi_helpers.hpp"

namespace moegraph {
namespace {

using namespace c_abi_test;

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
  EXPECT_EQ(g.dequantized_weights, 0);
  EXPECT_EQ(m.dequantized_weights, 0);
  EXPECT_FALSE(GroupedLinearOptions{}.dequantized_weights);
  EXPECT_FALSE(MoeLayerOptions{}.dequantized_weights);
  EXPECT_EQ(g.forward_only, 0);
  EXPECT_FALSE(GroupedLinearOptions{}.forward_only);
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
    EXPECT_EQ(std::string(mg_last_error()), test::thrown_what([&] { mxfp8_weight_data_bytes(b.groups, b.n, b.k); }));
    EXPECT_EQ(data, 0u);
    EXPECT_EQ(scales, 0u);
  }
  size_t one = 1;
  EXPECT_EQ(mg_mxfp8_weight_bytes(1, 32, 32, &one, nullptr), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("mg_mxfp8_weight_bytes needs both outputs (data_bytes and scale_bytes)"))
      << mg_last_error();
  EXPECT_EQ(one, 0u) << "on failure both outputs are 0, the given one too";
  one = 1;
  EXPECT_EQ(mg_mxfp8_weight_bytes(1, 32, 32, nullptr, &one), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(one, 0u);
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
              test::thrown_what([&] { quantize_mxfp8_weights(dtype, c.w, c.groups, c.n, c.k, out, nullptr); }));
  }
  // A value outside mg_dtype is refused by name, before the sizes are looked at.
  EXPECT_EQ(mg_quantize_mxfp8_weights(static_cast<mg_dtype>(2), p, 0, 32, 32, p, p, nullptr, nullptr, nullptr),
            MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("dtype must be MG_DTYPE_BF16 or MG_DTYPE_FP16, got 2")) << mg_last_error();
}

TEST(CAbiMxfp8, PrequantizedWeightsNeedTheMxfp8RecipeAsInTheCppApi) {
  mg_grouped_linear_options g = small_linear();
  g.row_align = 32, g.prequantized_weights = 1;
  GroupedLinearOptions cg;
  cg.num_groups = 8, cg.in_features = 256, cg.out_features = 512, cg.capacity_rows = 1024, cg.row_align = 32;
  cg.prequantized_weights = true;
  const std::string linear_expected = test::thrown_what([&] { validate(cg); });
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
  const std::string layer_expected = test::thrown_what([&] { validate(cm); });
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
  const mg_grouped_linear_options plain = small_linear();
  size_t want = 0, got = 1;
  ASSERT_EQ(mg_grouped_linear_workspace_bytes(&plain, &want), MG_OK) << mg_last_error();
  mg_grouped_linear_options g = small_linear();
  g.prequantized_weights = 1;
  g.struct_size = offsetof(mg_grouped_linear_options, prequantized_weights);
  ASSERT_EQ(mg_grouped_linear_workspace_bytes(&g, &got), MG_OK) << mg_last_error();
  EXPECT_EQ(got, want);
  g.struct_size = sizeof g;
  EXPECT_EQ(mg_grouped_linear_workspace_bytes(&g, &got), MG_ERR_INVALID_ARGUMENT) << "read at the current size";
  EXPECT_TRUE(last_error_has("prequantized_weights needs the mxfp8 recipe")) << mg_last_error();

  // The release before forward_only ends at its offset: such a caller's dequantized_weights is read
  // (and refused with the bf16 recipe: so it was read), and forward_only keeps its default.
  mg_grouped_linear_options d = small_linear();
  d.dequantized_weights = 1;
  d.struct_size = offsetof(mg_grouped_linear_options, forward_only);
  EXPECT_EQ(mg_grouped_linear_workspace_bytes(&d, &got), MG_ERR_INVALID_ARGUMENT) << "dequantized_weights read";
  EXPECT_TRUE(last_error_has("dequantized_weights needs the mxfp8 recipe")) << mg_last_error();

  // mg_moe_layer_options grew three times: the expert-parallel release's size (or one inside
  // prequantized_weights) reads expert_parallel but not prequantized_weights; a size inside that
  // release's fields reads the first release's alone.
  mg_moe_layer_options m = small_moe();
  m.expert_parallel = 2, m.prequantized_weights = 1;
  const size_t previous = offsetof(mg_moe_layer_options, prequantized_weights);
  size_t window = 0;
  for (size_t size : {previous, previous + 2}) {
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

// The options' _init writes the caller's struct as its header has it and no more: called through
// the macro it passes sizeof; an older caller's smaller struct keeps the bytes past it (the stack
// beyond, to that caller), gets its release's fields and its own struct_size; a newer caller's
// unknown tail is zeroed; below the first release nothing is written. The function form fills the
// current struct.
template <class T>
void expect_init_writes_only_the_callers_struct(mg_status (*init_sized)(T*, size_t), void (*init)(T*),
                                                const char* type, size_t older) {
  SCOPED_TRACE(type);
  T current;
  init(&current);
  EXPECT_EQ(current.struct_size, sizeof(T));
  constexpr size_t kSlack = 32;
  unsigned char buffer[sizeof(T) + kSlack];
  for (size_t size : {older, sizeof(T), sizeof(T) + 16}) {
    std::memset(buffer, 0xab, sizeof buffer);
    ASSERT_EQ(init_sized(reinterpret_cast<T*>(buffer), size), MG_OK) << size << ": " << mg_last_error();
    size_t written_size = 0;
    std::memcpy(&written_size, buffer, sizeof written_size);
    EXPECT_EQ(written_size, size);
    const size_t known = c_api::known_bytes<T>(size);
    const auto* defaults = reinterpret_cast<const unsigned char*>(&current);
    EXPECT_EQ(std::memcmp(buffer + sizeof(size_t), defaults + sizeof(size_t), known - sizeof(size_t)), 0)
        << size << ": the defaults of the caller's release";
    for (size_t i = sizeof(T); i < size; ++i) ASSERT_EQ(buffer[i], 0) << size << ": unknown tail byte " << i;
    for (size_t i = std::max(size, known); i < sizeof buffer; ++i)
      ASSERT_EQ(buffer[i], 0xab) << size << ": byte " << i << " past the caller's struct was written";
  }
  std::memset(buffer, 0xab, sizeof buffer);
  EXPECT_EQ(init_sized(reinterpret_cast<T*>(buffer), c_api::kFirstSize<T> - 8), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("smaller than its first release")) << mg_last_error();
  for (unsigned char b : buffer) ASSERT_EQ(b, 0xab) << "written below the first release";
}

TEST(CAbi, OptionsInitWritesOnlyTheCallersStruct) {
  expect_init_writes_only_the_callers_struct<mg_grouped_linear_options>(
      mg_grouped_linear_options_init_sized, mg_grouped_linear_options_init, "mg_grouped_linear_options",
      offsetof(mg_grouped_linear_options, forward_only));
  expect_init_writes_only_the_callers_struct<mg_moe_layer_options>(
      mg_moe_layer_options_init_sized, mg_moe_layer_options_init, "mg_moe_layer_options",
      offsetof(mg_moe_layer_options, prequantized_weights));
  // Through the macro: this header's sizeof.
  mg_grouped_linear_options g;
  std::memset(&g, 0xab, sizeof g);
  mg_grouped_linear_options_init(&g);
  EXPECT_EQ(g.struct_size, sizeof g);
  EXPECT_EQ(g.dtype, MG_DTYPE_BF16);
  EXPECT_EQ(g.forward_only, 0);
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
  // The MXFP8 pointers come next, four per weight in the order of moegraph::Mxfp8Weights, then the
  // dequantized values' pointers (a later release) close each struct.
  EXPECT_EQ(offsetof(mg_forward_args, mxfp8_scales_t) + sizeof(void*), offsetof(mg_forward_args, mxfp8_dequantized));
  EXPECT_EQ(offsetof(mg_backward_args, mxfp8_scales_t) + sizeof(void*),
            offsetof(mg_backward_args, mxfp8_dequantized));
  EXPECT_EQ(offsetof(mg_moe_layer_weights, w2_mxfp8_scales_t) + sizeof(void*),
            offsetof(mg_moe_layer_weights, w1_mxfp8_dequantized));
  EXPECT_EQ(offsetof(mg_step_weights, w2_mxfp8_scales_t) + sizeof(void*),
            offsetof(mg_step_weights, w1_mxfp8_dequantized));
}

TEST(CAbiMxfp8, OlderStructsCarryNoDequantizedWeights) {
  expect_older_size_leaves_the_new_fields_null<mg_forward_args>("mg_forward_args",
                                                                offsetof(mg_forward_args, mxfp8_dequantized));
  expect_older_size_leaves_the_new_fields_null<mg_backward_args>("mg_backward_args",
                                                                 offsetof(mg_backward_args, mxfp8_dequantized));
  expect_older_size_leaves_the_new_fields_null<mg_moe_layer_weights>(
      "mg_moe_layer_weights", offsetof(mg_moe_layer_weights, w1_mxfp8_dequantized));
  expect_older_size_leaves_the_new_fields_null<mg_step_weights>("mg_step_weights",
                                                                offsetof(mg_step_weights, w1_mxfp8_dequantized));
  // The tiled scales' pointers (a later release) follow.
  EXPECT_EQ(offsetof(mg_forward_args, mxfp8_dequantized_t) + sizeof(void*),
            offsetof(mg_forward_args, mxfp8_scales_tiled));
  EXPECT_EQ(offsetof(mg_backward_args, mxfp8_dequantized_t) + sizeof(void*),
            offsetof(mg_backward_args, mxfp8_scales_tiled));
  EXPECT_EQ(offsetof(mg_moe_layer_weights, w2_mxfp8_dequantized_t) + sizeof(void*),
            offsetof(mg_moe_layer_weights, w1_mxfp8_scales_tiled));
  EXPECT_EQ(offsetof(mg_step_weights, w2_mxfp8_dequantized_t) + sizeof(void*),
            offsetof(mg_step_weights, w1_mxfp8_scales_tiled));
}

TEST(CAbiMxfp8, OlderStructsCarryNoTiledScales) {
  expect_older_size_leaves_the_new_fields_null<mg_forward_args>("mg_forward_args",
                                                                offsetof(mg_forward_args, mxfp8_scales_tiled));
  expect_older_size_leaves_the_new_fields_null<mg_backward_args>("mg_backward_args",
                                                                 offsetof(mg_backward_args, mxfp8_scales_tiled));
  expect_older_size_leaves_the_new_fields_null<mg_moe_layer_weights>(
      "mg_moe_layer_weights", offsetof(mg_moe_layer_weights, w1_mxfp8_scales_tiled));
  expect_older_size_leaves_the_new_fields_null<mg_step_weights>("mg_step_weights",
                                                                offsetof(mg_step_weights, w1_mxfp8_scales_tiled));
  // In the order of moegraph::Mxfp8Weights (scales_tiled, then scales_t_tiled; w1's, then w2's),
  // closing each struct.
  EXPECT_EQ(offsetof(mg_forward_args, mxfp8_scales_tiled) + sizeof(void*),
            offsetof(mg_forward_args, mxfp8_scales_t_tiled));
  EXPECT_EQ(offsetof(mg_forward_args, mxfp8_scales_t_tiled) + sizeof(void*), sizeof(mg_forward_args));
  EXPECT_EQ(offsetof(mg_backward_args, mxfp8_scales_tiled) + sizeof(void*),
            offsetof(mg_backward_args, mxfp8_scales_t_tiled));
  EXPECT_EQ(offsetof(mg_backward_args, mxfp8_scales_t_tiled) + sizeof(void*), sizeof(mg_backward_args));
  EXPECT_EQ(offsetof(mg_moe_layer_weights, w1_mxfp8_scales_t_tiled) + sizeof(void*),
            offsetof(mg_moe_layer_weights, w2_mxfp8_scales_tiled));
  EXPECT_EQ(offsetof(mg_moe_layer_weights, w2_mxfp8_scales_t_tiled) + sizeof(void*), sizeof(mg_moe_layer_weights));
  EXPECT_EQ(offsetof(mg_step_weights, w1_mxfp8_scales_t_tiled) + sizeof(void*),
            offsetof(mg_step_weights, w2_mxfp8_scales_tiled));
  EXPECT_EQ(offsetof(mg_step_weights, w2_mxfp8_scales_t_tiled) + sizeof(void*), sizeof(mg_step_weights));
}

TEST(CAbiMxfp8, TiledScaleBytesFollowTheCppApi) {
  struct Shape {
    int groups;
    int64_t n, k;
  };
  for (const Shape& z : {Shape{1, 32, 32}, Shape{3, 96, 160}, Shape{64, 2816, 4096}, Shape{7, 200 * 32, 33 * 32}}) {
    SCOPED_TRACE(detail::concat(z.groups, " x ", z.n, " x ", z.k));
    size_t bytes = 1;
    ASSERT_EQ(mg_mxfp8_tiled_scale_bytes(z.groups, z.n, z.k, &bytes), MG_OK) << mg_last_error();
    EXPECT_EQ(bytes, mxfp8_tiled_scale_bytes(z.groups, z.n, z.k));
    EXPECT_EQ(bytes, 512u * z.groups * static_cast<size_t>((z.n + 127) / 128) * static_cast<size_t>((z.k + 127) / 128));
  }
  // Refused as the C++ API refuses, with its words, and the size left 0.
  for (const Shape& bad : {Shape{0, 32, 32}, Shape{1, 48, 32}, Shape{1, 32, int64_t{1} << 22}}) {
    size_t bytes = 1;
    EXPECT_EQ(mg_mxfp8_tiled_scale_bytes(bad.groups, bad.n, bad.k, &bytes), MG_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(bytes, 0u);
    EXPECT_EQ(std::string(mg_last_error()),
              test::thrown_what([&] { (void)mxfp8_tiled_scale_bytes(bad.groups, bad.n, bad.k); }));
  }
  EXPECT_EQ(mg_mxfp8_tiled_scale_bytes(1, 32, 32, nullptr), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("mg_mxfp8_tiled_scale_bytes needs its output")) << mg_last_error();
}

// mg_tile_mxfp8_weight_scales refuses what the C++ call refuses, with the same words, before any GPU use.
TEST(CAbiMxfp8, ScaleTilerRefusesBadArgumentsBeforeAnyGpuUse) {
  alignas(16) static uint8_t fake[64];
  uint8_t* const p = fake;
  struct Case {
    const char* name;
    int groups;
    uint8_t *data, *scales, *data_t, *scales_t, *tiled, *tiled_t;
    const char* expected;
  };
  const Case cases[] = {
      {"groups", 0, p, p, p, p, p, p, "MXFP8 weights: groups must be in [1, 1024], got 0"},
      {"nothing to write", 1, p, p, p, p, nullptr, nullptr, "tile_mxfp8_weight_scales: nothing to write"},
      {"tiled without its pair", 1, nullptr, nullptr, p, p, p, nullptr,
       "tile_mxfp8_weight_scales: scales_tiled needs data and scales"},
      {"tiled_t without its pair", 1, p, p, nullptr, nullptr, nullptr, p,
       "tile_mxfp8_weight_scales: scales_t_tiled needs data_t and scales_t"},
      {"tiled misaligned", 1, p, p, nullptr, nullptr, p + 4, nullptr,
       "tile_mxfp8_weight_scales: the tiled scales must be 16-byte aligned"},
      {"scales alone", 1, nullptr, p, nullptr, nullptr, p, nullptr, "MXFP8 weights: data and its scales come together"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(mg_tile_mxfp8_weight_scales(c.groups, 32, 64, c.data, c.scales, c.data_t, c.scales_t, c.tiled,
                                          c.tiled_t, nullptr),
              MG_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(last_error_has(c.expected)) << mg_last_error();
    Mxfp8Weights w{c.data, c.scales, c.data_t, c.scales_t};
    w.scales_tiled = c.tiled, w.scales_t_tiled = c.tiled_t;
    EXPECT_EQ(std::string(mg_last_error()),
              test::thrown_what([&] { tile_mxfp8_weight_scales(c.groups, 32, 64, w, nullptr); }));
  }
}

// dequantized_weights through the C options (off by default: the test above): refused as the C++
// API refuses it, and not read from an older caller's struct, whatever its memory holds there
// (including the previous release's tail padding, which the 64-bit field of
// mg_grouped_linear_options skips).
TEST(CAbiMxfp8, DequantizedWeightsOptionFollowsTheCppApi) {
  EXPECT_GE(offsetof(mg_grouped_linear_options, dequantized_weights),
            offsetof(mg_grouped_linear_options, prequantized_weights) + sizeof(int64_t))
      << "past the previous release's sizeof";
  mg_grouped_linear_options g = small_linear();
  size_t want = 0, got = 1;
  ASSERT_EQ(mg_grouped_linear_workspace_bytes(&g, &want), MG_OK) << mg_last_error();
  g.dequantized_weights = 1;
  EXPECT_EQ(mg_grouped_linear_workspace_bytes(&g, &got), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("dequantized_weights needs the mxfp8 recipe with bf16 activations")) << mg_last_error();
  GroupedLinearOptions cg;
  cg.num_groups = g.num_groups, cg.in_features = g.in_features, cg.out_features = g.out_features;
  cg.capacity_rows = g.capacity_rows, cg.row_align = g.row_align, cg.bias = g.bias != 0;
  cg.dequantized_weights = true;
  EXPECT_EQ(std::string(mg_last_error()), test::thrown_what([&] { validate(cg); }));
  std::memset(reinterpret_cast<unsigned char*>(&g) + offsetof(mg_grouped_linear_options, prequantized_weights) + 4,
              0x5a, offsetof(mg_grouped_linear_options, dequantized_weights) -
                        offsetof(mg_grouped_linear_options, prequantized_weights) - 4);
  g.struct_size = offsetof(mg_grouped_linear_options, dequantized_weights);
  ASSERT_EQ(mg_grouped_linear_workspace_bytes(&g, &got), MG_OK) << mg_last_error();
  EXPECT_EQ(got, want);
  g.struct_size = sizeof g, g.dequantized_weights = 1, g.recipe = MG_RECIPE_MXFP8;
  g.in_features = 128, g.out_features = 256, g.row_align = 32, g.capacity_rows = 256;
  ASSERT_EQ(mg_grouped_linear_workspace_bytes(&g, &got), MG_OK) << mg_last_error();

  mg_moe_layer_options m = small_moe();
  m.dequantized_weights = 1;
  size_t bytes = 0;
  EXPECT_EQ(mg_moe_layer_workspace_bytes(&m, &bytes), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("dequantized_weights needs the mxfp8 recipe with bf16 activations")) << mg_last_error();
  m.struct_size = offsetof(mg_moe_layer_options, dequantized_weights);
  EXPECT_EQ(mg_moe_layer_workspace_bytes(&m, &bytes), MG_OK) << mg_last_error();
}

// mg_dequantize_mxfp8_weights refuses what the C++ call refuses, with the same words, before any GPU use.
TEST(CAbiMxfp8, DequantizerRefusesBadArgumentsBeforeAnyGpuUse) {
  alignas(16) static uint8_t fake[64];
  uint8_t* const p = fake;
  struct Case {
    const char* name;
    int groups;
    uint8_t *data, *scales, *data_t, *scales_t;
    void *values, *values_t;
    const char* expected;
  };
  const Case cases[] = {
      {"groups", 0, p, p, p, p, p, p, "MXFP8 weights: groups must be in [1, 1024], got 0"},
      {"nothing to write", 1, p, p, p, p, nullptr, nullptr, "dequantize_mxfp8_weights: nothing to write"},
      {"values without data", 1, nullptr, nullptr, p, p, p, nullptr,
       "dequantize_mxfp8_weights: dequantized needs data and scales"},
      {"values_t without data_t", 1, p, p, nullptr, nullptr, nullptr, p,
       "dequantize_mxfp8_weights: dequantized_t needs data_t and scales_t"},
      {"values misaligned", 1, p, p, nullptr, nullptr, p + 4, nullptr,
       "dequantize_mxfp8_weights: the dequantized copies must be 16-byte aligned"},
      {"scales alone", 1, nullptr, p, nullptr, nullptr, p, nullptr, "MXFP8 weights: data and its scales come together"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(mg_dequantize_mxfp8_weights(c.groups, 32, 64, c.data, c.scales, c.data_t, c.scales_t, c.values,
                                          c.values_t, nullptr),
              MG_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(last_error_has(c.expected)) << mg_last_error();
    const Mxfp8Weights w{c.data, c.scales, c.data_t, c.scales_t, c.values, c.values_t};
    EXPECT_EQ(std::string(mg_last_error()),
              test::thrown_what([&] { dequantize_mxfp8_weights(c.groups, 32, 64, w, nullptr); }));
  }
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

// Each tiled-scales pointer of the weight structs reaches its own C++ field: a misaligned one is
// refused when the step or the layer is made, before any device is looked for, naming that field.
TEST(CAbiMxfp8, WeightStructsCarryEachTiledScalesPointer) {
  alignas(16) static uint8_t fake[32];
  uint8_t* const misaligned = fake + 4;
  mg_config* c = nullptr;
  ASSERT_EQ(mg_config_parse(kPrequantizedConfig, &c), MG_OK) << mg_last_error();
  mg_step_weights w = sized<mg_step_weights>();
  for (uint8_t* mg_step_weights::*f :
       {&mg_step_weights::w1_mxfp8_data, &mg_step_weights::w1_mxfp8_scales, &mg_step_weights::w1_mxfp8_data_t,
        &mg_step_weights::w1_mxfp8_scales_t, &mg_step_weights::w2_mxfp8_data, &mg_step_weights::w2_mxfp8_scales,
        &mg_step_weights::w2_mxfp8_data_t, &mg_step_weights::w2_mxfp8_scales_t})
    w.*f = fake;
  const std::pair<uint8_t* mg_step_weights::*, const char*> step_fields[] = {
      {&mg_step_weights::w1_mxfp8_scales_tiled, "w1_mxfp8.scales_tiled"},
      {&mg_step_weights::w1_mxfp8_scales_t_tiled, "w1_mxfp8.scales_t_tiled"},
      {&mg_step_weights::w2_mxfp8_scales_tiled, "w2_mxfp8.scales_tiled"},
      {&mg_step_weights::w2_mxfp8_scales_t_tiled, "w2_mxfp8.scales_t_tiled"},
  };
  for (const auto& [field, name] : step_fields) {
    SCOPED_TRACE(name);
    w.*field = misaligned;
    mg_step_graphs* step = reinterpret_cast<mg_step_graphs*>(0x1);
    EXPECT_EQ(mg_step_graphs_create(c, &w, nullptr, &step), MG_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(last_error_has(detail::concat("StepWeights needs ", name, " 16-byte aligned (or null)")))
        << mg_last_error();
    EXPECT_EQ(step, nullptr);
    w.*field = fake;
  }
  // All four aligned: the check goes on to the next weight.
  mg_step_graphs* step = nullptr;
  EXPECT_EQ(mg_step_graphs_create(c, &w, nullptr, &step), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("StepWeights needs the router weight for the whole-layer step")) << mg_last_error();
  // An older caller's size ends before them: they are not read.
  w.w1_mxfp8_scales_tiled = misaligned;
  w.struct_size = offsetof(mg_step_weights, w1_mxfp8_scales_tiled);
  EXPECT_EQ(mg_step_graphs_create(c, &w, nullptr, &step), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("StepWeights needs the router weight for the whole-layer step")) << mg_last_error();
  mg_config_destroy(c);

  mg_moe_layer_options m = small_moe();
  m.recipe = MG_RECIPE_MXFP8, m.row_align = 32, m.prequantized_weights = 1;
  mg_moe_layer_weights lw = sized<mg_moe_layer_weights>();
  lw.router = fake;
  for (const uint8_t* mg_moe_layer_weights::*f :
       {&mg_moe_layer_weights::w1_mxfp8_data, &mg_moe_layer_weights::w1_mxfp8_scales,
        &mg_moe_layer_weights::w1_mxfp8_data_t, &mg_moe_layer_weights::w1_mxfp8_scales_t,
        &mg_moe_layer_weights::w2_mxfp8_data, &mg_moe_layer_weights::w2_mxfp8_scales,
        &mg_moe_layer_weights::w2_mxfp8_data_t, &mg_moe_layer_weights::w2_mxfp8_scales_t})
    lw.*f = fake;
  const std::pair<const uint8_t* mg_moe_layer_weights::*, const char*> layer_fields[] = {
      {&mg_moe_layer_weights::w1_mxfp8_scales_tiled, "w1_mxfp8.scales_tiled"},
      {&mg_moe_layer_weights::w1_mxfp8_scales_t_tiled, "w1_mxfp8.scales_t_tiled"},
      {&mg_moe_layer_weights::w2_mxfp8_scales_tiled, "w2_mxfp8.scales_tiled"},
      {&mg_moe_layer_weights::w2_mxfp8_scales_t_tiled, "w2_mxfp8.scales_t_tiled"},
  };
  for (const auto& [field, name] : layer_fields) {
    SCOPED_TRACE(name);
    lw.*field = misaligned;
    mg_moe_layer* layer = reinterpret_cast<mg_moe_layer*>(0x1);
    EXPECT_EQ(mg_moe_layer_create(&m, &lw, nullptr, &layer), MG_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(last_error_has(detail::concat("MoeLayerWeights needs ", name, " 16-byte aligned (or null)")))
        << mg_last_error();
    EXPECT_EQ(layer, nullptr);
    lw.*field = fake;
  }
}

// With precision.dequantized_weights as well, the config shape says so and each dequantized pointer
// of mg_step_weights reaches its StepWeights field (the check names the weight still missing one).
TEST(CAbiMxfp8, StepWeightsCarryEachDequantizedPointer) {
  mg_config* c = nullptr;
  ASSERT_EQ(mg_config_parse(R"({"layer": {"experts": 8, "hidden": 256, "ffn": 256, "top_k": 2},
                                "precision": {"recipe": "mxfp8", "prequantized_weights": true,
                                              "dequantized_weights": true},
                                "row_align": 32, "buckets": [64]})",
                            &c),
            MG_OK)
      << mg_last_error();
  mg_config_shape shape = sized<mg_config_shape>();
  ASSERT_EQ(mg_config_shape_of(c, &shape), MG_OK) << mg_last_error();
  EXPECT_EQ(shape.dequantized_weights, 1);
  EXPECT_EQ(shape.prequantized_weights, 1);
  alignas(16) static uint8_t fake[16];
  mg_step_weights w = sized<mg_step_weights>();
  for (uint8_t* mg_step_weights::*f :
       {&mg_step_weights::w1_mxfp8_data, &mg_step_weights::w1_mxfp8_scales, &mg_step_weights::w1_mxfp8_data_t,
        &mg_step_weights::w1_mxfp8_scales_t, &mg_step_weights::w2_mxfp8_data, &mg_step_weights::w2_mxfp8_scales,
        &mg_step_weights::w2_mxfp8_data_t, &mg_step_weights::w2_mxfp8_scales_t})
    w.*f = fake;
  // Each field set in turn, the _t one of a weight first: the message names the field still missing,
  // so a field read into its twin's place would show.
  const std::pair<void* mg_step_weights::*, const char*> fields[] = {
      {&mg_step_weights::w1_mxfp8_dequantized_t, "StepWeights needs w1_mxfp8.dequantized ("},
      {&mg_step_weights::w1_mxfp8_dequantized, "StepWeights needs w2_mxfp8.dequantized ("},
      {&mg_step_weights::w2_mxfp8_dequantized, "StepWeights needs w2_mxfp8.dequantized_t for training"},
      {&mg_step_weights::w2_mxfp8_dequantized_t, "StepWeights needs the router weight for the whole-layer step"},
  };
  mg_step_graphs* step = reinterpret_cast<mg_step_graphs*>(0x1);
  EXPECT_EQ(mg_step_graphs_create(c, &w, nullptr, &step), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("StepWeights needs w1_mxfp8.dequantized (")) << mg_last_error();
  w.w1_mxfp8_dequantized = fake;
  EXPECT_EQ(mg_step_graphs_create(c, &w, nullptr, &step), MG_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_has("StepWeights needs w1_mxfp8.dequantized_t for training")) << mg_last_error();
  w.w1_mxfp8_dequantized = nullptr;
  for (const auto& [field, then_missing] : fields) {
    w.*field = fake;
    EXPECT_EQ(mg_step_graphs_create(c, &w, nullptr, &step), MG_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(last_error_has(then_missing)) << mg_last_error();
  }
  mg_config_destroy(c);
}

}  // namespace
}  // namespace moegraph
