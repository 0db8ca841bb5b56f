// Instantiates the MXFP8 GEMMs (sm_90a) for bf16 and fp16 outputs, with and without ping-pong
// partials (MOEGRAPH_MXFP8_PINGPONG=0 selects the single-partial variant, for measurements).
#include <cstdlib>

#include "kernels/grouped_gemm/sm90_grouped_gemm_mxfp8.cuh"
#include "moegraph/error.hpp"

namespace moegraph::kernels {

namespace m = mxfp8_gemm;

namespace {
bool g_ping_pong = true;
template <class Kernel>
void allow(Kernel kernel) {
  MG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, m::kSmemBytes));
}
}  // namespace

void prepare_mxfp8_gemm() {
  const char* env = std::getenv("MOEGRAPH_MXFP8_PINGPONG");
  g_ping_pong = env == nullptr || std::atoi(env) != 0;
  allow(m::ragged_gemm_kernel<__nv_bfloat16, true>), allow(m::ragged_gemm_kernel<__half, true>);
  allow(m::ragged_gemm_kernel<__nv_bfloat16, false>), allow(m::ragged_gemm_kernel<__half, false>);
  allow(m::grouped_wgrad_kernel<__nv_bfloat16, true>), allow(m::grouped_wgrad_kernel<__half, true>);
  allow(m::grouped_wgrad_kernel<__nv_bfloat16, false>), allow(m::grouped_wgrad_kernel<__half, false>);
}

void launch_mxfp8_ragged_gemm(DType out, const Mxfp8RaggedGemmParams& p, int sm_count, cudaStream_t stream) {
  MG_CHECK(p.k > 0 && p.k % m::BK == 0, "MXFP8 GEMM: the reduction must be a positive multiple of ", m::BK,
           ", got ", p.k);
  MG_CHECK(p.n > 0 && p.n % 8 == 0, "MXFP8 GEMM: output columns must be a positive multiple of 8, got ", p.n);
  MG_CHECK(p.num_groups >= 1 && p.num_groups <= kMaxGroups, "MXFP8 GEMM: num_groups must be in [1, ", kMaxGroups,
           "], got ", p.num_groups);
  MG_CHECK(out == DType::kBF16 || out == DType::kFP16, "MXFP8 GEMM: the output must be bf16 or fp16");
  const bool bf16 = out == DType::kBF16;
  auto kernel = g_ping_pong ? (bf16 ? m::ragged_gemm_kernel<__nv_bfloat16, true> : m::ragged_gemm_kernel<__half, true>)
                            : (bf16 ? m::ragged_gemm_kernel<__nv_bfloat16, false> : m::ragged_gemm_kernel<__half, false>);
  kernel<<<sm_count, m::THREADS, m::kSmemBytes, stream>>>(p);
  MG_LAUNCH_CHECK();
}

void launch_mxfp8_wgrad(DType out, const Mxfp8WgradParams& p, int sm_count, cudaStream_t stream) {
  MG_CHECK(p.n > 0 && p.n % 16 == 0 && p.k > 0 && p.k % 16 == 0, "MXFP8 wgrad: n and k must be positive multiples "
           "of 16, got ", p.n, " and ", p.k);
  MG_CHECK(p.capacity_rows > 0 && p.capacity_rows % m::kBlock == 0, "MXFP8 wgrad: capacity_rows must be a positive "
           "multiple of 32, got ", p.capacity_rows);
  MG_CHECK(p.num_groups >= 1 && p.num_groups <= kMaxGroups, "MXFP8 wgrad: num_groups must be in [1, ", kMaxGroups,
           "], got ", p.num_groups);
  MG_CHECK((p.dweight != nullptr) != (p.main_grad != nullptr), "MXFP8 wgrad: exactly one of dweight and main_grad");
  MG_CHECK(out == DType::kBF16 || out == DType::kFP16, "MXFP8 wgrad: dweight must be bf16 or fp16");
  const bool bf16 = out == DType::kBF16;
  auto kernel = g_ping_pong
                    ? (bf16 ? m::grouped_wgrad_kernel<__nv_bfloat16, true> : m::grouped_wgrad_kernel<__half, true>)
                    : (bf16 ? m::grouped_wgrad_kernel<__nv_bfloat16, false> : m::grouped_wgrad_kernel<__half, false>);
  kernel<<<sm_count, m::THREADS, m::kSmemBytes, stream>>>(p);
  MG_LAUNCH_CHECK();
}

}  // namespace moegraph::kernels
