// The fp64 reference and the test helpers themselves, on hand-computed examples.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "tests/common/expect.hpp"

namespace moegraph::test {
namespace {

// Two groups: rows 0-1 in group 0, row 2 in group 1 (K = 2, N = 1).
GroupLayout tiny() { return make_layout({2, 1}, 1, 4); }

TEST(Reference, FpropWithBiasAndScale) {
  const GroupLayout l = tiny();
  const Mat x{1, 2, 3, 4, 5, 6, 9, 9};  // row 3 is padding
  const Mat w{10, 1, -1, 2};          // W_0 = [10 1], W_1 = [-1 2]
  const Mat b{100, 1000};
  const Mat s{1, 2, 3, 7};
  const Mat y = ref_fprop(l, x, w, b, s, 1, 2);
  EXPECT_EQ(y, (Mat{112, 234, 3007, 0}));
}

TEST(Reference, DgradWgradAndBiasGrads) {
  const GroupLayout l = tiny();
  const Mat dy{1, 2, 3, 0};
  const Mat w{10, 1, -1, 2};
  EXPECT_EQ(ref_dgrad(l, dy, w, 1, 2), (Mat{10, 1, 20, 2, -3, 6, 0, 0}));
  const Mat x{1, 2, 3, 4, 5, 6, 0, 0};
  EXPECT_EQ(ref_wgrad(l, dy, x, 1, 2), (Mat{7, 10, 15, 18}));
  EXPECT_EQ(ref_bias_grad(l, dy, Mat{1, 2, 3, 0}, 1), (Mat{5, 9}));
  EXPECT_EQ(ref_scale_grad(l, dy, Mat{100, 1000}, 1), (Mat{100, 200, 3000, 0}));
}

TEST(Reference, AlignedLayoutLeavesGapRowsOutOfData) {
  const GroupLayout l = make_layout({1, 2}, 16, 64);
  EXPECT_EQ(l.offsets, (std::vector<int64_t>{0, 16, 32}));
  const auto data = data_rows(l), written = written_rows(l);
  EXPECT_TRUE(data[0]);
  EXPECT_FALSE(data[1]);
  EXPECT_TRUE(written[1]);  // gap rows are written as zeros
  EXPECT_TRUE(data[17]);
  EXPECT_FALSE(data[18]);
  EXPECT_FALSE(written[40]);
}

TEST(Rounding, Bf16RoundsToNearestEven) {
  EXPECT_EQ(to_bits(1.0, DType::kBF16), 0x3f80);
  EXPECT_EQ(round_to(1.0 + 1.0 / 256, DType::kBF16), 1.0);              // halfway: to even
  EXPECT_EQ(round_to(1.0 + 3.0 / 256, DType::kBF16), 1.0 + 4.0 / 256);  // halfway: to even
  EXPECT_EQ(round_to(1.0 + 1.5 / 256, DType::kBF16), 1.0 + 2.0 / 256);
  EXPECT_EQ(round_to(1.0 + 1.0 / 2048, DType::kFP16), 1.0);
}

TEST(Compare, DetectsWrongValuesAndNaN) {
  const Mat ref{1, 2, 3, 4};
  EXPECT_TRUE(passed(all_close("same", ref, ref, 2, {}, tolerance_for(DType::kBF16))));
  EXPECT_FALSE(passed(all_close("off", Mat{1, 2, 3, 4.2}, ref, 2, {}, tolerance_for(DType::kBF16))));
  EXPECT_FALSE(passed(all_close("nan", Mat{1, 2, 3, std::nan("")}, ref, 2, {}, tolerance_for(DType::kBF16))));
  EXPECT_TRUE(passed(all_close("masked", Mat{1, 2, 99, 99}, ref, 2, {true, false}, tolerance_for(DType::kBF16))));
}

// The result carries what moegraph-check prints and the gtest adapter reports.
TEST(Compare, ResultCountsBadElementsAndError) {
  const Mat ref{1, 2, 3, 4};
  const CompareResult off = all_close("dx", Mat{1, 2, 3, 4.2}, ref, 2, {}, tolerance_for(DType::kBF16));
  EXPECT_FALSE(off.ok);
  EXPECT_EQ(off.out_of_tolerance, 1u);
  EXPECT_EQ(off.compared, 4u);
  EXPECT_NEAR(off.rel_fro, 0.2 / std::sqrt(30.0), 1e-12);
  EXPECT_EQ(off.message.rfind("dx: 1 of 4 elements out of tolerance (first at row 1 col 1", 0), 0u) << off.message;
  const CompareResult masked = all_close("y", Mat{1, 2, 99, 99}, ref, 2, {true, false}, tolerance_for(DType::kBF16));
  EXPECT_TRUE(masked.ok);
  EXPECT_EQ(masked.compared, 2u);
  EXPECT_TRUE(masked.message.empty());
  EXPECT_FALSE(all_close("short", Mat{1, 2, 3}, ref, 2, {}, tolerance_for(DType::kBF16)).ok);
}

// A capacity that holds any routing of the rows in its worst aligned layout (the GPU cases rely on it).
TEST(Data, CapacityHoldsTheWorstAlignedLayout) {
  EXPECT_EQ(capacity_rows_for(40, 4, 1, 0), 40);     // exactly full
  EXPECT_EQ(capacity_rows_for(128, 4, 32, 0), 256);  // 3 groups may each waste 31 rows
  EXPECT_EQ(capacity_rows_for(0, 8, 1, 16), 16);
  EXPECT_EQ(capacity_rows_for(0, 1, 128, 0), 128);   // one aligned block at least
  EXPECT_EQ(capacity_rows_for(900, 8, 128, 0), 1920);
}

// The Zipf exponent generalizes the two named routings without changing their random sequence.
TEST(Data, RoutingNamesMatchTheirZipfExponents) {
  std::mt19937_64 a(7), b(7);
  EXPECT_EQ(random_splits(a, 32, 1000, Routing::kUniform), random_splits(b, 32, 1000, 0.0));
  EXPECT_EQ(random_splits(a, 32, 1000, Routing::kSkewed), random_splits(b, 32, 1000, kDefaultSkew));
}

TEST(Data, SplitsSumToRowsAndSkewConcentrates) {
  std::mt19937_64 rng(1);
  const auto u = random_splits(rng, 64, 6400, Routing::kUniform);
  const auto z = random_splits(rng, 64, 6400, Routing::kSkewed);
  EXPECT_EQ(std::accumulate(u.begin(), u.end(), 0), 6400);
  EXPECT_EQ(std::accumulate(z.begin(), z.end(), 0), 6400);
  EXPECT_GT(*std::max_element(z.begin(), z.end()), 3 * *std::max_element(u.begin(), u.end()) / 2);
}

// A case's tolerance override covers its GEMM outputs in its dtype only: the bias gradients keep the
// table's row (under mxfp8 the override, based on the MXFP8 GEMM tolerance, used to loosen them too),
// and main_grad (fp32) the fp32 row or, under mxfp8, the MXFP8 GEMM tolerance.
TEST(CaseTolerance, TheOverrideCoversTheGemmOutputsOnly) {
  auto same = [](const testing::Tolerance& a, const testing::Tolerance& b) {
    return a.rtol == b.rtol && a.atol == b.atol && a.rel_fro == b.rel_fro;
  };
  const testing::Tolerance loose{0.05, 0.01, 0.04};
  for (Recipe recipe : {Recipe::kBF16, Recipe::kMXFP8})
    for (DType dtype : {DType::kBF16, DType::kFP16})
      for (bool override : {false, true}) {
        testing::CaseSpec spec;
        spec.recipe = recipe, spec.dtype = dtype;
        if (override) spec.tolerance = loose;
        const testing::Tolerance gemm_default =
            recipe == Recipe::kMXFP8 ? testing::mxfp8_gemm_tolerance() : testing::tolerance_for(dtype);
        SCOPED_TRACE(::testing::Message() << recipe_name(recipe) << " " << dtype_name(dtype) << " override "
                                          << override);
        EXPECT_TRUE(same(testing::case_tolerance(spec, true, dtype), override ? loose : gemm_default));  // y, dx
        EXPECT_TRUE(same(testing::case_tolerance(spec, false, dtype), testing::tolerance_for(dtype)));  // dbias
        EXPECT_TRUE(same(testing::case_tolerance(spec, false, DType::kFP32),
                         testing::tolerance_for(DType::kFP32)));  // dbias_scale
        EXPECT_TRUE(same(testing::case_tolerance(spec, true, DType::kFP32),  // main_grad
                         recipe == Recipe::kMXFP8 ? testing::mxfp8_gemm_tolerance()
                                                  : testing::tolerance_for(DType::kFP32)));
      }
}

}  // namespace
}  // namespace moegraph::test
