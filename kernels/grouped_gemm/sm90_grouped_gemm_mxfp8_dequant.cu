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
  const uint64_t red = static_cast<uint64_t>(p.k), cols = static_cast<uint64_t>(p.n);
  const uint64_t capacity = static_cast<uint64_t>(p.capacity_rows), groups = static_cast<uint64_t>(p.num_groups);
  {
    const uint64_t dims[2] = {red, capacity}, strides[1] = {red};
    const uint32_t box[2] = {d::BK, d::BM};
    tp.a = encode_sw128_map(plan.encode_tensor_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, p.a, dims, strides, box);
  }
  {
    const uint64_t dims[3] = {red, cols, groups}, strides[2] = {red, cols * red};
    const uint32_t box[3] = {d::BK, d::BN, 1};
    tp.b = encode_sw128_map(plan.encode_tensor_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, p.b, dims, strides, box);
  }
  {
    const uint64_t dims[2] = {cols, capacity}, strides[1] = {cols * 2};
    const uint32_t box[2] = {64, tma_gemm::kBoxRows};
    const auto type = plan.config.dtype == DType::kFP16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    tp.c = encode_sw128_map(plan.encode_tensor_map, type, 2, p.c, dims, strides, box);
  }
  with_kernel(plan.config, [&](auto kernel) { kernel<<<plan.grid, d::THREADS, d::kSmemBytes, stream>>>(tp); });
  MG_LAUNCH_CHECK();
}

}  // namespace moegraph::kernels
