// The step's typed options (from a Config), and plan_step: every bucket's buffers from one layout
// walk with a null base (no GPU), the shared arena, the weights, and the kernels chosen.
#include <algorithm>
#include <sstream>

#include "graphs/bucket_step.hpp"
#include "graphs/step_weights.hpp"
#include "moegraph/config.hpp"
#include "moegraph/grouped_linear.hpp"
#include "src/core/checked.hpp"
#include "src/ops/moe/op_spec.hpp"

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

StepGraphsOptions step_graphs_options(const Config& config) {
  StepGraphsOptions o;
  o.step = config.step;
  o.layer = moe_layer_options(config, config.buckets.empty() ? 1 : config.buckets.front());
  o.buckets = config.buckets;
  return o;
}

void validate(const StepGraphsOptions& o) {
  MG_CHECK(!o.buckets.empty(), "buckets must list at least one capacity in tokens");
  for (std::size_t b = 0; b < o.buckets.size(); ++b) {
    MG_CHECK(o.buckets[b] >= 1, "buckets[", b, "] must be >= 1, got ", o.buckets[b]);
    MG_CHECK(b == 0 || o.buckets[b] > o.buckets[b - 1], "buckets must be strictly increasing, got ",
             o.buckets[b - 1], " then ", o.buckets[b]);
    validate(bucket_layer_options(o, o.buckets[b]));
  }
}

StepPlan plan_step(const StepGraphsOptions& options) {
  validate(options);
  StepPlan plan;
  for (int64_t tokens : options.buckets) {
    LayoutWalker walk;
    const auto sizing = make_bucket_step(options, tokens, walk, StepWeights{}, /*create=*/false);
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
    // Each bucket stays within one layout, but enough of them could still wrap the sum.
    plan.sum_of_buckets = checked_add("sum_of_buckets (arena bytes of separate buckets)", plan.sum_of_buckets, b.bytes);
    plan.buckets.push_back(std::move(b));
  }
  LayoutWalker weights;
  lay_out_weights(options, weights);
  plan.weight_bytes = weights.bytes();
  const MoeLayerOptions first = bucket_layer_options(options, options.buckets.front());
  if (options.step == StepKind::kMoeLayer) {
    std::vector<layer::OpSpec> ops = layer::moe_layer_ops(first);
    if (first.fuse_weights) layer::fuse_routing_weights(ops);
    plan.kernels.push_back("moe layer: " + layer::describe(ops));
    plan.kernels.push_back("router: logits by cuBLASLt (bf16 in, fp32 out), scores + top-k one warp per token");
    plan.kernels.push_back("dispatch: stable counting sort by expert (the group layout: splits, offsets), row gather; "
                           "combine: fp32 sum of k rows per token");
  } else {
    plan.kernels.push_back("group layout: splits copied per slot, offsets by a CUB BlockScan (1 CTA x 256 threads, "
                           "device validation), read by fc1, swiglu and fc2");
  }
  // The kernel of every GEMM, per bucket: the same heuristic and overrides as set-up.
  for (const BucketPlan& b : plan.buckets) {
    const MoeLayerOptions o = bucket_layer_options(options, b.tokens);
    for (int fc : {1, 2})
      plan.kernels.push_back(detail::concat("bucket ", b.tokens, " fc", fc, ": ",
                                            GroupedLinear::describe_kernels(layer::expert_linear_options(o, fc, b.rows))));
  }
  plan.kernels.push_back("swiglu forward/backward: 8 x 16-bit per thread, grid-stride over used rows");
  if (first.bias) plan.kernels.push_back("bias grads: 256-row chunk partials + ordered reduction (deterministic)");
  if (first.training) plan.kernels.push_back("saved-context copies: used rows only, 16-byte vectors");
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
