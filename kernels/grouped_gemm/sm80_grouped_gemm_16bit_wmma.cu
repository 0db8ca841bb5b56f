// The reference kernels: simple WMMA grouped GEMMs (any sm_80+ part), bf16 and fp16, for
// differential tests against the fast families.
#include "kernels/common/dtype_dispatch.cuh"
#include "kernels/common/kernel_setup.cuh"
#include "kernels/grouped_gemm/gemm_families.hpp"
#include "kernels/grouped_gemm/sm80_grouped_gemm_16bit_wmma.cuh"

namespace moegraph::kernels {

namespace r = reference_gemm;

GemmConfig reference_gemm_config(GemmPhase phase, DType dtype) {
  return {phase, GemmFamily::kReference, dtype, r::BM, r::BN, r::BK, r::STAGES, r::THREADS};
}

int prepare_reference_gemm(const GemmConfig& config) {
  return with_16bit_type(config.dtype, "reference GEMM", [&](auto t) {
    using T = decltype(t);
    auto measure = [](auto kernel) { return allow_smem_and_measure(kernel, r::THREADS, r::kSmemBytes); };
    switch (config.phase) {
      case GemmPhase::kFprop: return measure(r::ragged_gemm_kernel<T, true>);
      case GemmPhase::kDgrad: return measure(r::ragged_gemm_kernel<T, false>);
      case GemmPhase::kWgrad: return measure(r::grouped_wgrad_kernel<T>);
    }
    return 0;
  });
}

void launch_reference_gemm(const GemmPlan& plan, const RaggedGemmParams& p, cudaStream_t stream) {
  with_16bit_type(plan.config.dtype, "reference GEMM", [&](auto t) {
    using T = decltype(t);
    if (plan.config.phase == GemmPhase::kFprop)
      r::ragged_gemm_kernel<T, true><<<plan.grid, r::THREADS, r::kSmemBytes, stream>>>(p);
    else
      r::ragged_gemm_kernel<T, false><<<plan.grid, r::THREADS, r::kSmemBytes, stream>>>(p);
  });
  MG_LAUNCH_CHECK();
}

void launch_reference_wgrad(const GemmPlan& plan, const WgradParams& p, cudaStream_t stream) {
  with_16bit_type(plan.config.dtype, "reference GEMM", [&](auto t) {
    using T = decltype(t);
    r::grouped_wgrad_kernel<T><<<plan.grid, r::THREADS, r::kSmemBytes, stream>>>(p);
  });
  MG_LAUNCH_CHECK();
}

}  // namespace moegraph::kernels
