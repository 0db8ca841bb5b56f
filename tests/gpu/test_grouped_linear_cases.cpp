// Every GEMM and epilogue against the fp64 reference over a named case table.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "tests/common/expect.hpp"

namespace moegraph::test {
namespace {

std::vector<CaseSpec> cases() {
  using R = Routing;
  const DType fp16 = DType::kFP16;
  // 64 groups, every other one empty, the others of 1-150 rows: at 384 x 384 that is 288 wgrad tiles
  // of 128 x 128 with data (and 288 of empty groups), two or more per CTA of the ping-pong kernel's
  // grid (one per SM), with empty groups' tiles between them in each CTA's sequence.
  std::vector<int32_t> every_other_empty(64);
  for (int g = 0; g < 64; ++g) every_other_empty[g] = g % 2 == 0 ? 0 : 1 + (g * 37) % 150;
  return {
      // name, groups, k, n, dtype, row_align, splits, rows, routing, capacity_extra, bias, scale, main_grad
      {"g1_one_group", 1, 256, 128, DType::kBF16, 1, {}, 300},
      {"g8_uniform_bias", 8, 512, 384, DType::kBF16, 1, {}, 1000, R::kUniform, 64, true},
      {"g8_empty_groups", 8, 256, 256, DType::kBF16, 1, {0, 37, 0, 0, 100, 1, 0, 5}, 0, R::kUniform, 10, true},
      {"g8_single_rows", 8, 128, 128, DType::kBF16, 1, {1, 1, 1, 1, 1, 1, 1, 1}},
      {"g8_odd_sizes", 8, 272, 208, DType::kBF16, 1, {3, 17, 129, 255, 1, 63, 5, 77}, 0, R::kUniform, 0, true, true},
      {"g8_all_rows_in_one_group", 8, 256, 384, DType::kBF16, 1, {0, 0, 0, 777, 0, 0, 0, 0}, 0, R::kUniform, 0, true},
      {"g8_all_groups_empty", 8, 128, 128, DType::kBF16, 1, {0, 0, 0, 0, 0, 0, 0, 0}, 0, R::kUniform, 16, true},
      {"g8_capacity_exactly_full", 8, 384, 256, DType::kBF16, 1, {}, 1024},
      {"g64_skewed", 64, 256, 512, DType::kBF16, 1, {}, 3000, R::kSkewed, 0, true, true},
      {"g256_uniform", 256, 128, 256, DType::kBF16, 1, {}, 2000, R::kUniform, 100, true},
      {"g256_skewed_main_grad", 256, 256, 128, DType::kBF16, 1, {}, 2000, R::kSkewed, 0, false, false, true},
      {"g1024_max_groups", 1024, 128, 128, DType::kBF16, 1, {}, 3000, R::kSkewed, 0, true, true},
      {"k8192_n128", 4, 8192, 128, DType::kBF16, 1, {}, 200},
      {"k128_n8192", 4, 128, 8192, DType::kBF16, 1, {}, 200, R::kUniform, 0, true},
      {"k48_n80_partial_tiles", 3, 48, 80, DType::kBF16, 1, {5, 0, 70}},
      {"align16_bias_scale", 8, 256, 256, DType::kBF16, 16, {}, 500, R::kSkewed, 0, true, true},
      {"align32_odd", 8, 256, 128, DType::kBF16, 32, {3, 17, 129, 0, 1, 63, 5, 77}, 0, R::kUniform, 0, true, true},
      {"align128_main_grad", 8, 128, 256, DType::kBF16, 128, {}, 900, R::kUniform, 0, true, false, true},
      // Spans of 128 rows whose data ends in the first 64 (the second 64-row block holds gap rows
      // only, written as zero without MMAs) or just past it, and a span of 256 whose last block is gap.
      {"align128_short_groups", 8, 256, 192, DType::kBF16, 128, {3, 64, 129, 0, 1, 63, 65, 128}, 0, R::kUniform, 0, true, true},
      {"fp16_odd_bias_scale", 8, 256, 256, fp16, 1, {3, 17, 129, 255, 1, 63, 5, 77}, 0, R::kUniform, 0, true, true},
      {"fp16_main_grad", 16, 512, 256, fp16, 16, {}, 1500, R::kSkewed, 0, false, false, true},
      // Groups of 1, 2 and 4 row tiles beside one of 17 (two bands in the TMA kernels' raster), fixed
      // and drawn from a skewed routing.
      {"g6_heavy_and_light", 6, 128, 384, DType::kBF16, 1, {2100, 5, 0, 130, 1, 400}, 0, R::kUniform, 0, true},
      {"g32_skewed_long_bands", 32, 128, 640, DType::kBF16, 1, {}, 8000, R::kSkewed, 0, true, true},
      // dW and main_grad tiles that overhang N and K inside a group (the tensor stores must clip there).
      {"g6_partial_tiles_main_grad", 6, 208, 144, DType::kBF16, 1, {}, 700, R::kSkewed, 0, false, false, true},
      // main_grad with empty groups between full ones (their tiles add nothing and stream no parts):
      // a few tiles, and many per CTA.
      {"g8_empty_groups_main_grad", 8, 256, 256, DType::kBF16, 1, {0, 37, 0, 0, 100, 1, 0, 5}, 0, R::kUniform, 10,
       false, false, true},
      {"g64_every_other_empty_main_grad", 64, 384, 384, DType::kBF16, 1, every_other_empty, 0, R::kUniform, 0, false,
       false, true},
      // K and N below one box: a main_grad tile's parts past K and its second 64-row box past N are
      // neither loaded nor stored; dW ([G][N][K]) tiles are clipped to 16 rows (N) and 32 columns (K).
      {"k16_n48_main_grad", 5, 16, 48, DType::kBF16, 1, {0, 70, 3, 0, 129}, 0, R::kUniform, 0, false, false, true},
      {"k32_n16_bias_scale", 5, 32, 16, DType::kBF16, 1, {64, 0, 1, 200, 17}, 0, R::kUniform, 8, true, true},
  };
}

class GroupedLinearCase : public ::testing::TestWithParam<CaseSpec> {};

TEST_P(GroupedLinearCase, AllPhasesMatchFp64Reference) {
  Problem p(GetParam(), test_seed(GetParam().name));
  cudaStream_t stream = nullptr;

  // Inference forward.
  p.poison_outputs();
  p.op->forward(p.forward_args(), stream);
  p.op->check_device_errors(stream);
  expect_matches_reference(p, OutputSet::kForward, "forward");

  // Training forward and backward with every gradient.
  p.poison_outputs();
  p.op->forward_train(p.forward_args(), stream);
  p.op->backward(p.backward_args(), WgradMode::kImmediate, stream);
  p.op->check_device_errors(stream);
  expect_matches_reference(p, OutputSet::kForward, "forward_train");
  expect_matches_reference(p, OutputSet::kDgrad, "backward");
  expect_matches_reference(p, OutputSet::kBiasGrads, "backward");
  expect_matches_reference(p, OutputSet::kWgrad, "backward");
}

INSTANTIATE_TEST_SUITE_P(Cases, GroupedLinearCase, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// The same table on the foundation WMMA kernels, kept as the reference path.
std::vector<CaseSpec> reference_kernel_cases() {
  std::vector<CaseSpec> out = cases();
  for (CaseSpec& c : out) c.reference_kernels = true, c.name += "_wmma_reference";
  return out;
}

INSTANTIATE_TEST_SUITE_P(ReferenceKernels, GroupedLinearCase, ::testing::ValuesIn(reference_kernel_cases()),
                         [](const auto& info) { return info.param.name; });

// And on every wgmma kernel by name, whatever the heuristics would pick for these shapes: both
// load pipelines (warp-specialized TMA, cp.async) at both tile widths, and TMA wgrad with
// ping-pong consumers.
std::vector<CaseSpec> pipeline_cases(GemmPipeline pipeline, const std::string& suffix) {
  std::vector<CaseSpec> out;
  for (int tile_n : {128, 256})
    for (CaseSpec c : cases()) {
      c.tile_n = tile_n, c.pipeline = pipeline, c.wgrad_ping_pong = 0;
      c.name += suffix + std::to_string(tile_n);
      out.push_back(c);
    }
  if (pipeline == GemmPipeline::kTma)
    for (CaseSpec c : cases()) {
      c.tile_n = 128, c.pipeline = pipeline, c.wgrad_ping_pong = 1;
      c.name += suffix + "_wgrad_ping_pong";
      out.push_back(c);
    }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Tma, GroupedLinearCase,
                         ::testing::ValuesIn(pipeline_cases(GemmPipeline::kTma, "_tma")),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(CpAsync, GroupedLinearCase,
                         ::testing::ValuesIn(pipeline_cases(GemmPipeline::kCpAsync, "_cp_async")),
                         [](const auto& info) { return info.param.name; });

CaseSpec mxfp8(CaseSpec c) {
  c.recipe = Recipe::kMXFP8;
  return c;
}

// The MXFP8 recipe: K and N multiples of 128, groups 32- or 128-aligned (column-wise blocks of the
// wgrad operands never straddle groups), and padding past the last group a whole number of blocks.
std::vector<CaseSpec> mxfp8_cases() {
  using R = Routing;
  const DType bf16 = DType::kBF16, fp16 = DType::kFP16;
  return {
      // name, groups, k, n, dtype, row_align, splits, rows, routing, capacity_extra, bias, scale, main_grad
      mxfp8({"g1_one_group_short_last_block", 1, 256, 128, bf16, 32, {300}}),
      mxfp8({"g8_uniform_bias", 8, 512, 384, bf16, 32, {}, 1000, R::kUniform, 64, true}),
      mxfp8({"g8_empty_groups", 8, 256, 256, bf16, 32, {0, 37, 0, 0, 100, 1, 0, 5}, 0, R::kUniform, 32, true}),
      mxfp8({"g8_single_rows", 8, 128, 128, bf16, 32, {1, 1, 1, 1, 1, 1, 1, 1}}),
      mxfp8({"g8_odd_sizes_bias_scale", 8, 256, 128, bf16, 32, {3, 17, 129, 255, 1, 63, 5, 77}, 0, R::kUniform, 0,
             true, true}),
      mxfp8({"g8_all_rows_in_one_group", 8, 256, 384, bf16, 128, {0, 0, 0, 777, 0, 0, 0, 0}, 0, R::kUniform, 0, true}),
      mxfp8({"g8_all_groups_empty", 8, 128, 128, bf16, 32, {0, 0, 0, 0, 0, 0, 0, 0}, 0, R::kUniform, 32, true}),
      mxfp8({"g64_skewed_bias_scale", 64, 256, 512, bf16, 32, {}, 3000, R::kSkewed, 0, true, true}),
      mxfp8({"g256_skewed_main_grad", 256, 256, 128, bf16, 32, {}, 2000, R::kSkewed, 0, false, false, true}),
      mxfp8({"align128_main_grad_bias", 8, 128, 256, bf16, 128, {}, 900, R::kUniform, 0, true, false, true}),
      mxfp8({"k2048_n128", 4, 2048, 128, bf16, 32, {}, 200}),
      mxfp8({"k128_n2048_bias", 4, 128, 2048, bf16, 32, {}, 200, R::kUniform, 0, true}),
      mxfp8({"fp16_odd_bias_scale", 8, 256, 256, fp16, 32, {3, 17, 129, 255, 1, 63, 5, 77}, 0, R::kUniform, 0, true,
             true}),
      mxfp8({"fp16_skewed_main_grad", 16, 512, 256, fp16, 128, {}, 1500, R::kSkewed, 0, false, false, true}),
  };
}

INSTANTIATE_TEST_SUITE_P(Mxfp8, GroupedLinearCase, ::testing::ValuesIn(mxfp8_cases()),
                         [](const auto& info) { return info.param.name; });

// The MXFP8 references must not be the bf16 ones in disguise: a kernel that skipped quantization
// (exact GEMMs of the unquantized inputs) has to fail the check of every MXFP8 GEMM output. Each
// MXFP8 reference must still be the same product up to E4M3's precision (3 mantissa bits).
TEST(Mxfp8Reference, UnquantizedGemmsFailTheCheck) {
  const CaseSpec spec = mxfp8({"mxfp8_reference_vs_unquantized", 8, 256, 384, DType::kBF16, 32, {}, 600,
                               Routing::kSkewed, 0, true, true});
  Problem p(spec, test_seed(spec.name));
  const int64_t n = spec.n, k = spec.k;
  const std::map<std::string, Mat> unquantized = {
      {"y", ref_fprop(p.layout, p.x, p.w, p.b, p.s, n, k)},
      {"dx", ref_dgrad(p.layout, p.dy, p.w, n, k)},
      {"dweight", ref_wgrad(p.layout, p.dy, p.x, n, k)},
  };
  int checked = 0;
  for (OutputSet set : {OutputSet::kForward, OutputSet::kDgrad, OutputSet::kWgrad})
    for (Output& output : p.outputs(set)) {
      output.got = unquantized.at(output.name);
      const CompareResult result = compare(output, "unquantized");
      EXPECT_FALSE(result.ok) << output.name << ": the unquantized product passes the MXFP8 check";
      EXPECT_GT(result.out_of_tolerance, result.compared / 4) << output.name;
      EXPECT_GT(result.rel_fro, output.tol.rel_fro) << output.name;
      EXPECT_LT(result.rel_fro, 0.1) << output.name << ": the MXFP8 reference is not the same product";
      ++checked;
    }
  EXPECT_EQ(checked, 3);
}

// A forward_only operator (what an inference layer builds): forward() gives the bits of the same
// operator built to train, in less device memory, in both recipes (mxfp8 at row_align 32, where a
// training operator keeps column-wise copies, a wgrad staging and dgrad's weight copy);
// forward_train is refused with the reason.
TEST(GroupedLinearForwardOnly, ForwardMatchesATrainingOperatorInLessMemory) {
  const CaseSpec specs[] = {
      {"forward_only_bf16", 8, 256, 384, DType::kBF16, 1, {}, 900, Routing::kSkewed, 32, true, true},
      mxfp8({"forward_only_mxfp8", 8, 256, 384, DType::kBF16, 32, {}, 900, Routing::kSkewed, 32, true, true}),
  };
  for (CaseSpec spec : specs) {
    SCOPED_TRACE(spec.name);
    spec.wgrad_slots = 2;
    Problem trains(spec, test_seed(spec.name));
    spec.forward_only = true;
    Problem serves(spec, test_seed(spec.name));  // same seed: the same routing, data and weights
    ASSERT_EQ(serves.layout.splits, trains.layout.splits);
    EXPECT_LT(serves.op->device_bytes(), trains.op->device_bytes());
    if (spec.recipe == Recipe::kMXFP8)  // and no W_e^T (dgrad's copy): at least its codes and scales less
      EXPECT_GE(trains.op->device_bytes() - serves.op->device_bytes(),
                mxfp8_weight_data_bytes(spec.groups, spec.n, spec.k) +
                    mxfp8_weight_scale_bytes(spec.groups, spec.n, spec.k));
    cudaStream_t stream = nullptr;
    for (Problem* p : {&trains, &serves}) {
      p->poison_outputs();
      p->op->forward(p->forward_args(), stream);
      p->op->check_device_errors(stream);
    }
    expect_matches_reference(serves, OutputSet::kForward, "forward_only");
    EXPECT_TRUE(serves.d_y.download() == trains.d_y.download()) << "forward_only's y differs from a training operator's";
    try {
      serves.op->forward_train(serves.forward_args(), stream);
      ADD_FAILURE() << "forward_train on a forward_only operator must be refused";
    } catch (const Error& e) {
      EXPECT_NE(e.message().find("forward_train: the operator was built forward_only"), std::string::npos)
          << e.message();
    }
    EXPECT_EQ(serves.op->pending_backwards(), 0);
  }
}

}  // namespace
}  // namespace moegraph::test
