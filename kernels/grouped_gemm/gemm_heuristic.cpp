// The grouped GEMM heuristic: a GemmProblem and the overrides in, a printable GemmConfig out. The
// rules come from measurements (docs/PERF.md); every choice can be forced for tuning.
#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <string>

#include "kernels/grouped_gemm/gemm_families.hpp"
#include "moegraph/error.hpp"

namespace moegraph::kernels {

std::string_view gemm_phase_name(GemmPhase phase) {
  switch (phase) {
    case GemmPhase::kFprop: return "fprop";
    case GemmPhase::kDgrad: return "dgrad";
    case GemmPhase::kWgrad: return "wgrad";
  }
  return "?";
}

std::string_view gemm_family_name(GemmFamily family) {
  switch (family) {
    case GemmFamily::kReference: return "wmma_cp_async";
    case GemmFamily::kCpAsync16: return "wgmma_cp_async_sw128";
    case GemmFamily::kTma16: return "wgmma_tma_ws_sw128";
    case GemmFamily::kMxfp8CpAsync: return "wgmma_e4m3_cp_async_sw128";
    case GemmFamily::kMxfp8SwapAb: return "wgmma_e4m3_swap_ab_tma_ws_sw128";
    case GemmFamily::kMxfp8Dequant: return "wgmma_bf16_from_mxfp8_tma_ws_sw128";
    case GemmFamily::kMxfp8Staged: return "mxfp8_staged_bf16_wgmma_tma_ws_sw128";
  }
  return "?";
}

std::string GemmConfig::to_string() const {
  std::ostringstream os;
  os << gemm_family_name(family) << " " << block_m << "x" << block_n << "x" << block_k << " stages=" << stages
     << " threads=" << threads;
  if (family == GemmFamily::kMxfp8CpAsync) os << " per-32 scale promotion" << (ping_pong ? ", ping-pong partials" : "");
  if (family == GemmFamily::kMxfp8SwapAb)
    os << " (weight rows x group rows) per-32 scale promotion, ping-pong partials, reductions split when tiles are "
          "few, 8 stages and one CTA per SM when they are at most one per SM";
  if (family == GemmFamily::kMxfp8Dequant) os << " e4m3 dequantized to bf16 in shared memory";
  if (family == GemmFamily::kMxfp8Staged)
    os << (dequantized_weights ? " on the weights' kept bf16 values and activations dequantized in scratch"
                               : " on operands dequantized to bf16 in scratch")
       << (ping_pong ? ", ping-pong consumers" : "");
  if (family == GemmFamily::kTma16 && ping_pong) os << " ping-pong consumers";
  if (into_main_grad) os << ", main_grad streamed through a ring of quarter tiles";
  return os.str();
}

GemmOverrides with_environment(GemmOverrides o) {
  if (const char* env = std::getenv("MOEGRAPH_TILE_N"); env != nullptr && o.tile_n == 0) {
    const std::string v = env;
    MG_CHECK(v == "128" || v == "256", "MOEGRAPH_TILE_N must be 128 or 256, got '", v, "'");
    o.tile_n = std::stoi(v);
  }
  if (const char* env = std::getenv("MOEGRAPH_GEMM_PIPELINE"); env != nullptr && o.pipeline == GemmPipeline::kAuto) {
    const std::string v = env;
    MG_CHECK(v == "tma" || v == "cp_async", "MOEGRAPH_GEMM_PIPELINE must be tma or cp_async, got '", v, "'");
    o.pipeline = v == "tma" ? GemmPipeline::kTma : GemmPipeline::kCpAsync;
  }
  if (const char* env = std::getenv("MOEGRAPH_MXFP8_PINGPONG"); env != nullptr && o.mxfp8_ping_pong < 0) {
    const std::string v = env;
    MG_CHECK(v == "0" || v == "1", "MOEGRAPH_MXFP8_PINGPONG must be 0 or 1, got '", v, "'");
    o.mxfp8_ping_pong = v == "1";
  }
  MG_CHECK(std::getenv("MOEGRAPH_MXFP8_SWAP_AB") == nullptr,
           "MOEGRAPH_MXFP8_SWAP_AB was replaced by MOEGRAPH_MXFP8_ROUTE=e4m3|swap_ab|dequant|staged");
  if (const char* env = std::getenv("MOEGRAPH_MXFP8_ROUTE"); env != nullptr && o.mxfp8_route == Mxfp8Route::kAuto) {
    const std::string v = env;
    MG_CHECK(v == "e4m3" || v == "swap_ab" || v == "dequant" || v == "staged",
             "MOEGRAPH_MXFP8_ROUTE must be e4m3, swap_ab, dequant or staged, got '", v, "'");
    o.mxfp8_route = v == "e4m3"      ? Mxfp8Route::kE4m3
                    : v == "swap_ab" ? Mxfp8Route::kSwapAb
                    : v == "dequant" ? Mxfp8Route::kDequant
                                     : Mxfp8Route::kStaged;
  }
  if (const char* env = std::getenv("MOEGRAPH_WGRAD_PINGPONG"); env != nullptr && o.wgrad_ping_pong < 0) {
    const std::string v = env;
    MG_CHECK(v == "0" || v == "1", "MOEGRAPH_WGRAD_PINGPONG must be 0 or 1, got '", v, "'");
    o.wgrad_ping_pong = v == "1";
  }
  return o;
}

namespace {

// The wide tile (128 x 256) pays off for wgrad when every group holds many rows (long reductions)
// and the output is wide. For fprop and dgrad it reads each row of A once per 256 output columns
// instead of once per 128, and it pays:
// - whatever the group sizes once the output is at least kWideMinCols = 1536 wide: measured equal or
//   faster on every such shape, from decode's 6-row groups to 500-row ones, and 8-12% faster under
//   skewed routing (H100; docs/PERF.md, "Wide tiles for fine-grained fprop and dgrad");
// - on outputs from kNarrowWideMinCols = 768 when groups average kNarrowWideMinRows = 64 rows or
//   more, where A's re-reads weigh: on one H200, 2-21% faster at 64-256 rows a group (outputs of
//   768 and 1024, reductions of 2048 to 7168, both routings); at 12 rows a group (output 1408) 4%
//   faster under uniform routing and 5% slower under skew (docs/PERF.md, "What a copy can reach,
//   ping-pong fprop and dgrad, and 256-wide tiles on narrower outputs"). On an H100, with older kernels, 768 and 1024 had lost 2-4%
//   under uniform routing at 128-256 rows a group.
// Narrower outputs were not measured and keep 128. Unless the wide tiles are too few to fill the GPU:
// a one-token decode bucket (6 rows, so at most 6 experts) has 66 of them for 132 SMs and ran 3%
// slower, so at least kWideMinTiles (about two per SM) are asked of the rows the bucket can hold.
constexpr int64_t kWideMinCols = 1536, kNarrowWideMinCols = 768, kNarrowWideMinRows = 64, kWideMinTiles = 256;

// wgrad into bf16 dW of groups of a few dozen to a few hundred rows: the shared 128 x 256 tile. Its
// epilogue only stores (the tensor stores drain under the next tile), so nothing there waits on
// memory, and it reads 1.5 operand bytes from L2 per output element against the 128 x 128 tile's 2;
// the ping-pong kernel's consumers wait mostly on their stages' loads (Nsight Compute, fine64). On one
// H200, each shape forced both ways in the same call (docs/PERF.md, "wgrad into dW: the shared wide
// tile from 24 rows a group"; time saved): 7-18% under uniform routing on every shape measured (24-500
// rows a group, K of 512-7168); under Zipf routing 4-14%, except 1-3% slower with K of 512-768 at
// 96-256 rows and 7% slower at 160 rows with K = 1024. Fewer rows and K under 512 were not measured and
// keep ping-pong. (On an H100, with older kernels, the bound was 160 rows and K = 1024: mixed at 40-128
// rows there, -8% to +13%.) Into fp32 main_grad every tile's epilogue waits for its main_grad boxes to
// load, which only ping-pong hides under the other warpgroup's MMAs: there the shared tile measured 2%
// faster to 29% slower (one H200), so main_grad keeps ping-pong.
constexpr int64_t kSharedDwMinRows = 24, kSharedDwMinK = 512;
bool shared_wide_dweight(const GemmProblem& p) {
  return p.phase == GemmPhase::kWgrad && !p.into_main_grad && p.expected_rows_per_group >= kSharedDwMinRows &&
         p.expected_rows_per_group < 512 && p.k >= kSharedDwMinK;
}

int heuristic_tile_n(const GemmProblem& p) {
  const int64_t out_cols = p.phase == GemmPhase::kFprop ? p.n : p.k;
  if (p.phase == GemmPhase::kWgrad)
    return (p.expected_rows_per_group >= 512 && out_cols >= 2048) || shared_wide_dweight(p) ? 256 : 128;
  const int64_t busy_groups = std::min<int64_t>(p.groups, p.capacity_rows);  // a group with rows has one or more
  const int64_t row_tiles = std::max<int64_t>(1, (p.expected_rows_per_group + 127) / 128);
  const int64_t wide_tiles = busy_groups * ((out_cols + 255) / 256) * row_tiles;
  const int64_t min_cols = p.expected_rows_per_group >= kNarrowWideMinRows ? kNarrowWideMinCols : kWideMinCols;
  return out_cols >= min_cols && wide_tiles >= kWideMinTiles ? 256 : 128;
}

// Measured (docs/PERF.md, v5): TMA wins or ties everywhere except wgrad on the narrow tiles with
// shared consumer tiles, whose short tiles are epilogue-bound; the cp.async kernel runs two CTAs per
// SM there, so one CTA's epilogue hides under the other's loads. Since v6/v7 short wgrad reductions
// (under 512 rows per group, e.g. decode) take the ping-pong kernel before this rule is reached, so
// it decides wgrad of larger groups on narrow outputs and wgrad with ping-pong turned off.
GemmPipeline heuristic_pipeline(GemmPhase phase, int tile_n) {
  return phase == GemmPhase::kWgrad && tile_n == 128 ? GemmPipeline::kCpAsync : GemmPipeline::kTma;
}

// wgrad whose reductions are short (groups of a few hundred rows) is bound by writing dW or
// updating main_grad: the ping-pong consumers keep one tile's epilogue and stores under the other's
// MMAs. Measured on fine-grained shapes (docs/PERF.md, v7): into dW 0.55-0.84 of the roofline
// against 0.34-0.52 on cp.async; into fp32 main_grad 0.73-0.90 against 0.62-0.86. Into dW from 24
// rows a group the shared wide tile is faster still (shared_wide_dweight).
bool heuristic_wgrad_ping_pong(const GemmProblem& p) {
  return p.expected_rows_per_group < 512 && !shared_wide_dweight(p);
}

// MXFP8 fprop and dgrad of groups of few rows stream the weights for a handful of rows: the swap-AB
// kernel puts those rows on wgmma's N (32 at a time) and streams the weights by TMA, so its FP8
// weight bytes are its gain. Up to 64 rows a group it wins over every other route, kept bf16
// values included (decode: 1.5-2.0x bf16).
constexpr int64_t kSwapAbAlwaysMaxRowsPerGroup = 64;
// Past 64 rows a group takes one pass over its weights per 32 rows, and the per-32 promotions cost
// instructions per output; yet measured with each route forced in one call (one H200,
// docs/PERF.md, "MXFP8 routes on groups of 80-320 rows"; K 2048-7168, N 1024-2816, uniform and
// Zipf routings), swap-AB beat the E4M3 128-row tiles and the on-chip dequantizer at every size
// from 80 to 320 rows (1.12-1.68x faster than the faster of them), and the staged route up to 192
// rows; staged won from 256. The bounds sit at the crossover against staged (about 224 rows,
// interpolated) where the activations are bf16, and at the largest size measured otherwise.
constexpr int64_t kSwapAbMaxRowsPerGroupBf16 = 224, kSwapAbMaxRowsPerGroupOther = 320;
// Groups of many rows with long reductions, activations not bf16: the operands dequantized to
// bf16 on chip. Measured against the E4M3 128-row tiles in one session (docs/PERF.md, "MXFP8
// dequantized on chip"): 6-15% faster at 500-2048 rows a group (reductions 2048-7168).
constexpr int64_t kDequantMinRowsPerGroup = 384, kDequantMinReduction = 2048;
// Staged (bf16 activations only): the operands dequantized to bf16 through memory, then the bf16
// kernel. Its cost over bf16 is about 3 bytes per weight element for fprop and dgrad (the weights
// are dequantized every call) and 3 bytes per activation element for wgrad. Measured in one
// session against the on-chip routes (docs/PERF.md, "MXFP8 staged through bf16"): wgrad 0.78-0.91x
// bf16 against 0.28-0.35x on every shape from 80 to 2048 rows a group; fprop/dgrad 0.47-0.70x
// against 0.31-0.38x at 500-2048 rows. With the weights' values kept dequantized
// (dequantized_weights) its fprop and dgrad pay only for A in bf16: in an operator the quantizer
// writes its values (2 bytes per element) instead of codes (1 + 1/32), a byte per element of A
// against the bf16 kernel's work on the same rows, so it takes every group past 64 rows.
Mxfp8Route heuristic_mxfp8_route(const GemmProblem& p) {
  const bool bf16 = p.dtype == DType::kBF16;
  const int64_t rows = p.expected_rows_per_group;
  if (p.phase == GemmPhase::kWgrad) return bf16 ? Mxfp8Route::kStaged : Mxfp8Route::kE4m3;
  if (rows <= kSwapAbAlwaysMaxRowsPerGroup) return Mxfp8Route::kSwapAb;
  if (bf16) return p.dequantized_weights || rows > kSwapAbMaxRowsPerGroupBf16 ? Mxfp8Route::kStaged
                                                                              : Mxfp8Route::kSwapAb;
  if (rows <= kSwapAbMaxRowsPerGroupOther) return Mxfp8Route::kSwapAb;
  const int64_t reduction = p.phase == GemmPhase::kDgrad ? p.n : p.k;
  return rows >= kDequantMinRowsPerGroup && reduction >= kDequantMinReduction ? Mxfp8Route::kDequant
                                                                              : Mxfp8Route::kE4m3;
}

}  // namespace

GemmConfig choose_gemm_config(const GemmProblem& p, const GemmOverrides& o) {
  MG_CHECK(o.tile_n == 0 || o.tile_n == 128 || o.tile_n == 256, "tile_n must be 0 (automatic), 128 or 256, got ",
           o.tile_n);
  switch (p.recipe) {
    case Recipe::kMXFP8: {
      MG_CHECK(!o.reference, "the mxfp8 recipe has no reference (WMMA) kernels");
      // A forced route applies where it can run: staged needs bf16 activations.
      const bool forced = o.mxfp8_route != Mxfp8Route::kAuto &&
                          (o.mxfp8_route != Mxfp8Route::kStaged || p.dtype == DType::kBF16);
      switch (forced ? o.mxfp8_route : heuristic_mxfp8_route(p)) {
        case Mxfp8Route::kStaged: {  // the bf16 recipe's tile for the same problem, always on TMA (the
                                     // 128-wide wgrad of long reductions is cp.async in bf16)
          const bool ping_pong = p.phase == GemmPhase::kWgrad && o.tile_n != 256 &&
                                 (o.wgrad_ping_pong >= 0 ? o.wgrad_ping_pong == 1 : heuristic_wgrad_ping_pong(p));
          const int tile_n = ping_pong ? 128 : o.tile_n != 0 ? o.tile_n : heuristic_tile_n(p);
          GemmConfig c = mxfp8_staged_config(p.phase, p.dtype, tile_n, ping_pong, ping_pong && p.into_main_grad);
          c.dequantized_weights = p.dequantized_weights && p.phase != GemmPhase::kWgrad;
          return c;
        }
        case Mxfp8Route::kSwapAb:
          if (p.phase != GemmPhase::kWgrad) return mxfp8_swap_ab_config(p.phase, p.dtype);
          break;
        case Mxfp8Route::kDequant:
          if (p.phase != GemmPhase::kWgrad) return mxfp8_dequant_config(p.phase, p.dtype);
          break;
        case Mxfp8Route::kE4m3:
        case Mxfp8Route::kAuto: break;
      }
      // Two fp32 partials per block measured faster (docs/PERF.md).
      return mxfp8_gemm_config(p.phase, p.dtype, o.mxfp8_ping_pong != 0);
    }
    case Recipe::kBF16: {
      if (o.reference) return reference_gemm_config(p.phase, p.dtype);
      const bool ping_pong = p.phase == GemmPhase::kWgrad && o.tile_n != 256 && o.pipeline != GemmPipeline::kCpAsync &&
                             (o.wgrad_ping_pong >= 0 ? o.wgrad_ping_pong == 1 : heuristic_wgrad_ping_pong(p));
      if (ping_pong) return tma_gemm_config(p.phase, p.dtype, 128, true, p.into_main_grad);
      const int tile_n = o.tile_n != 0 ? o.tile_n : heuristic_tile_n(p);
      const GemmPipeline pipeline = o.pipeline != GemmPipeline::kAuto ? o.pipeline : heuristic_pipeline(p.phase, tile_n);
      switch (pipeline) {
        case GemmPipeline::kTma: return tma_gemm_config(p.phase, p.dtype, tile_n);
        case GemmPipeline::kCpAsync: return cp_async_gemm_config(p.phase, p.dtype, tile_n);
        case GemmPipeline::kAuto: break;
      }
      break;
    }
  }
  MG_FAIL("no grouped GEMM kernel for recipe ", recipe_name(p.recipe), " and ", gemm_phase_name(p.phase));
}

}  // namespace moegraph::kernels
