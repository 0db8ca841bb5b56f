// plan_step: every bucket's buffers from one layout walk with a null base (no GPU), the shared
// arena, the weights, and the kernels chosen.
#include <sstream>

#include "graphs/bucket_step.hpp"
#include "graphs/expert_mlp_bucket.hpp"
#include "src/ops/moe/op_spec.hpp"
#include "graphs/step_weights.hpp"
#include "kernels/grouped_gemm/grouped_gemm.hpp"

namespace moegraph {

std::string_view step_phase_name(StepPhase phase) {
  switch (phase) {
    case StepPhase::kForward: return "forward";
    case StepPhase::kForwardTrain: return "forward_train";
    case StepPhase::kBackward: return "backward";
    case StepPhase::kWgrad: return "wgrad";
  }
  return "?";
}

StepPlan plan_step(const Config& config) {
  StepPlan plan;
  for (int64_t tokens : config.buckets) {
    LayoutWalker walk;
    const auto sizing = make_bucket_step(config, tokens, walk, StepWeights{}, /*create=*/false);
    BucketPlan b;
    b.tokens = tokens;
    b.rows = sizing->io().rows;
    for (const auto& e : walk.entries()) {
      b.buffers.push_back({e.name, e.offset, e.bytes});
      // The operators' workspaces, buffer by buffer (their saved-context slots and scratch).
      for (PlannedBuffer& sub : sizing->sub_buffers(e)) b.buffers.push_back(std::move(sub));
    }
    b.bytes = walk.bytes();
    plan.arena_bytes = std::max(plan.arena_bytes, b.bytes);
    plan.sum_of_buckets += b.bytes;
    plan.buckets.push_back(std::move(b));
  }
  LayoutWalker weights;
  lay_out_weights(config, weights);
  plan.weight_bytes = weights.bytes();
  if (config.step == StepKind::kMoeLayer) {
    std::vector<layer::OpSpec> ops = layer::moe_layer_ops(moe_layer_options(config, config.buckets.front()));
    if (config.router.fuse_weights) layer::fuse_routing_weights(ops);
    plan.kernels.push_back("moe layer: " + layer::describe(ops));
    plan.kernels.push_back("router: logits by cuBLASLt (bf16 in, fp32 out), scores + top-k one warp per token");
    plan.kernels.push_back("dispatch: stable counting sort by expert, row gather; combine: fp32 sum of k rows per token");
  }
  plan.kernels.insert(plan.kernels.end(), {
      "group offsets: CUB BlockScan, 1 CTA x 256 threads, device validation",
      "fc1, fc2 fprop/dgrad/wgrad: wgmma, 128 x tile_n x 64, persistent, device tile scheduler",
      "swiglu forward/backward: 8 x 16-bit per thread, grid-stride over used rows",
  });
  for (const BucketPlan& b : plan.buckets) {
    std::string line = detail::concat("bucket ", b.tokens, " tile_n fprop/dgrad/wgrad:");
    for (const GroupedLinearOptions& o : {fc1_options(config, b.rows), fc2_options(config, b.rows)}) {
      line += o.in_features == config.layer.hidden ? " fc1 " : ", fc2 ";
      for (kernels::GemmPhase ph : {kernels::GemmPhase::kFprop, kernels::GemmPhase::kDgrad, kernels::GemmPhase::kWgrad})
      {
        const int tile_n = kernels::choose_tile_n(ph, o.num_groups, o.capacity_rows, o.out_features, o.in_features);
        line += detail::concat(ph == kernels::GemmPhase::kFprop ? "" : "/", tile_n, "(",
                               kernels::pipeline_name(kernels::choose_pipeline(ph, tile_n)), ")");
      }
    }
    plan.kernels.push_back(line);
  }
  if (config.layer.bias) plan.kernels.push_back("bias grads: 256-row chunk partials + ordered reduction (deterministic)");
  if (config.training.enabled) plan.kernels.push_back("saved-context copies: used rows only, 16-byte vectors");
  return plan;
}

namespace {
std::string human(std::size_t bytes) {
  std::ostringstream os;
  os.precision(bytes >= (std::size_t{1} << 30) ? 2 : 1);
  os << std::fixed;
  if (bytes >= (std::size_t{1} << 30)) os << bytes / double(std::size_t{1} << 30) << " GiB";
  else if (bytes >= (std::size_t{1} << 20)) os << bytes / double(std::size_t{1} << 20) << " MiB";
  else if (bytes >= 1024) os << bytes / 1024.0 << " KiB";
  else os << bytes << " B";
  return os.str();
}
}  // namespace

std::string StepPlan::to_string() const {
  std::ostringstream os;
  for (const BucketPlan& b : buckets) {
    os << "bucket " << b.tokens << " tokens (" << b.rows << " rows): " << human(b.bytes) << "\n";
    for (const PlannedBuffer& buf : b.buffers)
      if (buf.bytes > 0) os << "  " << buf.name << std::string(buf.name.size() < 28 ? 28 - buf.name.size() : 1, ' ')
                            << "@" << buf.offset << "  " << human(buf.bytes) << "\n";
  }
  os << "arena (shared by all buckets, = the largest): " << human(arena_bytes) << "  (separate buckets would take "
     << human(sum_of_buckets) << ")\n";
  os << "weights and gradients (outside the arena): " << human(weight_bytes) << "\n";
  os << "kernels:\n";
  for (const auto& k : kernels) os << "  " << k << "\n";
  return os.str();
}

}  // namespace moegraph
