// Set-up and launch dispatch over the kernel families: the plan's family picks the translation
// unit; nothing here is process-global, so each operator (and each device) holds its own plans.
#include "kernels/grouped_gemm/gemm_families.hpp"
#include "moegraph/error.hpp"

namespace moegraph::kernels {

GemmPlan prepare_gemm(const GemmConfig& config, int sm_count) {
  MG_CHECK(sm_count > 0, "prepare_gemm needs the device's SM count, got ", sm_count);
  GemmPlan plan;
  plan.config = config;
  int ctas_per_sm = 0;
  switch (config.family) {
    case GemmFamily::kReference: ctas_per_sm = prepare_reference_gemm(config); break;
    case GemmFamily::kCpAsync16: ctas_per_sm = prepare_cp_async_gemm(config); break;
    case GemmFamily::kTma16: ctas_per_sm = prepare_tma_gemm(config, &plan.encode_tensor_map); break;
    case GemmFamily::kMxfp8CpAsync: ctas_per_sm = prepare_mxfp8_gemm(config); break;
    case GemmFamily::kMxfp8SwapAb: ctas_per_sm = prepare_mxfp8_swap_ab(config, &plan.encode_tensor_map); break;
    case GemmFamily::kMxfp8Dequant: ctas_per_sm = prepare_mxfp8_dequant(config, &plan.encode_tensor_map); break;
    case GemmFamily::kMxfp8Staged: ctas_per_sm = prepare_mxfp8_staged(config, &plan.encode_tensor_map); break;
  }
  MG_CHECK(ctas_per_sm > 0, "the grouped GEMM kernel ", config.to_string(), " cannot be resident on this device");
  plan.grid = sm_count * ctas_per_sm;
  plan.sm_count = sm_count;
  return plan;
}

namespace {
void check_phase(const GemmPlan& plan, bool wgrad, const char* launcher) {
  MG_CHECK(plan.grid > 0, launcher, ": the plan was not prepared (prepare_gemm at set-up)");
  MG_CHECK((plan.config.phase == GemmPhase::kWgrad) == wgrad, launcher, " cannot run a ",
           gemm_phase_name(plan.config.phase), " plan");
}
}  // namespace

void launch_ragged_gemm(const GemmPlan& plan, const RaggedGemmParams& p, cudaStream_t stream) {
  check_phase(plan, false, "launch_ragged_gemm");
  MG_CHECK(p.num_groups >= 1 && p.num_groups <= kMaxGroups, "num_groups must be in [1, ", kMaxGroups, "], got ",
           p.num_groups);
  switch (plan.config.family) {
    case GemmFamily::kReference: return launch_reference_gemm(plan, p, stream);
    case GemmFamily::kCpAsync16: return launch_cp_async_gemm(plan, p, stream);
    case GemmFamily::kTma16: return launch_tma_gemm(plan, p, stream);
    case GemmFamily::kMxfp8CpAsync:
    case GemmFamily::kMxfp8SwapAb:
    case GemmFamily::kMxfp8Dequant:
    case GemmFamily::kMxfp8Staged: break;
  }
  MG_FAIL("launch_ragged_gemm: ", plan.config.to_string(), " takes MXFP8 operands (launch_mxfp8_ragged_gemm)");
}

void launch_grouped_wgrad(const GemmPlan& plan, const WgradParams& p, cudaStream_t stream) {
  check_phase(plan, true, "launch_grouped_wgrad");
  MG_CHECK((p.dweight == nullptr) != (p.main_grad == nullptr), "wgrad needs exactly one of dweight and main_grad");
  switch (plan.config.family) {
    case GemmFamily::kReference: return launch_reference_wgrad(plan, p, stream);
    case GemmFamily::kCpAsync16: return launch_cp_async_wgrad(plan, p, stream);
    case GemmFamily::kTma16: return launch_tma_wgrad(plan, p, stream);
    case GemmFamily::kMxfp8CpAsync:
    case GemmFamily::kMxfp8SwapAb:
    case GemmFamily::kMxfp8Dequant:
    case GemmFamily::kMxfp8Staged: break;
  }
  MG_FAIL("launch_grouped_wgrad: ", plan.config.to_string(), " takes MXFP8 operands (launch_mxfp8_wgrad)");
}

}  // namespace moegraph::kernels
