// The step's typed options (from a Config), and plan_step: every bucket's buffers from one layout
// walk with a null base (no GPU), the shared arena, the weights, and the kernels chosen.
#include <algorithm>
#include <sstream>

#include "graphs/bucket_step.hpp"
#include "graphs/sharded_weights.hpp"
#include "graphs/step_weights.hpp"
#include "moegraph/config.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/moe_layer.hpp"
#include "src/core/byte_units.hpp"
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
  o.sharding = config.parallel.sharding;
  return o;
}

void validate(const StepGraphsOptions& o) {
  MG_CHECK(!o.buckets.empty(), "buckets must list at least one capacity in tokens");
  // Enums may hold any value through the C ABI or a cast: refused here rather than read as another.
  MG_CHECK(o.step == StepKind::kMoeLayer || o.step == StepKind::kExperts, "step: unknown value ",
           static_cast<int>(o.step), " (moe_layer or experts)");
  MG_CHECK(o.capture_mode == cudaStreamCaptureModeGlobal || o.capture_mode == cudaStreamCaptureModeThreadLocal ||
               o.capture_mode == cudaStreamCaptureModeRelaxed,
           "capture_mode: unknown value ", static_cast<int>(o.capture_mode), " (global, thread-local or relaxed)");
  MG_CHECK(o.sharding.policy == ShardPolicy::kChunk || o.sharding.policy == ShardPolicy::kBalanced,
           "sharding.policy: unknown value ", static_cast<int>(o.sharding.policy), " (chunk or balanced)");
  MG_CHECK(o.sharding.unit == ShardUnit::kExpert || o.sharding.unit == ShardUnit::kRow,
           "sharding.unit: unknown value ", static_cast<int>(o.sharding.unit), " (expert or row)");
  // Each bucket's layer is given prequantized weights exactly under the mxfp8 recipe (the step's
  // shared copies or the caller's), which hides what the caller asked: check it here.
  MG_CHECK(!o.layer.prequantized_weights || o.layer.recipe == Recipe::kMXFP8,
           "layer.prequantized_weights needs the mxfp8 recipe, got recipe ", recipe_name(o.layer.recipe));
  MG_CHECK(o.layer.expert_parallel == 1 || o.step == StepKind::kMoeLayer, "expert_parallel = ",
           o.layer.expert_parallel, " needs step \"moe_layer\": the experts-only step has no dispatch to exchange rows");
  const WeightSharding& sh = o.sharding;
  MG_CHECK(sh.ranks >= 1 && sh.ranks <= kMaxShardRanks, "sharding.ranks must be 1 to ", kMaxShardRanks, ", got ",
           sh.ranks);
  if (sh.ranks > 1) {
    MG_CHECK(!o.layer.prequantized_weights, "sharding.ranks = ", sh.ranks,
             " cannot take prequantized MXFP8 weights: the shards are the 16-bit weights, and the step quantizes what "
             "it gathers");
  }
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
      b.buffers.push_back({e.name, e.offset, e.bytes, {}});
      // The operators' workspaces, buffer by buffer (their saved-context slots and scratch).
      for (PlannedBuffer& sub : sizing->sub_buffers(e)) b.buffers.push_back(std::move(sub));
    }
    b.bytes = walk.bytes();
    if (options.step == StepKind::kMoeLayer)
      b.window_bytes = MoeLayer::window_bytes(bucket_layer_options(options, tokens));
    plan.window_bytes = checked_add("window_bytes (expert-parallel windows of all buckets)", plan.window_bytes,
                                    b.window_bytes);
    plan.arena_bytes = std::max(plan.arena_bytes, b.bytes);
    // Each bucket stays within one layout, but enough of them could still wrap the sum.
    plan.sum_of_buckets = checked_add("sum_of_buckets (arena bytes of separate buckets)", plan.sum_of_buckets, b.bytes);
    plan.buckets.push_back(std::move(b));
  }
  LayoutWalker weights;
  lay_out_weights(options, weights);
  plan.weight_bytes = weights.bytes();
  if (options.sharding.ranks > 1) {
    // The caller holds the router (and its gradient) whole and a shard of every expert tensor.
    const MoeLayerOptions& l = options.layer;
    std::size_t router_bytes = 0;
    if (options.step == StepKind::kMoeLayer) {
      const std::size_t es = dtype_size(l.dtype), grad = l.main_grad_fp32 ? sizeof(float) : es;
      router_bytes = checked_mul("router bytes", l.experts, l.hidden, es + (l.training ? grad : 0));
    }
    plan.weight_bytes = checked_add("weight bytes", router_bytes, largest_shard_bytes(options));
    plan.shard_window_bytes = shard_window_bytes(options);
  }
  if (step_owns_mxfp8_weights(options.layer)) {
    LayoutWalker copies;
    StepWeights unused;
    lay_out_mxfp8_pair(options, copies, unused);
    plan.mxfp8_copy_bytes = copies.bytes();
    for (const auto& entry : copies.entries())
      if (entry.name.ends_with(kMxfp8ValuesSuffix)) plan.mxfp8_dequantized_bytes += entry.bytes;
  }
  const MoeLayerOptions first = bucket_layer_options(options, options.buckets.front());
  std::vector<layer::OpSpec> ops;  // the layer's declarations (none for the expert-MLP step)
  if (options.step == StepKind::kMoeLayer) {
    ops = layer::moe_layer_ops(first);
    if (first.fuse_weights) layer::fuse_routing_weights(ops);
    plan.kernels.push_back("moe layer: " + layer::describe(ops));
    // One line, or one per bucket where they differ (the small-batch logits kernel).
    std::vector<std::string> routers;
    for (const BucketPlan& b : plan.buckets)
      routers.push_back(layer::describe_router(bucket_layer_options(options, b.tokens)));
    if (std::all_of(routers.begin(), routers.end(), [&](const std::string& r) { return r == routers.front(); }))
      plan.kernels.push_back(routers.front());
    else
      for (std::size_t i = 0; i < routers.size(); ++i)
        plan.kernels.push_back(detail::concat("bucket ", plan.buckets[i].tokens, " ", routers[i]));
    plan.kernels.push_back(layer::describe_local_dispatch(!layer::layer_gathers_fc1_input(first)) +
                           "; combine: fp32 sum of k rows per token");
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
  if (first.recipe == Recipe::kMXFP8)
    plan.kernels.push_back(std::string(options.layer.prequantized_weights
                                           ? "mxfp8 weights: the caller's (prequantized_weights), read by every bucket"
                                           : "mxfp8 weights: quantized from w1, w2 by weights_changed into one copy "
                                             "that every bucket reads") +
                           (options.layer.dequantized_weights ? "; also kept dequantized to bf16 (dequantized_weights)"
                                                              : ""));
  // The SwiGLU as the layer's operator describes it (the expert-MLP step runs the plain kernels).
  layer::OpSpec swiglu{.kind = layer::OpKind::kSwiglu, .name = "swiglu"};
  for (const layer::OpSpec& op : ops)
    if (op.kind == layer::OpKind::kSwiglu || op.kind == layer::OpKind::kSwigluWeighted) swiglu = op;
  plan.kernels.push_back(layer::describe_swiglu(swiglu, first.training));
  if (first.bias) plan.kernels.push_back("bias grads: 256-row chunk partials + ordered reduction (deterministic)");
  if (options.step == StepKind::kMoeLayer && layer::layer_keeps_linear_activations(first))
    plan.kernels.push_back(std::string("saved activations: x_perm and swiglu_out") +
                           (first.delay_wgrad ? ", d.fc1_out and d.expert_out" : "") +
                           " kept per slot where they are written; fc1 and fc2 keep pointers, no copies");
  else if (first.training && first.recipe == Recipe::kMXFP8)
    plan.kernels.push_back("saved activations: the quantizer's MXFP8 column-wise copies of x and dy");
  else if (first.training)
    plan.kernels.push_back("saved-context copies: used rows only, 16-byte vectors");
  return plan;
}

std::size_t StepPlan::device_bytes() const {
  return checked_add("device bytes of the step", arena_bytes, weight_bytes, mxfp8_copy_bytes, window_bytes,
                     shard_window_bytes);
}

std::size_t StepPlan::bucket_device_bytes(std::size_t b) const {
  const BucketPlan& bucket = buckets.at(b);
  return checked_add("device bytes of one bucket", bucket.bytes, weight_bytes, mxfp8_copy_bytes, bucket.window_bytes,
                     shard_window_bytes);
}

namespace {

// A bucket's buffers as a table: name, size, offset in the arena; an operator's sub-buffers
// indented under its workspace.
void print_buffers(std::ostringstream& os, const BucketPlan& b) {
  auto label = [](const PlannedBuffer& buf) { return (buf.within.empty() ? "  " : "    ") + buf.name; };
  std::size_t width = 0;
  for (const PlannedBuffer& buf : b.buffers) width = std::max(width, label(buf).size());
  for (const PlannedBuffer& buf : b.buffers) {
    if (buf.bytes == 0) continue;
    const std::string name = label(buf), size = human_bytes(buf.bytes);
    os << name << std::string(width - name.size() + 2 + (size.size() < 10 ? 10 - size.size() : 0), ' ') << size
       << "  at " << human_bytes(buf.offset) << "\n";
  }
}

}  // namespace

std::string StepPlan::to_string() const {
  const bool windows = window_bytes > 0;
  const std::string outside = std::string(windows ? "the weights, gradients and its window" : "the weights and gradients") +
                              (mxfp8_copy_bytes > 0 ? " and the mxfp8 copies" : "");
  std::ostringstream os;
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    const BucketPlan& b = buckets[i];
    os << "bucket " << b.tokens << " tokens (" << b.rows << " rows): " << human_bytes(b.bytes) << " of arena; "
       << human_bytes(bucket_device_bytes(i)) << " alone with " << outside << "\n";
    print_buffers(os, b);
  }
  os << "kernels:\n";
  for (const auto& k : kernels) os << "  " << k << "\n";
  os << "arena (shared by all buckets, = the largest): " << human_bytes(arena_bytes) << "  (separate buckets would take "
     << human_bytes(sum_of_buckets) << ")\n";
  os << "weights and gradients (outside the arena): " << human_bytes(weight_bytes) << "\n";
  if (mxfp8_copy_bytes > 0)
    os << "mxfp8 weight copies (outside the arena, shared by all buckets): " << human_bytes(mxfp8_copy_bytes)
       << (mxfp8_dequantized_bytes > 0 ? " (of which their bf16 values, dequantized_weights: " +
                                              human_bytes(mxfp8_dequantized_bytes) + ")"
                                        : "")
       << "\n";
  if (windows)
    os << "expert-parallel windows (outside the arena, one per bucket): " << human_bytes(window_bytes) << "\n";
  if (shard_window_bytes > 0)
    os << "sharded weights' window (full expert weights and gradients, outside the arena): "
       << human_bytes(shard_window_bytes) << "\n";
  os << "device memory total: " << human_bytes(device_bytes()) << " (arena + weights and gradients"
     << (mxfp8_copy_bytes > 0 ? " + mxfp8 copies" : "") << (windows ? " + windows" : "")
     << (shard_window_bytes > 0 ? " + the sharded weights' window" : "")
     << (windows || shard_window_bytes > 0 ? ", per rank" : "") << ")\n";
  return os.str();
}

}  // namespace moegraph
