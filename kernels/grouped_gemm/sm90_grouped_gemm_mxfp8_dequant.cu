// The MXFP8 kernels that dequantize to bf16 on chip (sm_90a; bf16 and fp16 outputs; fprop and
// dgrad) and their tensor maps (sm90_tensor_maps.hpp).
#include "kernels/common/dtype_dispatch.cuh"
#include "kernels/common/kernel_setup.cuh"
#include "kernels/grouped_gemm/gemm_families.hpp"
#include "kernels/grouped_gemm/sm90_grouped_gemm_mxfp8_dequant.cuh"
#include "kernels/grouped_gemm/sm90_tensor_maps.hpp"
#include "moegraph/error.hpp"

namespace moegraph::kernels {

namespace {
namespace d = mxfp8_dequant;

template <class F>
void with_kernel(const GemmConfig& config, F&& f) {
  with_16bit_type(config.dtype, "MXFP8 dequantizing GEMM", [&](auto t) { f(d::ragged_gemm_kernel<decltype(t)>); });
}
}  // namespace

GemmConfig mxfp8_dequant_config(GemmPhase phase, DType out) {
  MG_CHECK(phase != GemmPhase::kWgrad, "the MXFP8 dequantizing kernel runs fprop and dgrad");
  return {phase, GemmFamily::kMxfp8Dequant, out, d::BM, d::BN, d::BK, d::STAGES, d::THREADS, false};
}

int prepare_mxfp8_dequant(const GemmConfig& config, void** encode_tensor_map) {
  *encode_tensor_map = tensor_map_encoder();
  int blocks = 0;
  with_kernel(config, [&](auto kernel) { blocks = allow_smem_and_measure(kernel, d::THREADS, d::kSmemBytes); });
  return blocks;
}

void launch_mxfp8_dequant(const GemmPlan& plan, const Mxfp8RaggedGemmParams& p, cudaStream_t stream) {
  MG_CHECK(p.capacity_rows > 0 && p.capacity_rows < (int64_t{1} << 31),
           "the MXFP8 dequantizing GEMM needs capacity_rows in [1, 2^31), got ", p.capacity_rows);
  MG_CHECK(p.num_groups <= (1 << 15) && p.n <= (int64_t{1} << 31) - d::BN && p.k < (int64_t{1} << 31),
           "the MXFP8 dequantizing GEMM's tensor coordinates must fit 32 bits");
  d::Params tp;
  tp.p = p;
  void* const enc = plan.encode_tensor_map;
  constexpr auto kBytes = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  tp.a = encode_rows_map(enc, kBytes, 1, p.a, p.capacity_rows, p.k, d::BK, d::BM);
  tp.b = encode_grouped_map(enc, kBytes, 1, p.b, p.num_groups, p.n, p.k, d::BK, d::BN);
  tp.c = encode_rows_map(enc, tensor_map_type_16bit(plan.config.dtype), 2, p.c, p.capacity_rows, p.n, 64,
                         tma_gemm::kBoxRows);
  with_kernel(plan.config, [&](auto kernel) { kernel<<<plan.grid, d::THREADS, d::kSmemBytes, stream>>>(tp); });
  MG_LAUNCH_CHECK();
}

}  // namespace moegraph::kernels
