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

// e4m3 bytes with dims[0] contiguous (strides in bytes for dims 1...), a box of 128 bytes x box_rows.
template <int kRank>
CUtensorMap encode_bytes(const GemmPlan& plan, const void* base, const uint64_t (&dims)[kRank],
                         const uint64_t (&strides)[kRank - 1], uint32_t box_rows) {
  uint32_t box[kRank];
  for (int i = 0; i < kRank; ++i) box[i] = 1;
  box[0] = s::BK, box[1] = box_rows;
  return encode_sw128_map(plan.encode_tensor_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, kRank, base, dims, strides, box);
}

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
  const uint64_t red = static_cast<uint64_t>(p.k), cols = static_cast<uint64_t>(p.n);
  tp.a = encode_bytes<2>(plan, p.a, {red, static_cast<uint64_t>(p.capacity_rows)}, {red}, s::BR);
  tp.b = encode_bytes<3>(plan, p.b, {red, cols, static_cast<uint64_t>(p.num_groups)}, {red, cols * red}, s::BM);
  with_kernel(plan.config, [&](auto kernel) { kernel<<<plan.grid, s::THREADS, s::kSmemBytes, stream>>>(tp); });
  MG_LAUNCH_CHECK();
}

}  // namespace moegraph::kernels
