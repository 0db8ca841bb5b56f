// Set-up errors: unsupported shapes are refused before any GPU work, naming field, value and rule.
#include <gtest/gtest.h>

#include "moegraph/error.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/moegraph.h"

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
        BadCase{"no_groups", [](auto& o) { o.num_groups = 0; }, "num_groups must be in [1, 1024], got 0"},
        BadCase{"too_many_groups", [](auto& o) { o.num_groups = 4096; }, "num_groups must be in [1, 1024], got 4096"},
        BadCase{"bad_align", [](auto& o) { o.row_align = 8; }, "row_align must be 1, 16, 32 or 128, got 8"},
        BadCase{"capacity_not_aligned", [](auto& o) { o.row_align = 128; o.capacity_rows = 1000; },
                "capacity_rows must be a multiple of row_align (128), got 1000"},
        BadCase{"no_capacity", [](auto& o) { o.capacity_rows = 0; }, "capacity_rows must be at least 1, got 0"},
        BadCase{"fp32_activations", [](auto& o) { o.dtype = DType::kFP32; }, "dtype must be bf16 or fp16, got fp32"},
        BadCase{"no_slots", [](auto& o) { o.wgrad_slots = 0; }, "wgrad_slots must be in [1, 64], got 0"},
        BadCase{"bad_tile", [](auto& o) { o.tile_n = 64; }, "tile_n must be 0 (automatic), 128 or 256, got 64"}),
    [](const auto& info) { return info.param.name; });

TEST(Validation, ErrorCarriesFileAndLine) {
  GroupedLinearOptions o = good();
  o.in_features = 7;
  try {
    validate(o);
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_GT(e.line(), 0);
    EXPECT_NE(std::string(e.file()).find("shape_rules.cpp"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("shape_rules.cpp:"), std::string::npos);
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
  EXPECT_EQ(mg_grouped_linear_create(&o, &op), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(op, nullptr);
  EXPECT_NE(std::string(mg_last_error()).find("in_features (K) must be a positive multiple of 16, got 100"),
            std::string::npos)
      << mg_last_error();
  EXPECT_EQ(mg_grouped_linear_create(nullptr, &op), MG_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(mg_grouped_linear_backward_dw(nullptr, nullptr), MG_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(mg_last_error()).find("null mg_grouped_linear handle"), std::string::npos);
}

}  // namespace
}  // namespace moegraph
