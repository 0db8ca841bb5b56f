// The MXFP8 swap-AB kernels (sm_90a; bf16 and fp16 outputs; fprop and dgrad) and their tensor maps
// (e4m3 bytes, 128-byte swizzle; sm90_tensor_maps.hpp).
#include <algorithm>
#include <cstdint>

#include "kernels/common/dtype_dispatch.cuh"
#include "kernels/common/kernel_setup.cuh"
#include "kernels/grouped_gemm/gemm_families.hpp"
#include "kernels/grouped_gemm/sm90_grouped_gemm_mxfp8_swap_ab.cuh"
#include "kernels/grouped_gemm/sm90_tensor_maps.hpp"
#include "moegraph/error.hpp"

namespace moegraph::kernels {

namespace {
namespace s = mxfp8_swap_ab;

template <bool kSplit, int kStages = s::STAGES, class F>
void with_kernel(const GemmConfig& config, F&& f) {
  with_16bit_type(config.dtype, "MXFP8 swap-AB GEMM",
                  [&](auto t) { f(s::ragged_gemm_kernel<decltype(t), kSplit, kStages>); });
}
}  // namespace

GemmConfig mxfp8_swap_ab_config(GemmPhase phase, DType out) {
  MG_CHECK(phase != GemmPhase::kWgrad, "the MXFP8 swap-AB kernel runs fprop and dgrad");
  return {phase, GemmFamily::kMxfp8SwapAb, out, s::BM, s::BR, s::BK, s::STAGES, s::THREADS, true};
}

int prepare_mxfp8_swap_ab(const GemmConfig& config, void** encode_tensor_map) {
  *encode_tensor_map = tensor_map_encoder();
  int blocks = 0, split_blocks = 0;
  with_kernel<false>(config, [&](auto kernel) { blocks = allow_smem_and_measure(kernel, s::THREADS, s::kSmemBytes); });
  with_kernel<true>(config,
                    [&](auto kernel) { split_blocks = allow_smem_and_measure(kernel, s::THREADS, s::kSmemBytes); });
  MG_CHECK(split_blocks == blocks, "the MXFP8 swap-AB kernels with and without splits differ in occupancy: ",
           blocks, " and ", split_blocks, " CTAs per SM");
  int deep_blocks = 0;
  with_kernel<false, s::kDeepStages>(config, [&](auto kernel) {
    deep_blocks = allow_smem_and_measure(kernel, s::threads_of(s::kDeepStages), s::smem_bytes(s::kDeepStages));
  });
  MG_CHECK(deep_blocks >= 1, "the MXFP8 swap-AB deep-ring kernel cannot be resident on this device");
  return blocks;
}

namespace {
// The most tiles a launch can have: a group of r rows takes ceil(r / 32) row tiles, so at most
// (rows + 31 * min(groups, rows)) / 32 of them, each times the weight tiles.
int64_t max_tiles(int groups, int64_t capacity_rows, int64_t n) {
  const int64_t row_tiles = (capacity_rows + (s::BR - 1) * std::min<int64_t>(groups, capacity_rows)) / s::BR;
  return row_tiles * ((n + s::BM - 1) / s::BM);
}
// The split kernel runs where every tile can have kMinSplits CTAs (of at most kSplitItemsCap).
bool may_split(int64_t tiles, int64_t ctas) {
  return tiles * s::kMinSplits <= std::min<int64_t>(ctas, s::kSplitItemsCap);
}
constexpr std::size_t kCounterBytes = (s::kSplitItemsCap * sizeof(unsigned) + 255) / 256 * 256;
constexpr std::size_t kSplitBytes =
    kCounterBytes + std::size_t{s::kSplitItemsCap} * s::kConsumerThreads * s::kPartialFloats * sizeof(float);

// The kernel a launch takes, from the host bound on its tiles: split reductions where every tile
// can have several CTAs, the deep ring where the tiles are at most one per SM (one CTA each), else
// the two-CTA kernel. The launcher and mxfp8_swap_ab_deep_ring both ask here.
enum class SwapAbKernel { kSplit, kDeepRing, kPlain };
SwapAbKernel choose_kernel(const GemmPlan& plan, int groups, int64_t capacity_rows, int64_t n) {
  const int64_t tiles = max_tiles(groups, capacity_rows, n);
  if (may_split(tiles, plan.grid)) return SwapAbKernel::kSplit;
  return tiles <= plan.sm_count ? SwapAbKernel::kDeepRing : SwapAbKernel::kPlain;
}
}  // namespace

bool mxfp8_swap_ab_deep_ring(const GemmPlan& plan, int groups, int64_t capacity_rows, int64_t n) {
  return choose_kernel(plan, groups, capacity_rows, n) == SwapAbKernel::kDeepRing;
}

std::size_t mxfp8_swap_ab_split_bytes(int groups, int64_t capacity_rows, int64_t n) {
  MG_CHECK(groups >= 1 && capacity_rows >= 0 && n >= 1, "MXFP8 swap-AB split scratch: needs groups and n >= 1 and ",
           "capacity_rows >= 0, got ", groups, ", ", n, " and ", capacity_rows);
  return may_split(max_tiles(groups, capacity_rows, n), s::kSplitItemsCap) ? kSplitBytes : 0;
}

void launch_mxfp8_swap_ab(const GemmPlan& plan, const Mxfp8RaggedGemmParams& p, cudaStream_t stream) {
  MG_CHECK(p.capacity_rows > 0 && p.capacity_rows < (int64_t{1} << 31),
           "the MXFP8 swap-AB GEMM needs capacity_rows in [1, 2^31), got ", p.capacity_rows);
  MG_CHECK(p.num_groups <= (1 << 15) && p.n <= (int64_t{1} << 31) - s::BM,
           "the MXFP8 swap-AB GEMM's tensor coordinates must fit 32 bits");
  MG_CHECK(p.a_scale_floats != nullptr && reinterpret_cast<std::uintptr_t>(p.a_scale_floats) % 16 == 0,
           "the MXFP8 swap-AB GEMM reads A's scales as floats: a_scale_floats must be a 16-byte aligned device ",
           "pointer (Mxfp8Rowwise::scale_floats)");
  MG_CHECK(reinterpret_cast<std::uintptr_t>(p.b_scales_tiled) % 16 == 0,
           "the MXFP8 swap-AB GEMM: b_scales_tiled must be 16-byte aligned (or null)");
  s::Params tp;
  tp.p = p;
  // E4M3 bytes in boxes of 128 bytes of the reduction x the tile's rows.
  constexpr auto kBytes = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  tp.a = encode_rows_map(plan.encode_tensor_map, kBytes, 1, p.a, p.capacity_rows, p.k, s::BK, s::BR);
  tp.b = encode_grouped_map(plan.encode_tensor_map, kBytes, 1, p.b, p.num_groups, p.n, p.k, s::BK, s::BM);
  // The split kernel where the tiles may be a quarter of the CTAs or fewer: its counters zeroed
  // here, in the launch's own stream order (a captured graph zeroes them on every replay).
  const SwapAbKernel which = choose_kernel(plan, p.num_groups, p.capacity_rows, p.n);
  if (which == SwapAbKernel::kSplit) {
    MG_CHECK(p.staging != nullptr && p.staging_bytes >= kSplitBytes, "the MXFP8 swap-AB GEMM of ", p.num_groups,
             " groups, ", p.capacity_rows, " rows and ", p.n, " columns needs ", kSplitBytes,
             " bytes of scratch (mxfp8_staging_bytes), got ", p.staging_bytes);
    tp.split_counters = static_cast<unsigned*>(p.staging);
    tp.split_partials = reinterpret_cast<float*>(static_cast<uint8_t*>(p.staging) + kCounterBytes);
    MG_CUDA_CHECK(cudaMemsetAsync(tp.split_counters, 0, kCounterBytes, stream));
    with_kernel<true>(plan.config,
                      [&](auto kernel) { kernel<<<plan.grid, s::THREADS, s::kSmemBytes, stream>>>(tp); });
  } else if (which == SwapAbKernel::kDeepRing) {
    // At most one tile per SM: one CTA each with the deeper ring (s::kDeepStages says why).
    with_kernel<false, s::kDeepStages>(plan.config, [&](auto kernel) {
      kernel<<<plan.sm_count, s::threads_of(s::kDeepStages), s::smem_bytes(s::kDeepStages), stream>>>(tp);
    });
  } else {
    with_kernel<false>(plan.config,
                       [&](auto kernel) { kernel<<<plan.grid, s::THREADS, s::kSmemBytes, stream>>>(tp); });
  }
  MG_LAUNCH_CHECK();
}

}  // namespace moegraph::kernels
