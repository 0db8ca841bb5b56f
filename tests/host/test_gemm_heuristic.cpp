// The grouped GEMM heuristic (problem -> printable config), its overrides, and --plan: the plan
// prints the very configs set-up uses, for every recipe.
#include <gtest/gtest.h>

#include <cstdlib>

#include "kernels/grouped_gemm/grouped_gemm.hpp"
#include "moegraph/config.hpp"
#include "moegraph/error.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/step_graphs.hpp"
#include "src/ops/moe/op_spec.hpp"
#include "tests/common/env_var.hpp"

namespace moegraph::test {
namespace {

using kernels::GemmFamily;
using kernels::GemmPhase;

kernels::GemmProblem problem(GemmPhase phase, Recipe recipe, int groups, int64_t rows, int64_t n, int64_t k) {
  kernels::GemmProblem p;
  p.phase = phase, p.recipe = recipe, p.groups = groups, p.capacity_rows = rows;
  p.expected_rows_per_group = rows / groups, p.n = n, p.k = k;
  return p;
}

TEST(GemmHeuristic, ChoosesByShapeAndPhase) {
  // Many rows per expert and a wide output: the wide TMA tile; wgrad on narrow tiles: cp.async.
  const auto big = kernels::choose_gemm_config(problem(GemmPhase::kFprop, Recipe::kBF16, 8, 16384, 28672, 4096), {});
  EXPECT_EQ(big.family, GemmFamily::kTma16);
  EXPECT_EQ(big.block_n, 256);
  // fprop and dgrad take the wide tile on any group size once their output is 1536 wide or more
  // (128 experts of 40 rows, N 4096: fprop's output; decode's 6 rows), and from 768 wide when groups
  // average 64 rows or more; narrower outputs keep 128, and so do outputs under 1536 of smaller groups.
  EXPECT_EQ(kernels::choose_gemm_config(problem(GemmPhase::kFprop, Recipe::kBF16, 128, 5120, 4096, 1536), {}).block_n,
            256);
  EXPECT_EQ(kernels::choose_gemm_config(problem(GemmPhase::kDgrad, Recipe::kBF16, 64, 384, 2816, 4096), {}).block_n,
            256);
  EXPECT_EQ(kernels::choose_gemm_config(problem(GemmPhase::kDgrad, Recipe::kBF16, 128, 5120, 4096, 1024), {}).block_n,
            128);  // 40 rows a group
  EXPECT_EQ(kernels::choose_gemm_config(problem(GemmPhase::kFprop, Recipe::kBF16, 128, 32768, 768, 2048), {}).block_n,
            256);
  EXPECT_EQ(kernels::choose_gemm_config(problem(GemmPhase::kDgrad, Recipe::kBF16, 128, 32768, 2048, 640), {}).block_n,
            128);
  EXPECT_EQ(kernels::choose_gemm_config(problem(GemmPhase::kFprop, Recipe::kBF16, 128, 32768, 640, 2048), {}).block_n,
            128);
  EXPECT_EQ(kernels::choose_gemm_config(problem(GemmPhase::kDgrad, Recipe::kBF16, 128, 128 * 64, 2048, 768), {}).block_n,
            256);
  EXPECT_EQ(kernels::choose_gemm_config(problem(GemmPhase::kDgrad, Recipe::kBF16, 128, 128 * 63, 2048, 768), {}).block_n,
            128);
  EXPECT_EQ(kernels::choose_gemm_config(problem(GemmPhase::kDgrad, Recipe::kBF16, 64, 768, 4096, 1408), {}).block_n,
            128);
  EXPECT_EQ(kernels::choose_gemm_config(problem(GemmPhase::kDgrad, Recipe::kBF16, 64, 768, 4096, 1536), {}).block_n,
            256);
  // Too few wide tiles to fill the GPU (one decode token: 6 rows, at most 6 experts of 11 wide tiles).
  EXPECT_EQ(kernels::choose_gemm_config(problem(GemmPhase::kFprop, Recipe::kBF16, 64, 6, 2816, 4096), {}).block_n, 128);
  EXPECT_EQ(kernels::choose_gemm_config(problem(GemmPhase::kFprop, Recipe::kBF16, 64, 48, 2816, 4096), {}).block_n, 256);
  // Short wgrad reductions (under 24 rows a group into dW, under 512 into fp32 main_grad):
  // ping-pong TMA consumers.
  auto small_problem = problem(GemmPhase::kWgrad, Recipe::kBF16, 64, 768, 5632, 4096);
  for (bool into_main_grad : {false, true}) {
    small_problem.into_main_grad = into_main_grad;
    const auto small = kernels::choose_gemm_config(small_problem, {});
    EXPECT_EQ(small.family, GemmFamily::kTma16);
    EXPECT_TRUE(small.ping_pong);
    EXPECT_EQ(small.block_n, 128);
    EXPECT_NE(small.to_string().find("ping-pong consumers"), std::string::npos) << small.to_string();
    // Into main_grad a kernel of its own (main_grad streamed through a ring), with its own stages.
    EXPECT_EQ(small.into_main_grad, into_main_grad);
    EXPECT_EQ(small.stages, into_main_grad ? 5 : 4) << small.to_string();  // TilePingPongMainGrad, TilePingPong
    EXPECT_EQ(small.to_string().find("main_grad streamed") != std::string::npos, into_main_grad) << small.to_string();
  }
  // From 24 to 511 rows a group with K >= 512, wgrad into dW takes the shared wide TMA tile; into
  // main_grad it keeps ping-pong; K below 512 keeps ping-pong either way.
  for (int64_t rows_per_group : {23, 24, 511, 512}) {
    auto into_dw = problem(GemmPhase::kWgrad, Recipe::kBF16, 128, 128 * rows_per_group, 1536, 1024);
    const auto dw = kernels::choose_gemm_config(into_dw, {});
    into_dw.into_main_grad = true;
    const auto mg = kernels::choose_gemm_config(into_dw, {});
    const bool shared = rows_per_group >= 24 && rows_per_group < 512;
    EXPECT_EQ(dw.ping_pong, rows_per_group < 24) << rows_per_group << ": " << dw.to_string();
    EXPECT_EQ(dw.block_n, shared ? 256 : 128) << rows_per_group << ": " << dw.to_string();
    EXPECT_EQ(dw.family, rows_per_group < 512 ? GemmFamily::kTma16 : GemmFamily::kCpAsync16) << dw.to_string();
    EXPECT_EQ(mg.ping_pong, rows_per_group < 512) << rows_per_group << ": " << mg.to_string();
  }
  EXPECT_TRUE(
      kernels::choose_gemm_config(problem(GemmPhase::kWgrad, Recipe::kBF16, 128, 128 * 256, 2048, 511), {}).ping_pong);
  EXPECT_FALSE(
      kernels::choose_gemm_config(problem(GemmPhase::kWgrad, Recipe::kBF16, 128, 128 * 256, 2048, 512), {}).ping_pong);
  // Long reductions (large experts) keep the wide shared tiles, whatever the output.
  const auto big_wgrad = kernels::choose_gemm_config(problem(GemmPhase::kWgrad, Recipe::kBF16, 8, 16384, 28672, 4096), {});
  EXPECT_EQ(big_wgrad.family, GemmFamily::kTma16);
  EXPECT_FALSE(big_wgrad.ping_pong);
  EXPECT_EQ(big_wgrad.block_n, 256);
  // MXFP8 wgrad of bf16 activations: staged through bf16, on the bf16 recipe's tile for the shape
  // and destination (ping-pong under 24 rows a group into dW and under 512 into main_grad, the
  // wide tile for the others).
  for (bool into_main_grad : {false, true})
    for (int64_t rows_per_group : {12, 40, 511, 512, 2048}) {
      auto mx_problem = problem(GemmPhase::kWgrad, Recipe::kMXFP8, 8, 8 * rows_per_group, 28672, 4096);
      auto bf_problem = problem(GemmPhase::kWgrad, Recipe::kBF16, 8, 8 * rows_per_group, 28672, 4096);
      mx_problem.into_main_grad = bf_problem.into_main_grad = into_main_grad;
      const auto mx = kernels::choose_gemm_config(mx_problem, {});
      const auto bf = kernels::choose_gemm_config(bf_problem, {});
      EXPECT_EQ(mx.family, GemmFamily::kMxfp8Staged) << mx.to_string();
      EXPECT_EQ(mx.block_n, bf.block_n) << rows_per_group;
      EXPECT_EQ(mx.ping_pong, rows_per_group < (into_main_grad ? 512 : 24)) << mx.to_string();
      EXPECT_EQ(mx.into_main_grad, into_main_grad && mx.ping_pong) << mx.to_string();
      EXPECT_EQ(mx.stages, bf.stages) << mx.to_string();
      EXPECT_NE(mx.to_string().find("dequantized to bf16 in scratch"), std::string::npos) << mx.to_string();
    }
  // fp16 activations keep the E4M3 kernels (the staged values need bf16's range).
  auto fp16 = problem(GemmPhase::kWgrad, Recipe::kMXFP8, 8, 4096, 1024, 512);
  fp16.dtype = DType::kFP16;
  const auto mx16 = kernels::choose_gemm_config(fp16, {});
  EXPECT_EQ(mx16.family, GemmFamily::kMxfp8CpAsync);
  EXPECT_TRUE(mx16.ping_pong);
  EXPECT_NE(mx16.to_string().find("wgmma_e4m3"), std::string::npos) << mx16.to_string();
  // fprop and dgrad of bf16 activations: staged past 224 rows a group, swap-AB up to it.
  for (GemmPhase phase : {GemmPhase::kFprop, GemmPhase::kDgrad})
    for (int64_t k : {1024, 4096}) {
      const auto staged = kernels::choose_gemm_config(problem(phase, Recipe::kMXFP8, 8, 8 * 225, 1024, k), {});
      EXPECT_EQ(staged.family, GemmFamily::kMxfp8Staged) << staged.to_string();
      const auto fewer = kernels::choose_gemm_config(problem(phase, Recipe::kMXFP8, 8, 8 * 224, 1024, k), {});
      EXPECT_EQ(fewer.family, GemmFamily::kMxfp8SwapAb) << fewer.to_string();
    }
  // fp16 activations at 512 rows a group: dequantized on chip where the reduction is 2048 or
  // longer, E4M3 below; forcing staged there leaves the heuristic's route. Swap-AB up to 320 rows.
  auto long_red = problem(GemmPhase::kDgrad, Recipe::kMXFP8, 8, 4096, 2048, 512);
  auto short_red = problem(GemmPhase::kDgrad, Recipe::kMXFP8, 8, 4096, 2047, 4096);
  long_red.dtype = short_red.dtype = DType::kFP16;
  EXPECT_EQ(kernels::choose_gemm_config(long_red, {}).family, GemmFamily::kMxfp8Dequant);
  EXPECT_EQ(kernels::choose_gemm_config(short_red, {}).family, GemmFamily::kMxfp8CpAsync);
  for (GemmPhase phase : {GemmPhase::kFprop, GemmPhase::kDgrad}) {
    auto at_bound = problem(phase, Recipe::kMXFP8, 8, 8 * 320, 2048, 2048);
    auto past_bound = problem(phase, Recipe::kMXFP8, 8, 8 * 321, 2048, 2048);
    at_bound.dtype = past_bound.dtype = DType::kFP16;
    EXPECT_EQ(kernels::choose_gemm_config(at_bound, {}).family, GemmFamily::kMxfp8SwapAb);
    EXPECT_EQ(kernels::choose_gemm_config(past_bound, {}).family, GemmFamily::kMxfp8CpAsync);
  }
  kernels::GemmOverrides staged;
  staged.mxfp8_route = kernels::Mxfp8Route::kStaged;
  EXPECT_EQ(kernels::choose_gemm_config(long_red, staged).family, GemmFamily::kMxfp8Dequant);
  EXPECT_EQ(kernels::choose_gemm_config(problem(GemmPhase::kFprop, Recipe::kMXFP8, 64, 384, 2816, 4096), staged).family,
            GemmFamily::kMxfp8Staged);
}

// MXFP8 fprop and dgrad of groups of at most 224 rows (bf16 activations): the swap-AB kernel; larger
// groups the staged route (ChoosesByShapeAndPhase). Forcing picks any route; swap_ab and dequant,
// fprop/dgrad kernels, leave wgrad on E4M3.
TEST(GemmHeuristic, Mxfp8SmallGroupsSwapTheOperands) {
  for (GemmPhase phase : {GemmPhase::kFprop, GemmPhase::kDgrad}) {
    const auto decode = kernels::choose_gemm_config(problem(phase, Recipe::kMXFP8, 64, 64 * 64, 2816, 4096), {});
    EXPECT_EQ(decode.family, GemmFamily::kMxfp8SwapAb) << decode.to_string();
    EXPECT_EQ(decode.block_n, 32);
    EXPECT_NE(decode.to_string().find("swap_ab"), std::string::npos) << decode.to_string();
    for (int64_t rows_per_group : {65, 128, 224}) {
      const auto larger =
          kernels::choose_gemm_config(problem(phase, Recipe::kMXFP8, 64, rows_per_group * 64, 2816, 4096), {});
      EXPECT_EQ(larger.family, GemmFamily::kMxfp8SwapAb) << rows_per_group << ": " << larger.to_string();
    }
    kernels::GemmOverrides o;
    o.mxfp8_route = kernels::Mxfp8Route::kSwapAb;
    EXPECT_EQ(kernels::choose_gemm_config(problem(phase, Recipe::kMXFP8, 8, 16384, 2816, 4096), o).family,
              GemmFamily::kMxfp8SwapAb);
    o.mxfp8_route = kernels::Mxfp8Route::kE4m3;
    EXPECT_EQ(kernels::choose_gemm_config(problem(phase, Recipe::kMXFP8, 64, 384, 2816, 4096), o).family,
              GemmFamily::kMxfp8CpAsync);
    o.mxfp8_route = kernels::Mxfp8Route::kDequant;
    const auto forced = kernels::choose_gemm_config(problem(phase, Recipe::kMXFP8, 64, 384, 2816, 4096), o);
    EXPECT_EQ(forced.family, GemmFamily::kMxfp8Dequant);
    EXPECT_NE(forced.to_string().find("dequantized to bf16"), std::string::npos) << forced.to_string();
  }
  for (auto route : {kernels::Mxfp8Route::kSwapAb, kernels::Mxfp8Route::kDequant}) {
    kernels::GemmOverrides o;
    o.mxfp8_route = route;
    EXPECT_EQ(kernels::choose_gemm_config(problem(GemmPhase::kWgrad, Recipe::kMXFP8, 64, 384, 2816, 4096), o).family,
              GemmFamily::kMxfp8CpAsync);
  }
  {
    EnvVar on("MOEGRAPH_MXFP8_ROUTE", "dequant");
    EXPECT_EQ(kernels::with_environment({}).mxfp8_route, kernels::Mxfp8Route::kDequant);
    EnvVar staged("MOEGRAPH_MXFP8_ROUTE", "staged");
    EXPECT_EQ(kernels::with_environment({}).mxfp8_route, kernels::Mxfp8Route::kStaged);
    EnvVar bad("MOEGRAPH_MXFP8_ROUTE", "fast");
    EXPECT_THROW(kernels::with_environment({}), Error);
  }
  EnvVar old("MOEGRAPH_MXFP8_SWAP_AB", "1");  // replaced: an error, never silently ignored
  EXPECT_THROW(kernels::with_environment({}), Error);
}

// The swap-AB route's scratch holds its split reductions' counters and fp32 partials where a launch
// may have a quarter of 264 CTAs as tiles or fewer: two experts of a token, 4096 columns each (at
// most 2 x 32 tiles), get it; a token's 6 experts of 2816 columns (6 x 22 tiles) or 8 tokens (48
// rows: up to 48 x 22 tiles) never split and get none.
TEST(GemmHeuristic, Mxfp8SwapAbScratchOnlyWhereTilesAreFew) {
  const auto decode = kernels::choose_gemm_config(problem(GemmPhase::kFprop, Recipe::kMXFP8, 8, 2, 4096, 14336), {});
  ASSERT_EQ(decode.family, GemmFamily::kMxfp8SwapAb) << decode.to_string();
  const std::size_t split = kernels::mxfp8_staging_bytes(decode, 8, 2, 4096, 14336);
  EXPECT_EQ(split, (264 * sizeof(unsigned) + 255) / 256 * 256 + std::size_t{264} * 256 * 16 * sizeof(float));
  EXPECT_EQ(kernels::mxfp8_staging_bytes(decode, 64, 6, 2816, 4096), 0u);
  EXPECT_EQ(kernels::mxfp8_staging_bytes(decode, 64, 48, 2816, 4096), 0u);
  EXPECT_EQ(kernels::mxfp8_staging_bytes(decode, 64, 6, 512, 4096), split);  // 6 x 4 tiles
  EXPECT_THROW(kernels::mxfp8_staging_bytes(decode, 0, 6, 2816, 4096), Error);
}

// With the weights kept dequantized (dequantized_weights) fprop and dgrad of every group past the
// swap-AB bound take the staged route reading those values (it stages only A, so its scratch is A's
// bf16 copy alone); swap-AB keeps the small groups, wgrad and fp16 activations are unchanged, and a
// forced route still wins.
TEST(GemmHeuristic, Mxfp8DequantizedWeightsTakeTheStagedRoute) {
  const auto with_values = [](kernels::GemmProblem p, DType dtype = DType::kBF16) {
    p.dequantized_weights = true, p.dtype = dtype;
    return p;
  };
  for (GemmPhase phase : {GemmPhase::kFprop, GemmPhase::kDgrad}) {
    for (int64_t rows_per_group : {65, 80, 256, 383, 2048}) {
      const auto p = with_values(problem(phase, Recipe::kMXFP8, 64, 64 * rows_per_group, 1536, 2048));
      const auto c = kernels::choose_gemm_config(p, {});
      EXPECT_EQ(c.family, GemmFamily::kMxfp8Staged) << rows_per_group << ": " << c.to_string();
      EXPECT_TRUE(c.dequantized_weights) << c.to_string();
      EXPECT_NE(c.to_string().find("kept bf16 values"), std::string::npos) << c.to_string();
      // Its scratch: A [capacity_rows, k] in bf16, 256-byte aligned; none for the weights.
      const std::size_t a_bytes = (64 * rows_per_group * 2048 * 2 + 255) / 256 * 256;
      EXPECT_EQ(kernels::mxfp8_staging_bytes(c, 64, 64 * rows_per_group, 1536, 2048), a_bytes);
      // Without the kept values the same problem stages the weights too (or takes another route).
      const auto plain =
          kernels::choose_gemm_config(problem(phase, Recipe::kMXFP8, 64, 64 * rows_per_group, 1536, 2048), {});
      EXPECT_FALSE(plain.dequantized_weights);
      if (plain.family == GemmFamily::kMxfp8Staged) {
        EXPECT_GT(kernels::mxfp8_staging_bytes(plain, 64, 64 * rows_per_group, 1536, 2048), a_bytes);
      }
    }
    const auto small =
        kernels::choose_gemm_config(with_values(problem(phase, Recipe::kMXFP8, 64, 64 * 64, 1536, 2048)), {});
    EXPECT_EQ(small.family, GemmFamily::kMxfp8SwapAb) << small.to_string();
    EXPECT_FALSE(small.dequantized_weights);
    const auto fp16 = kernels::choose_gemm_config(
        with_values(problem(phase, Recipe::kMXFP8, 8, 8 * 256, 1536, 2048), DType::kFP16), {});
    EXPECT_NE(fp16.family, GemmFamily::kMxfp8Staged) << fp16.to_string();
    kernels::GemmOverrides e4m3;
    e4m3.mxfp8_route = kernels::Mxfp8Route::kE4m3;
    const auto forced =
        kernels::choose_gemm_config(with_values(problem(phase, Recipe::kMXFP8, 8, 8 * 256, 1536, 2048)), e4m3);
    EXPECT_EQ(forced.family, GemmFamily::kMxfp8CpAsync);
    EXPECT_FALSE(forced.dequantized_weights);
  }
  const auto wgrad =
      kernels::choose_gemm_config(with_values(problem(GemmPhase::kWgrad, Recipe::kMXFP8, 8, 2048, 1536, 2048)), {});
  EXPECT_EQ(wgrad.family, GemmFamily::kMxfp8Staged);
  EXPECT_FALSE(wgrad.dequantized_weights) << "wgrad reads activations only";
}

TEST(GemmHeuristic, OverridesWinAndAreChecked) {
  const auto p = problem(GemmPhase::kFprop, Recipe::kBF16, 64, 768, 5632, 4096);
  kernels::GemmOverrides o;
  o.tile_n = 256, o.pipeline = GemmPipeline::kCpAsync;
  const auto forced = kernels::choose_gemm_config(p, o);
  EXPECT_EQ(forced.family, GemmFamily::kCpAsync16);
  EXPECT_EQ(forced.block_n, 256);
  o = {};
  o.reference = true;
  EXPECT_EQ(kernels::choose_gemm_config(p, o).family, GemmFamily::kReference);
  EXPECT_THROW(kernels::choose_gemm_config(problem(GemmPhase::kFprop, Recipe::kMXFP8, 8, 512, 256, 256), o), Error);
  o = {};
  o.tile_n = 64;
  EXPECT_THROW(kernels::choose_gemm_config(p, o), Error);
  // Ping-pong consumers are a 128-wide TMA wgrad kernel: forced on, off, or overruled by a forced
  // wide tile or cp.async.
  const auto w = problem(GemmPhase::kWgrad, Recipe::kBF16, 8, 16384, 28672, 4096);
  o = {};
  o.wgrad_ping_pong = 1;
  EXPECT_TRUE(kernels::choose_gemm_config(w, o).ping_pong);
  EXPECT_FALSE(kernels::choose_gemm_config(p, o).ping_pong);  // fprop
  o.tile_n = 256;
  EXPECT_FALSE(kernels::choose_gemm_config(w, o).ping_pong);
  o = {};
  o.wgrad_ping_pong = 1, o.pipeline = GemmPipeline::kCpAsync;
  EXPECT_EQ(kernels::choose_gemm_config(w, o).family, GemmFamily::kCpAsync16);
  o = {};
  o.wgrad_ping_pong = 0;
  EXPECT_FALSE(kernels::choose_gemm_config(problem(GemmPhase::kWgrad, Recipe::kBF16, 64, 768, 5632, 4096), o).ping_pong);
}

TEST(GemmHeuristic, EnvironmentFillsOnlyWhatTheCallerLeftOpen) {
  EnvVar tile("MOEGRAPH_TILE_N", "256"), pipeline("MOEGRAPH_GEMM_PIPELINE", "cp_async"),
      ping("MOEGRAPH_MXFP8_PINGPONG", "0"), wgrad_ping("MOEGRAPH_WGRAD_PINGPONG", "1");
  const kernels::GemmOverrides from_env = kernels::with_environment({});
  EXPECT_EQ(from_env.tile_n, 256);
  EXPECT_EQ(from_env.pipeline, GemmPipeline::kCpAsync);
  EXPECT_EQ(from_env.mxfp8_ping_pong, 0);
  EXPECT_EQ(from_env.wgrad_ping_pong, 1);
  kernels::GemmOverrides mine;
  mine.tile_n = 128, mine.pipeline = GemmPipeline::kTma;
  const kernels::GemmOverrides kept = kernels::with_environment(mine);
  EXPECT_EQ(kept.tile_n, 128);
  EXPECT_EQ(kept.pipeline, GemmPipeline::kTma);
  EnvVar bad("MOEGRAPH_TILE_N", "96");
  EXPECT_THROW(kernels::with_environment({}), Error);
  EnvVar tile_ok("MOEGRAPH_TILE_N", "128"), bad_ping("MOEGRAPH_WGRAD_PINGPONG", "yes");
  EXPECT_THROW(kernels::with_environment({}), Error);
}

// --plan prints, for every bucket and both expert linears, exactly what set-up will choose; an
// mxfp8 config lists only the MXFP8 kernels.
TEST(StepPlan, PrintsTheKernelsThatRun) {
  for (Recipe recipe : {Recipe::kBF16, Recipe::kMXFP8})
  for (StepKind step : {StepKind::kMoeLayer, StepKind::kExperts}) {
    Config c = default_config();
    c.precision.recipe = recipe;
    c.step = step;
    c.row_align = 32;
    const StepGraphsOptions options = step_graphs_options(c);
    const StepPlan plan = plan_step(options);
    for (const BucketPlan& b : plan.buckets) {
      EXPECT_GT(b.bytes, 0u);
      bool sub_buffers = false;  // the operators' workspaces are listed buffer by buffer
      for (const PlannedBuffer& buf : b.buffers) sub_buffers = sub_buffers || buf.name.find("slot0.") != std::string::npos;
      EXPECT_TRUE(sub_buffers) << "bucket " << b.tokens;
    }
    int gemm_lines = 0;
    for (const std::string& line : plan.kernels) {
      if (line.find("fprop: ") == std::string::npos) continue;
      ++gemm_lines;
      // An mxfp8 line names MXFP8 kernels only (E4M3 ones, or bf16 ones on staged operands).
      const bool mx = line.find("e4m3") != std::string::npos || line.find("mxfp8") != std::string::npos;
      EXPECT_EQ(mx, recipe == Recipe::kMXFP8) << line;
      if (recipe == Recipe::kBF16) {
        EXPECT_NE(line.find("wgmma_tma"), std::string::npos) << line;
      }
      if (recipe == Recipe::kMXFP8)  // every phase's config is an MXFP8 one
        for (const char* phase : {"fprop: ", "dgrad: ", "wgrad: "}) {
          const std::size_t at = line.find(phase);
          ASSERT_NE(at, std::string::npos) << line;
          const std::string config = line.substr(at + 7, line.find(" | ", at) - at - 7);
          EXPECT_TRUE(config.find("e4m3") != std::string::npos || config.find("mxfp8") != std::string::npos) << config;
        }
    }
    EXPECT_EQ(gemm_lines, 2 * static_cast<int>(c.buckets.size()));
    for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
      MoeLayerOptions o = options.layer;
      o.max_tokens = plan.buckets[b].tokens;
      const std::string fc1 = GroupedLinear::describe_kernels(layer::expert_linear_options(o, 1, plan.buckets[b].rows));
      bool found = false;
      for (const std::string& line : plan.kernels) found = found || line.find(fc1) != std::string::npos;
      EXPECT_TRUE(found) << "bucket " << plan.buckets[b].tokens << ": " << fc1;
    }
  }
}

// --plan's SwiGLU line is the layer operator's description (layer::describe_swiglu) of the SwiGLU
// the layer runs: plain kernels in bf16; in mxfp8 training (no bias) inside FC2's and FC1's
// quantizers; with the routing weights fused in, the weighted kernels (whose backward FC1's
// quantizer does not take over); the expert-MLP step the plain kernels.
TEST(StepPlan, DescribesTheSwigluTheLayerRuns) {
  auto swiglu_line = [](Recipe recipe, StepKind step, bool fuse_weights) {
    Config c = default_config();
    c.precision.recipe = recipe;
    c.step = step;
    c.row_align = 32;
    c.router.fuse_weights = fuse_weights;
    std::string found;
    for (const std::string& line : plan_step(step_graphs_options(c)).kernels)
      if (line.starts_with("swiglu")) {
        EXPECT_TRUE(found.empty()) << "two SwiGLU lines: " << found << " / " << line;
        found = line;
      }
    return found;
  };
  const std::string plain_forward = "forward silu(gate) * up, 8 x 16-bit per thread";
  const std::string bf16 = swiglu_line(Recipe::kBF16, StepKind::kMoeLayer, false);
  EXPECT_TRUE(bf16.starts_with("swiglu: " + plain_forward)) << bf16;
  EXPECT_NE(bf16.find("; backward 8 x 16-bit per thread"), std::string::npos) << bf16;
  const std::string mx = swiglu_line(Recipe::kMXFP8, StepKind::kMoeLayer, false);
  EXPECT_TRUE(mx.starts_with("swiglu: forward in fc2's MXFP8 quantizer")) << mx;
  EXPECT_NE(mx.find("; backward in fc1's MXFP8 quantizer"), std::string::npos) << mx;
  for (Recipe recipe : {Recipe::kBF16, Recipe::kMXFP8}) {
    const std::string fused = swiglu_line(recipe, StepKind::kMoeLayer, true);
    EXPECT_TRUE(fused.starts_with("swiglu_weighted: forward ")) << fused;
    EXPECT_NE(fused.find("w_row * silu(gate) * up"), std::string::npos) << fused;
    EXPECT_NE(fused.find("; backward a group of lanes per row, its weight gradient"), std::string::npos) << fused;
    const std::string experts = swiglu_line(recipe, StepKind::kExperts, false);
    EXPECT_TRUE(experts.starts_with("swiglu: " + plain_forward)) << experts;
  }
}

// One translation of layer options into the experts' GroupedLinearOptions, training or not.
TEST(StepPlan, ExpertLinearOptionsFollowTraining) {
  MoeLayerOptions o;
  o.experts = 8, o.hidden = 256, o.ffn = 128, o.top_k = 2, o.max_tokens = 64;
  o.training = false, o.wgrad_slots = 4, o.delay_wgrad = false;
  const GroupedLinearOptions inference = layer::expert_linear_options(o, 1, 256);
  EXPECT_EQ(inference.wgrad_slots, 1);
  EXPECT_FALSE(inference.delay_wgrad);
  EXPECT_EQ(inference.out_features, 256);
  o.training = true, o.delay_wgrad = true;
  const GroupedLinearOptions training = layer::expert_linear_options(o, 2, 256);
  EXPECT_EQ(training.wgrad_slots, 4);
  EXPECT_TRUE(training.delay_wgrad);
  EXPECT_EQ(training.in_features, 128);
  EXPECT_THROW(layer::expert_linear_options(o, 3, 256), Error);
}

}  // namespace
}  // namespace moegraph::test
