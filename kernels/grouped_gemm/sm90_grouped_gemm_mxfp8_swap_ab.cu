// The MXFP8 swap-AB kernels (sm_90a; bf16 and fp16 outputs; fprop and dgrad) and their tensor maps
// (e4m3 bytes, 128-byte swizzle; sm90_tensor_maps.hpp).
#include "kernels/common/dtype_dispatch.cuh"
#include "kernels/common/kernel_setup.cuh"
#include "kernels/grouped_gemm/gemm_families.hpp"
#include "kernels/grouped_gemm/sm90_grouped_gemm_mxfp8_swap_ab.cuh"
#include "kernels/grouped_gemm/sm90_tensor_maps.hpp"
#include "moegraph/error.hpp"

namespace moegraph::kernels {

namespace {
namespace s = mxfp8_swap_ab;

template <class F>
void with_kernel(const GemmConfig& config, F&& f) {
  with_16bit_type(config.dtype, "MXFP8 swap-AB GEMM", [&](auto t) { f(s::ragged_gemm_kernel<decltype(t)>); });
}
}  // namespace

GemmConfig mxfp8_swap_ab_config(GemmPhase phase, DType out) {
  MG_CHECK(phase != GemmPhase::kWgrad, "the MXFP8 swap-AB kernel runs fprop and dgrad");
  return {phase, GemmFamily::kMxfp8SwapAb, out, s::BM, s::BR, s::BK, s::STAGES, s::THREADS, true};
}

int prepare_mxfp8_swap_ab(const GemmConfig& config, void** encode_tensor_map) {
  *encode_tensor_map = tensor_map_encoder();
  int blocks = 0;
  with_kernel(config, [&](auto kernel) { blocks = allow_smem_and_measure(kernel, s::THREADS, s::kSmemBytes); });
  return blocks;
}

void launch_mxfp8_swap_ab(const GemmPlan& plan, const Mxfp8RaggedGemmParams& p, cudaStream_t stream) {
  MG_CHECK(p.capacity_rows > 0 && p.capacity_rows < (int64_t{1} << 31),
           "the MXFP8 swap-AB GEMM needs capacity_rows in [1, 2^31), got ", p.capacity_rows);
  MG_CHECK(p.num_groups <= (1 << 15) && p.n <= (int64_t{1} << 31) - s::BM,
           "the MXFP8 swap-AB GEMM's tensor coordinates must fit 32 bits");
  s::Params tp;
  tp.p = p;
  // E4M3 bytes in boxes of 128 bytes of the reduction x the tile's rows.
  constexpr auto kBytes = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  tp.a = encode_rows_map(plan.encode_tensor_map, kBytes, 1, p.a, p.capacity_rows, p.k, s::BK, s::BR);
  tp.b = encode_grouped_map(plan.encode_tensor_map, kBytes, 1, p.b, p.num_groups, p.n, p.k, s::BK, s::BM);
  with_kernel(plan.config, [&](auto kernel) { kernel<<<plan.grid, s::THREADS, s::kSmemBytes, stream>>>(tp); });
  MG_LAUNCH_CHECK();
}

}  // namespace moegraph::kernels
