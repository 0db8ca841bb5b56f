// The 16-bit wgmma kernels fed by cp.async (sm_90a): fprop, dgrad and wgrad on 128- and 256-wide
// tiles, bf16 and fp16; only these variants are instantiated.
#include "kernels/common/dtype_dispatch.cuh"
#include "kernels/common/kernel_setup.cuh"
#include "kernels/grouped_gemm/gemm_families.hpp"
#include "kernels/grouped_gemm/sm90_grouped_gemm_16bit_cp_async.cuh"

namespace moegraph::kernels {

namespace {
namespace c = cp_async_gemm;

template <class Tile>
GemmConfig config_of(GemmPhase phase, DType dtype) {
  return {phase, GemmFamily::kCpAsync16, dtype, c::BM, Tile::BN, c::BK, Tile::STAGES, c::THREADS};
}

// Calls f(T{}, Tile{}) for the plan's 16-bit type and tile width.
template <class F>
void with_kernel_types(const GemmConfig& config, F&& f) {
  with_16bit_type(config.dtype, "grouped GEMM", [&](auto t) {
    if (config.block_n == 256) f(t, c::Tile256{});
    else f(t, c::Tile128{});
  });
}

}  // namespace

GemmConfig cp_async_gemm_config(GemmPhase phase, DType dtype, int tile_n) {
  return tile_n == 256 ? config_of<c::Tile256>(phase, dtype) : config_of<c::Tile128>(phase, dtype);
}

int prepare_cp_async_gemm(const GemmConfig& config) {
  int blocks = 0;
  with_kernel_types(config, [&](auto t, auto tile) {
    using T = decltype(t);
    using Tile = decltype(tile);
    auto measure = [&](auto kernel) { blocks = allow_smem_and_measure(kernel, c::THREADS, Tile::kSmemBytes); };
    switch (config.phase) {
      case GemmPhase::kFprop: measure(c::ragged_gemm_kernel<T, Tile, false>); break;
      case GemmPhase::kDgrad: measure(c::ragged_gemm_kernel<T, Tile, true>); break;
      case GemmPhase::kWgrad: measure(c::grouped_wgrad_kernel<T, Tile>); break;
    }
  });
  return blocks;
}

void launch_cp_async_gemm(const GemmPlan& plan, const RaggedGemmParams& p, cudaStream_t stream) {
  with_kernel_types(plan.config, [&](auto t, auto tile) {
    using T = decltype(t);
    using Tile = decltype(tile);
    if (plan.config.phase == GemmPhase::kDgrad)
      c::ragged_gemm_kernel<T, Tile, true><<<plan.grid, c::THREADS, Tile::kSmemBytes, stream>>>(p);
    else
      c::ragged_gemm_kernel<T, Tile, false><<<plan.grid, c::THREADS, Tile::kSmemBytes, stream>>>(p);
  });
  MG_LAUNCH_CHECK();
}

void launch_cp_async_wgrad(const GemmPlan& plan, const WgradParams& p, cudaStream_t stream) {
  with_kernel_types(plan.config, [&](auto t, auto tile) {
    using T = decltype(t);
    using Tile = decltype(tile);
    c::grouped_wgrad_kernel<T, Tile><<<plan.grid, c::THREADS, Tile::kSmemBytes, stream>>>(p);
  });
  MG_LAUNCH_CHECK();
}

}  // namespace moegraph::kernels
