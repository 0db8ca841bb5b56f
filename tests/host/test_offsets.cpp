// The host mirror of the device offset scan and its validation (the device kernel is checked
// against the same expectations in the GPU suite).
#include <gtest/gtest.h>

#include "src/ops/group_layout.hpp"

namespace moegraph {
namespace {

TEST(HostOffsets, ExclusiveScanWithoutAlignment) {
  const std::vector<int32_t> splits{3, 0, 5, 1};
  const HostOffsets h = host_group_offsets(splits, 1, 100);
  EXPECT_EQ(h.offsets, (std::vector<int64_t>{0, 3, 3, 8, 9}));
  EXPECT_EQ(h.error.code, 0);
}

TEST(HostOffsets, RowAlignRoundsEachGroupUp) {
  const std::vector<int32_t> splits{3, 0, 33, 32};
  const HostOffsets h = host_group_offsets(splits, 32, 1024);
  EXPECT_EQ(h.offsets, (std::vector<int64_t>{0, 32, 32, 96, 128}));
}

TEST(HostOffsets, ExactlyFullCapacityIsValid) {
  const std::vector<int32_t> splits{16, 16};
  const HostOffsets h = host_group_offsets(splits, 16, 32);
  EXPECT_EQ(h.error.code, 0);
  EXPECT_EQ(h.offsets.back(), 32);
}

TEST(HostOffsets, NegativeSplitRaisesCodeOneAndCountsAsEmpty) {
  const std::vector<int32_t> splits{4, -2, 4};
  const HostOffsets h = host_group_offsets(splits, 1, 100);
  EXPECT_EQ(h.error.code, 1);
  EXPECT_EQ(h.error.group, 1);
  EXPECT_EQ(h.error.value, -2);
  EXPECT_EQ(h.offsets, (std::vector<int64_t>{0, 4, 4, 8}));
  EXPECT_EQ(describe_device_error(h.error, 1), "splits[1] = -2 is negative");
}

TEST(HostOffsets, OverflowRaisesCodeTwoAndClampsOffsets) {
  const std::vector<int32_t> splits{10, 10, 10};
  const HostOffsets h = host_group_offsets(splits, 1, 25);
  EXPECT_EQ(h.error.code, 2);
  EXPECT_EQ(h.error.group, 2);
  EXPECT_EQ(h.error.value, 30);
  EXPECT_EQ(h.error.limit, 25);
  EXPECT_EQ(h.offsets, (std::vector<int64_t>{0, 10, 20, 25}));
  EXPECT_NE(describe_device_error(h.error, 1).find("splits need 30 rows"), std::string::npos);
}

// The record a gathered input's bad map entry raises (kernels/quantize: launch_quantize_mxfp8_gathered)
// reads as the row, its entry and the bound; every code has its own message.
TEST(HostOffsets, EveryDeviceErrorCodeIsDescribed) {
  const DeviceErrorRecord source{kDeviceErrorSourceRow, 71, 90, 90};
  EXPECT_EQ(describe_device_error(source, 32), "x_rows[71] = 90 names no row of x (x_rows_bound 90); the row was read as zeros");
  EXPECT_EQ(describe_device_error(DeviceErrorRecord{}, 1), "");
  for (int32_t code = kDeviceErrorNegativeSplit; code <= kDeviceErrorSourceRow; ++code)
    EXPECT_EQ(describe_device_error(DeviceErrorRecord{code, 1, 2, 3}, 1).find("unknown"), std::string::npos) << code;
  EXPECT_NE(describe_device_error(DeviceErrorRecord{kDeviceErrorSourceRow + 1, 0, 0, 0}, 1).find("unknown"),
            std::string::npos);
}

TEST(HostOffsets, AlignmentPaddingCanOverflow) {
  const std::vector<int32_t> splits{1, 1, 1};  // 3 rows of data, 384 aligned rows
  const HostOffsets h = host_group_offsets(splits, 128, 256);
  EXPECT_EQ(h.error.code, 2);
  EXPECT_EQ(h.error.value, 384);
}

TEST(HostOffsets, FirstErrorWins) {
  const std::vector<int32_t> splits{-1, 1000};
  const HostOffsets h = host_group_offsets(splits, 1, 10);
  EXPECT_EQ(h.error.code, 1);
}

}  // namespace
}  // namespace moegraph
