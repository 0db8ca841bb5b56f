// The staged MXFP8 route: the operands dequantized to bf16 in device scratch, then the 16-bit TMA
// kernel of the config's tile. Why a route that spends bytes: on Hopper, faithful per-32 scaling
// on the E4M3 tensor cores costs instructions per output, and dequantizing on chip costs about 8
// instructions per pair of elements loaded; both ran at 0.3-0.5x bf16 on groups of hundreds of rows
// (docs/PERF.md, "MXFP8 dequantized on chip"). A pass through memory costs about 3 bytes per
// element (read 1 + 1/32, write 2), which is small against the GEMM's work once a group holds many
// rows, and the bf16 kernel then runs at its own rate.
//
// The values multiplied are the MXFP8 values: E4M3 x 2^(s - 127) is exact in bf16 (4 significant
// bits) unless it falls below bf16's normal range, where it is rounded to nearest even, as the
// dequantizing kernel does; products and sums are fp32 as in every route.
//
// fprop and dgrad: A [capacity_rows, red] once, then the weights a run of experts at a time (as many
// as the given scratch holds past A: mxfp8_staging_bytes sizes runs of up to kStagedWeightBytes,
// and an operator that gives the larger buffer another phase needs gets longer runs), each run
// followed by the bf16 kernel on those experts' groups (offsets are absolute rows, so a run is the
// same kernel on a shorter list of groups). dgrad reads W^T [G, K, N], so it is the fprop kernel
// with the roles of N and K exchanged.
//
// The values multiplied overflow to Inf where the dequantized value passes bf16's (and fp32's)
// range, scale bytes of about 248 and up, as in the reference rule.
//
// A's values may also arrive staged (Mxfp8RaggedGemmParams::a_staged): the operators have the
// quantizer write them in the pass that makes x's or dy's copies, instead of codes read back here.
//
// A config with dequantized_weights reads B's values from b_dequantized, dequantized once per
// weight update by the same rule (launch_dequantize_mxfp8_weights), so the products are the same
// and each call stages A alone, then runs the bf16 kernel once over every group.
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels/common/alignment.hpp"
#include "kernels/grouped_gemm/gemm_families.hpp"
#include "kernels/quantize/mxfp8.hpp"
#include "moegraph/error.hpp"

namespace moegraph::kernels {
namespace {

constexpr std::size_t kAlign = 256;  // each staged operand starts aligned (TMA needs 16 bytes)
constexpr std::size_t kMaxBytes = std::size_t{1} << 48;

// a * b * c bytes, refused past kMaxBytes (inputs are non-negative).
std::size_t bytes_of(int64_t a, int64_t b, int64_t c) {
  MG_CHECK(a >= 0 && b >= 0 && c >= 0, "MXFP8 staging: negative extent ", a, " x ", b, " x ", c);
  unsigned __int128 v = static_cast<unsigned __int128>(a) * static_cast<unsigned __int128>(b);
  v *= static_cast<unsigned __int128>(c);
  MG_CHECK(v <= kMaxBytes, "MXFP8 staging: ", a, " x ", b, " x ", c, " bytes are more than 2^48");
  return static_cast<std::size_t>(v);
}
std::size_t aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Experts whose weights fit `bytes` (at least one, at most all).
int experts_fitting(std::size_t bytes, int groups, int64_t n, int64_t k) {
  const std::size_t per_expert = aligned(bytes_of(n, k, 2));
  return static_cast<int>(std::max<std::size_t>(1, std::min<std::size_t>(bytes / per_expert, groups)));
}

// The bf16 kernel this route launches: dgrad runs the fprop kernel over W^T.
GemmConfig inner_config(GemmConfig config) {
  config.family = GemmFamily::kTma16;
  if (config.phase == GemmPhase::kDgrad) config.phase = GemmPhase::kFprop;
  return config;
}

GemmPlan inner_plan(const GemmPlan& plan) {
  GemmPlan inner = plan;
  inner.config = inner_config(plan.config);
  return inner;
}

void check_staging(std::size_t need, const void* staging, std::size_t given, const char* who) {
  MG_CHECK(staging != nullptr && reinterpret_cast<std::uintptr_t>(staging) % kAlign == 0 && given >= need, who,
           ": the staged route needs ", need, " bytes of 256-byte aligned device scratch (staging), got ", given,
           " bytes at ", staging);
}

}  // namespace

GemmConfig mxfp8_staged_config(GemmPhase phase, DType out, int tile_n, bool ping_pong, bool into_main_grad) {
  MG_CHECK(out == DType::kBF16, "the staged MXFP8 route needs bf16 outputs (the 16-bit kernels read and write one "
           "type, and the dequantized values fit bf16, not fp16); got ", dtype_name(out));
  GemmConfig c =
      tma_gemm_config(phase == GemmPhase::kDgrad ? GemmPhase::kFprop : phase, out, tile_n, ping_pong, into_main_grad);
  c.phase = phase;
  c.family = GemmFamily::kMxfp8Staged;
  return c;
}

int prepare_mxfp8_staged(const GemmConfig& config, void** encode_tensor_map) {
  return prepare_tma_gemm(inner_config(config), encode_tensor_map);
}

std::size_t mxfp8_staging_bytes(const GemmConfig& config, int groups, int64_t capacity_rows, int64_t n, int64_t k,
                                int experts_per_run) {
  if (config.family == GemmFamily::kMxfp8SwapAb) return mxfp8_swap_ab_split_bytes(groups, capacity_rows, n);
  if (config.family != GemmFamily::kMxfp8Staged) return 0;
  MG_CHECK(groups >= 1 && experts_per_run >= 0 && n >= 1 && k >= 1,
           "MXFP8 staging: needs groups, n and k >= 1 and experts_per_run >= 0, got ", groups, ", ", n, ", ", k,
           " and ", experts_per_run);
  if (config.phase == GemmPhase::kWgrad) return mxfp8_staged_wgrad_bytes(capacity_rows, n, k, false);
  if (config.dequantized_weights) return aligned(bytes_of(capacity_rows, k, 2));
  const int run = experts_per_run > 0 ? std::min(experts_per_run, groups)
                                      : experts_fitting(kStagedWeightBytes, groups, n, k);
  const std::size_t bytes =
      aligned(bytes_of(capacity_rows, k, 2)) + bytes_of(run, static_cast<int64_t>(aligned(bytes_of(n, k, 2))), 1);
  MG_CHECK(bytes <= kMaxBytes, "MXFP8 staging: ", bytes, " bytes are more than 2^48");
  return bytes;
}

std::size_t mxfp8_staged_wgrad_bytes(int64_t capacity_rows, int64_t n, int64_t k, bool dy_values) {
  const std::size_t x_bytes = aligned(bytes_of(capacity_rows, k, 2));
  const std::size_t bytes = x_bytes + (dy_values ? 0 : aligned(bytes_of(capacity_rows, n, 2)));
  MG_CHECK(bytes <= kMaxBytes, "MXFP8 staging: ", bytes, " bytes are more than 2^48");
  return bytes;
}

void launch_mxfp8_staged(const GemmPlan& plan, const Mxfp8RaggedGemmParams& p, cudaStream_t stream) {
  constexpr const char* kWho = "launch_mxfp8_ragged_gemm (staged)";
  check_staging(mxfp8_staging_bytes(plan.config, p.num_groups, p.capacity_rows, p.n, p.k, 1), p.staging,
                p.staging_bytes, kWho);
  MG_CHECK(p.capacity_rows > 0, kWho, ": needs capacity_rows");
  // The weights this plan reads, checked before anything is enqueued.
  if (plan.config.dequantized_weights)
    MG_CHECK(p.b_dequantized != nullptr && aligned16(p.b_dequantized), kWho,
             ": this plan reads the weights' kept bf16 values (dequantized_weights): b_dequantized must be a "
             "16-byte aligned device pointer");
  else
    MG_CHECK(p.b != nullptr && p.b_scales != nullptr, kWho, ": needs b and b_scales");
  MG_CHECK(p.a_staged || (p.a != nullptr && p.a_scales != nullptr), kWho,
           ": needs a and a_scales, or A's bf16 values at the start of staging (a_staged)");
  auto* a16 = static_cast<std::byte*>(p.staging);
  const std::size_t a_bytes = aligned(bytes_of(p.capacity_rows, p.k, 2));
  auto* w16 = a16 + a_bytes;
  if (!p.a_staged)
    launch_dequantize_mxfp8_rowwise(p.a, p.a_scales, DType::kBF16, a16, p.capacity_rows, p.k, p.offsets,
                                    p.num_groups, stream);
  const GemmPlan inner = inner_plan(plan);
  RaggedGemmParams q;
  q.a = a16, q.n = p.n, q.k = p.k;
  q.bias_scale = p.bias_scale, q.c = p.c, q.capacity_rows = p.capacity_rows;
  if (plan.config.dequantized_weights) {
    q.w = p.b_dequantized, q.splits = p.splits, q.offsets = p.offsets, q.num_groups = p.num_groups, q.bias = p.bias;
    launch_tma_gemm(inner, q, stream);
    return;
  }
  const int run = experts_fitting(p.staging_bytes - a_bytes, p.num_groups, p.n, p.k);
  const int64_t expert = p.n * p.k;  // elements of one expert's weights
  for (int e0 = 0; e0 < p.num_groups; e0 += run) {
    const int experts = std::min(run, p.num_groups - e0);
    launch_dequantize_mxfp8_weights(p.b + e0 * expert, p.b_scales + e0 * expert / kMxBlock, w16, experts * p.n, p.k,
                                    stream);
    q.w = w16;
    q.splits = p.splits + e0, q.offsets = p.offsets + e0, q.num_groups = experts;
    q.bias = p.bias != nullptr ? static_cast<const uint16_t*>(p.bias) + e0 * p.n : nullptr;
    launch_tma_gemm(inner, q, stream);
  }
}

void launch_mxfp8_staged_wgrad(const GemmPlan& plan, const Mxfp8WgradParams& p, cudaStream_t stream) {
  constexpr const char* kWho = "launch_mxfp8_wgrad (staged)";
  const bool dy_made = p.dy_values != nullptr;
  check_staging(mxfp8_staged_wgrad_bytes(p.capacity_rows, p.n, p.k, dy_made), p.staging, p.staging_bytes, kWho);
  MG_CHECK(!dy_made || aligned16(p.dy_values), kWho,
           ": dy_values must be a 16-byte aligned device pointer");
  MG_CHECK(dy_made || (p.dy_t != nullptr && p.dy_t_scales != nullptr), kWho,
           ": needs dy_t and dy_t_scales, or dy's bf16 values (dy_values)");
  MG_CHECK(p.x_t != nullptr && p.x_t_scales != nullptr, kWho, ": needs x_t and x_t_scales");
  // x's values first: with dy's made, they are all the staging holds.
  auto* x16 = static_cast<std::byte*>(p.staging);
  auto* dy16 = x16 + aligned(bytes_of(p.capacity_rows, p.k, 2));
  if (!dy_made)
    launch_dequantize_mxfp8_colwise(p.dy_t, p.dy_t_scales, DType::kBF16, dy16, p.capacity_rows, p.n, p.offsets,
                                    p.num_groups, stream);
  launch_dequantize_mxfp8_colwise(p.x_t, p.x_t_scales, DType::kBF16, x16, p.capacity_rows, p.k, p.offsets,
                                  p.num_groups, stream);
  WgradParams q;
  q.dy = dy_made ? p.dy_values : dy16, q.x = x16, q.n = p.n, q.k = p.k;
  q.splits = p.splits, q.offsets = p.offsets, q.num_groups = p.num_groups;
  q.dweight = p.dweight, q.main_grad = p.main_grad, q.capacity_rows = p.capacity_rows;
  launch_tma_wgrad(inner_plan(plan), q, stream);
}

}  // namespace moegraph::kernels
