#include "graphs/step_weights.hpp"

#include "graphs/bucket_step.hpp"
#include "moegraph/moe_layer.hpp"
#include "src/ops/grouped_linear/linear_backend.hpp"
#include "src/ops/moe/op_spec.hpp"

namespace moegraph {

Mxfp8TiledCopies swap_ab_tiled_copies(const StepGraphsOptions& options) {
  Mxfp8TiledCopies copies;
  const auto swap_ab = [](const GroupedLinearOptions& o, kernels::GemmPhase phase) {
    return linear::gemm_config(o, phase).family == kernels::GemmFamily::kMxfp8SwapAb;
  };
  for (int64_t tokens : options.buckets) {
    const MoeLayerOptions o = bucket_layer_options(options, tokens);
    // The rows each bucket's expert operators are made with (its BucketStep's io().rows).
    const int64_t rows = options.step == StepKind::kMoeLayer ? moe_expert_rows(o) : moe_layer_rows(o);
    for (int fc : {1, 2}) {
      const GroupedLinearOptions lo = layer::expert_linear_options(o, fc, rows);
      (fc == 1 ? copies.w1 : copies.w2) |= swap_ab(lo, kernels::GemmPhase::kFprop);
      if (o.training) (fc == 1 ? copies.w1_t : copies.w2_t) |= swap_ab(lo, kernels::GemmPhase::kDgrad);
    }
  }
  return copies;
}

}  // namespace moegraph
