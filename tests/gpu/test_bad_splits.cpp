// Invalid device splits raise the device error record; the host reports group and value, clears
// the record, and nothing outside the buffers is written.
#include <gtest/gtest.h>

#include "moegraph/moegraph.h"
#include "tests/common/expect.hpp"

namespace moegraph::test {
namespace {

std::string device_error_after_forward(Problem& p, const std::vector<int32_t>& splits) {
  p.d_splits.upload(splits);
  p.op->forward(p.forward_args(), nullptr);
  try {
    p.op->check_device_errors(nullptr);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kDeviceSplits);
    return e.message();
  }
  return {};
}

TEST(BadSplits, NegativeSplitIsReportedWithGroupAndValue) {
  CaseSpec spec{"bad_negative", 4, 128, 128, DType::kBF16, 1, {10, 10, 10, 10}, 0, Routing::kUniform, 0};
  Problem p(spec, test_seed(spec.name));
  const std::string msg = device_error_after_forward(p, {10, 5, -3, 10});
  EXPECT_NE(msg.find("splits[2] = -3 is negative"), std::string::npos) << msg;
  EXPECT_NO_THROW(p.op->check_device_errors(nullptr)) << "the record is cleared once reported";
}

TEST(BadSplits, TotalPastCapacityIsReported) {
  CaseSpec spec{"bad_overflow", 4, 128, 128, DType::kBF16, 1, {10, 10, 10, 10}, 0, Routing::kUniform, 0};
  Problem p(spec, test_seed(spec.name));  // capacity is exactly 40 rows
  // scripts/gpu-suite runs this file under compute-sanitizer: clamped offsets keep writes inside.
  const std::string msg = device_error_after_forward(p, {10, 25, 10, 10});
  EXPECT_NE(msg.find("splits need 55 rows"), std::string::npos) << msg;
  EXPECT_NE(msg.find("capacity_rows is 40"), std::string::npos) << msg;
  EXPECT_NE(msg.find("at group 2"), std::string::npos) << msg;
}

TEST(BadSplits, AlignedTotalPastCapacityIsReported) {
  CaseSpec spec{"bad_aligned_overflow", 4, 128, 128, DType::kBF16, 32, {32, 32, 32, 32}, 0, Routing::kUniform, 0};
  Problem p(spec, test_seed(spec.name));
  ASSERT_EQ(p.layout.capacity_rows, 256);  // 128 rows in the worst layout at row_align 32
  EXPECT_EQ(device_error_after_forward(p, {129, 1, 1, 1}), "") << "160 + 3 * 32 aligned rows fill 256 exactly";
  // 164 rows of data, but 192 + 3 * 32 = 288 aligned rows: the padding is what overflows.
  const std::string msg = device_error_after_forward(p, {161, 1, 1, 1});
  EXPECT_NE(msg.find("splits need 288 rows (row_align 32) but capacity_rows is 256"), std::string::npos) << msg;
  EXPECT_NE(msg.find("at group 3"), std::string::npos) << msg;
}

TEST(BadSplits, ValidSplitsAfterAnErrorWorkAgain) {
  CaseSpec spec{"bad_then_good", 4, 128, 128, DType::kBF16, 1, {10, 10, 10, 10}, 0, Routing::kUniform, 0};
  Problem p(spec, test_seed(spec.name));
  EXPECT_FALSE(device_error_after_forward(p, {-1, 0, 0, 0}).empty());
  p.reroute({10, 10, 10, 10});
  p.poison_outputs();
  p.op->forward(p.forward_args(), nullptr);
  p.op->check_device_errors(nullptr);
  expect_matches_reference(p, OutputSet::kForward, "after error");
}

TEST(BadSplits, CAbiReportsDeviceSplitsStatus) {
  mg_grouped_linear_options o;
  mg_grouped_linear_options_init(&o);
  o.num_groups = 2;
  o.in_features = 64;
  o.out_features = 64;
  o.capacity_rows = 16;
  mg_grouped_linear* op = nullptr;
  ASSERT_EQ(mg_grouped_linear_create(&o, nullptr, &op), MG_OK) << mg_last_error();
  DeviceArray<int32_t> splits(2);
  splits.upload({-7, 3});
  DeviceArray<uint16_t> x(16 * 64), w(2 * 64 * 64), y(16 * 64);
  x.poison();
  w.poison();
  mg_forward_args a{};
  a.struct_size = sizeof a, a.x = x.get(), a.splits = splits.get(), a.weight = w.get(), a.y = y.get();
  EXPECT_EQ(mg_grouped_linear_forward(op, &a, 0, nullptr), MG_OK) << mg_last_error();
  EXPECT_EQ(mg_grouped_linear_check_device_errors(op, nullptr), MG_ERR_DEVICE_SPLITS);
  EXPECT_NE(std::string(mg_last_error()).find("splits[0] = -7"), std::string::npos) << mg_last_error();
  EXPECT_EQ(mg_grouped_linear_backward_dw(op, nullptr), MG_ERR_INVALID_ARGUMENT);
  mg_grouped_linear_destroy(op);
}

}  // namespace
}  // namespace moegraph::test
