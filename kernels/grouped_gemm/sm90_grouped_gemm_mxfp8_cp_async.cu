// The MXFP8 grouped GEMMs (sm_90a) for bf16 and fp16 outputs, with and without ping-pong partials
// (GemmConfig::ping_pong; MOEGRAPH_MXFP8_PINGPONG=0 forces the single-partial variant).
#include "kernels/common/dtype_dispatch.cuh"
#include "kernels/common/kernel_setup.cuh"
#include "kernels/grouped_gemm/gemm_families.hpp"
#include "kernels/grouped_gemm/sm90_grouped_gemm_mxfp8_cp_async.cuh"
#include "moegraph/error.hpp"

namespace moegraph::kernels {

namespace {
namespace m = mxfp8_gemm;

// Calls f(kernel) with the plan's kernel: the output type and the ping-pong variant.
template <bool kWgrad, class F>
void with_kernel(const GemmConfig& config, F&& f) {
  with_16bit_type(config.dtype, "MXFP8 GEMM", [&](auto t) {
    using T = decltype(t);
    if constexpr (kWgrad) {
      if (config.ping_pong) f(m::grouped_wgrad_kernel<T, true>);
      else f(m::grouped_wgrad_kernel<T, false>);
    } else {
      if (config.ping_pong) f(m::ragged_gemm_kernel<T, true>);
      else f(m::ragged_gemm_kernel<T, false>);
    }
  });
}


void check_plan(const GemmPlan& plan, bool wgrad, const char* launcher) {
  MG_CHECK(plan.grid > 0 && plan.config.family == GemmFamily::kMxfp8CpAsync, launcher,
           ": needs a prepared MXFP8 plan, got ", plan.config.to_string());
  MG_CHECK((plan.config.phase == GemmPhase::kWgrad) == wgrad, launcher, " cannot run a ",
           gemm_phase_name(plan.config.phase), " plan");
}
}  // namespace

GemmConfig mxfp8_gemm_config(GemmPhase phase, DType out, bool ping_pong) {
  return {phase, GemmFamily::kMxfp8CpAsync, out, m::BM, m::Tile128::BN, m::BK, m::STAGES, m::THREADS, ping_pong};
}

int prepare_mxfp8_gemm(const GemmConfig& config) {
  int blocks = 0;
  auto measure = [&](auto kernel) { blocks = allow_smem_and_measure(kernel, m::THREADS, m::kSmemBytes); };
  if (config.phase == GemmPhase::kWgrad) with_kernel<true>(config, measure);
  else with_kernel<false>(config, measure);
  return blocks;
}

void launch_mxfp8_ragged_gemm(const GemmPlan& plan, const Mxfp8RaggedGemmParams& p, cudaStream_t stream) {
  MG_CHECK(plan.grid > 0 && plan.config.phase != GemmPhase::kWgrad &&
               (plan.config.family == GemmFamily::kMxfp8CpAsync || plan.config.family == GemmFamily::kMxfp8SwapAb ||
                plan.config.family == GemmFamily::kMxfp8Dequant || plan.config.family == GemmFamily::kMxfp8Staged),
           "launch_mxfp8_ragged_gemm: needs a prepared MXFP8 fprop or dgrad plan, got ", plan.config.to_string());
  MG_CHECK(p.k > 0 && p.k % m::BK == 0, "MXFP8 GEMM: the reduction must be a positive multiple of ", m::BK,
           ", got ", p.k);
  MG_CHECK(p.n > 0 && p.n % 8 == 0, "MXFP8 GEMM: output columns must be a positive multiple of 8, got ", p.n);
  MG_CHECK(p.num_groups >= 1 && p.num_groups <= kMaxGroups, "MXFP8 GEMM: num_groups must be in [1, ", kMaxGroups,
           "], got ", p.num_groups);
  MG_CHECK(!p.a_staged || plan.config.family == GemmFamily::kMxfp8Staged,
           "launch_mxfp8_ragged_gemm: A's staged bf16 values (a_staged) are read by the staged route only; ",
           plan.config.to_string(), " reads A's codes");
  if (plan.config.family == GemmFamily::kMxfp8SwapAb) return launch_mxfp8_swap_ab(plan, p, stream);
  if (plan.config.family == GemmFamily::kMxfp8Dequant) return launch_mxfp8_dequant(plan, p, stream);
  if (plan.config.family == GemmFamily::kMxfp8Staged) return launch_mxfp8_staged(plan, p, stream);
  with_kernel<false>(plan.config, [&](auto kernel) { kernel<<<plan.grid, m::THREADS, m::kSmemBytes, stream>>>(p); });
  MG_LAUNCH_CHECK();
}

void launch_mxfp8_wgrad(const GemmPlan& plan, const Mxfp8WgradParams& p, cudaStream_t stream) {
  const bool staged = plan.config.family == GemmFamily::kMxfp8Staged && plan.config.phase == GemmPhase::kWgrad;
  if (!staged) check_plan(plan, true, "launch_mxfp8_wgrad");
  MG_CHECK(plan.grid > 0, "launch_mxfp8_wgrad: the plan was not prepared (prepare_gemm at set-up)");
  MG_CHECK(p.n > 0 && p.n % 16 == 0 && p.k > 0 && p.k % 16 == 0, "MXFP8 wgrad: n and k must be positive multiples "
           "of 16, got ", p.n, " and ", p.k);
  MG_CHECK(p.capacity_rows > 0 && p.capacity_rows % m::kBlock == 0, "MXFP8 wgrad: capacity_rows must be a positive "
           "multiple of 32, got ", p.capacity_rows);
  MG_CHECK(p.num_groups >= 1 && p.num_groups <= kMaxGroups, "MXFP8 wgrad: num_groups must be in [1, ", kMaxGroups,
           "], got ", p.num_groups);
  MG_CHECK((p.dweight != nullptr) != (p.main_grad != nullptr), "MXFP8 wgrad: exactly one of dweight and main_grad");
  if (staged) return launch_mxfp8_staged_wgrad(plan, p, stream);
  MG_CHECK(p.dy_values == nullptr, "launch_mxfp8_wgrad: ", plan.config.to_string(), " reads dy's codes (dy_t); "
           "dy_values is read by the staged route only");
  with_kernel<true>(plan.config, [&](auto kernel) { kernel<<<plan.grid, m::THREADS, m::kSmemBytes, stream>>>(p); });
  MG_LAUNCH_CHECK();
}

}  // namespace moegraph::kernels
