// A group layout planned once: GroupedLinear given precomputed offsets (as the dispatch hands
// them to FC1 and FC2) gives bit-identical results to computing them itself, in every phase and
// recipe, with the delayed wgrad reading the caller's layout after the caller's inputs changed;
// and describe() prints the kernels --plan names.
#include <gtest/gtest.h>

#include <cstring>

#include "kernels/routing/offsets.hpp"
#include "tests/common/expect.hpp"

namespace moegraph::test {
namespace {

// Bits, not values: rows no kernel writes keep their NaN poison, and NaN != NaN.
struct Outputs {
  std::vector<uint16_t> y, dx, dw;
  std::vector<uint32_t> ds;
};

std::vector<uint32_t> bits_of(const std::vector<float>& v) {
  std::vector<uint32_t> out(v.size());
  std::memcpy(out.data(), v.data(), v.size() * sizeof(float));
  return out;
}

Outputs run_step(Problem& p, const int64_t* offsets, cudaStream_t stream) {
  p.poison_outputs();
  ForwardArgs f = p.forward_args();
  f.offsets = offsets;
  p.op->forward_train(f, stream);
  p.op->backward(p.backward_args(), WgradMode::kDelayed, stream);
  const auto x = p.d_x.download();
  p.d_x.poison();  // the delayed wgrad reads only what the slot (and the caller's layout) kept
  p.op->backward_dw(stream);
  p.op->check_device_errors(stream);
  p.d_x.upload(x);
  return {p.d_y.download(), p.d_dx.download(), p.d_dw.download(), bits_of(p.d_ds.download())};
}

class PrecomputedOffsets : public ::testing::TestWithParam<Recipe> {};

TEST_P(PrecomputedOffsets, AreBitIdenticalToTheOperatorsOwn) {
  const Recipe recipe = GetParam();
  CaseSpec spec{std::string("precomputed_offsets_") + std::string(recipe_name(recipe)), 8, 256, 384,
                DType::kBF16, 32, {}, 1500, Routing::kSkewed, 64, true, true, false, true};
  spec.recipe = recipe;
  Problem p(spec, test_seed(spec.name));
  cudaStream_t stream = nullptr;
  DeviceArray<int64_t> offsets(spec.groups + 1);
  DeviceArray<DeviceErrorRecord> error(1);
  testing::memset_and_wait(error.get(), 0, sizeof(DeviceErrorRecord));
  for (int routing = 0; routing < 3; ++routing) {
    p.reroute_random();
    const Outputs own = run_step(p, nullptr, stream);
    expect_matches_reference(p, OutputSet::kForward, "own offsets");
    kernels::launch_group_offsets(p.d_splits.get(), spec.groups, spec.row_align, p.layout.capacity_rows,
                                  offsets.get(), error.get(), stream);
    const Outputs given = run_step(p, offsets.get(), stream);
    expect_matches_reference(p, OutputSet::kWgrad, "given offsets");
    EXPECT_TRUE(own.y == given.y) << "y, routing " << routing;
    EXPECT_TRUE(own.dx == given.dx) << "dx, routing " << routing;
    EXPECT_TRUE(own.dw == given.dw) << "dweight, routing " << routing;
    EXPECT_TRUE(own.ds == given.ds) << "dbias_scale, routing " << routing;
  }
  EXPECT_EQ(error.download()[0].code, kDeviceErrorNone);
  // The kernels set-up chose are the ones the plan (no GPU) names.
  const std::string kernels = GroupedLinear::describe_kernels(p.op->options());
  EXPECT_NE(p.op->describe().find(kernels), std::string::npos) << p.op->describe() << "\n" << kernels;
}

INSTANTIATE_TEST_SUITE_P(Recipes, PrecomputedOffsets, ::testing::Values(Recipe::kBF16, Recipe::kMXFP8),
                         [](const auto& info) { return std::string(recipe_name(info.param)); });

}  // namespace
}  // namespace moegraph::test
