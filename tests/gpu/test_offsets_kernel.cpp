// The device offset scan against its host mirror, across the block-scan chunk boundaries
// (256 groups per chunk) and every row_align, for valid and invalid splits.
#include <gtest/gtest.h>

#include "kernels/routing/offsets.hpp"
#include "src/ops/group_layout.hpp"
#include "testing/device_array.hpp"
#include "tests/common/expect.hpp"

namespace moegraph::test {
namespace {

struct OffsetsCase {
  int groups;
  int row_align;
  int corrupt;  // 0: valid; 1: one negative split; 2: total past capacity
};

class DeviceOffsets : public ::testing::TestWithParam<OffsetsCase> {};

TEST_P(DeviceOffsets, MatchHostMirror) {
  const auto [groups, align, corrupt] = GetParam();
  std::mt19937_64 rng(test_seed(detail::concat("offsets_", groups, "_", align)));
  std::vector<int32_t> splits = random_splits(rng, groups, 40 * groups, Routing::kSkewed);
  const int64_t capacity = 40 * groups + int64_t{groups} * align;
  if (corrupt == 1) splits[groups * 2 / 3] = -5;
  if (corrupt == 2) splits[groups / 2] += static_cast<int32_t>(capacity);
  const HostOffsets expected = host_group_offsets(splits, align, capacity);

  DeviceArray<int32_t> d_splits(groups);
  DeviceArray<int64_t> d_offsets(groups + 1);
  DeviceArray<DeviceErrorRecord> d_error(1);
  d_splits.upload(splits);
  d_offsets.poison();
  testing::memset_and_wait(d_error.get(), 0, sizeof(DeviceErrorRecord));
  kernels::launch_group_offsets(d_splits.get(), groups, align, capacity, d_offsets.get(), d_error.get(), nullptr);
  MG_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(d_offsets.download(), expected.offsets);
  const DeviceErrorRecord got = d_error.download()[0];
  EXPECT_EQ(got.code, expected.error.code);
  EXPECT_EQ(got.group, expected.error.group);
  EXPECT_EQ(got.value, expected.error.value);
  EXPECT_EQ(got.limit, expected.error.limit);
  EXPECT_EQ(got.code != 0, corrupt != 0);
}

std::vector<OffsetsCase> offsets_cases() {
  std::vector<OffsetsCase> out;
  for (int g : {1, 255, 256, 257, 600, 1024})
    for (int align : {1, 16, 32, 128})
      for (int corrupt : {0, 1, 2}) out.push_back({g, align, corrupt});
  return out;
}

std::string offsets_case_name(const ::testing::TestParamInfo<OffsetsCase>& info) {
  static const char* const what[] = {"valid", "negative", "overflow"};
  return detail::concat("g", info.param.groups, "_align", info.param.row_align, "_", what[info.param.corrupt]);
}

INSTANTIATE_TEST_SUITE_P(Groups, DeviceOffsets, ::testing::ValuesIn(offsets_cases()), offsets_case_name);

}  // namespace
}  // namespace moegraph::test
