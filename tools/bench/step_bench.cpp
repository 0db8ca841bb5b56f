// Per bucket: capture time, eager step time, graph replay time (at the configured fill and at 25%),
// host CPU time per replay, TFLOP/s, the fraction of the step's roofline reached (its FLOPs at the
// dense cuBLASLt rate or its fewest bytes at the copy bandwidth, both measured in the same run;
// tools/bench/roofline.hpp), the ratio to the per-expert cuBLASLt loop and, with --torch, to the
// same layer in PyTorch. The dense cuBLASLt GEMMs of the same total rows are still timed (JSON
// "dense_ms"): a ratio to them means nothing for memory-bound layers, so the table leaves it out.
// A fresh routing before every replay, L2 flushed before every timed run, medians. Whole-layer
// step: fresh random x (so the router routes anew) and the token count written on the device
// before each replay; experts only: fresh device splits.
#include "tools/bench/step_bench.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "graphs/graph_exec.hpp"
#include "kernels/elementwise/elementwise.hpp"
#include "moegraph/config.hpp"
#include "moegraph/step_graphs.hpp"
#include "src/core/lt_gemm.hpp"
#include "src/ops/grouped_linear/linear_backend.hpp"
#include "src/ops/moe/op_spec.hpp"
#include "testing/legacy_loop.hpp"
#include "testing/step_weights.hpp"
#include "src/core/device_info.hpp"
#include "tools/bench/bench_util.hpp"
#include "tools/bench/json_results.hpp"
#include "tools/bench/op_timer.hpp"
#include "tools/bench/roofline.hpp"

namespace moegraph::bench {
namespace {

std::vector<int32_t> draw_routing(std::mt19937_64& rng, const Config& c, int64_t rows) {
  if (c.routing.kind == RoutingKind::kFixed) {
    std::vector<int32_t> s(c.routing.fixed_splits.begin(), c.routing.fixed_splits.end());
    return s;
  }
  return testing::random_splits(rng, c.layer.experts, rows, c.routing.kind == RoutingKind::kUniform ? 0.0 : c.routing.skew);
}

// The routings replayed for one bucket at one fill, on the device, one row of `experts` each.
struct RoutingPool {
  DeviceBuffer splits;
  int count = 0, experts = 0;
  int64_t rows = 0;
  double active = 0;  // experts that receive rows, mean over the routings
  RoutingPool(std::mt19937_64& rng, const Config& c, int64_t rows_routed, int n) : count(n), experts(c.layer.experts), rows(rows_routed) {
    std::vector<int32_t> flat;
    for (int i = 0; i < n; ++i) {
      auto r = draw_routing(rng, c, rows_routed);
      active += static_cast<double>(std::count_if(r.begin(), r.end(), [](int32_t v) { return v > 0; })) / n;
      flat.insert(flat.end(), r.begin(), r.end());
    }
    splits = DeviceBuffer(flat.size() * sizeof(int32_t));
    MG_CUDA_CHECK(cudaMemcpy(splits.get(), flat.data(), flat.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  }
  void select(int i, int32_t* dst, cudaStream_t s) const {
    MG_CUDA_CHECK(cudaMemcpyAsync(dst, splits.as<int32_t>() + (i % count) * experts, experts * sizeof(int32_t),
                                  cudaMemcpyDeviceToDevice, s));
  }
};

// The same GEMMs without experts: one weight, `rows` rows (the practical ceiling), and the same
// GEMMs as a per-expert loop after copying the splits to the host (the legacy way).
struct Baselines {
  const Config& c;
  int64_t rows;
  bool train;
  DeviceBuffer x, h1, a, y, grad_w1, grad_w2;
  LtGemm lt;
  Baselines(const Config& config, int64_t r) : c(config), rows(r), train(config.training.enabled) {
    const std::size_t es = dtype_size(c.precision.dtype);
    const int64_t h = c.layer.hidden, f = c.layer.ffn;
    x = DeviceBuffer(rows * h * es), h1 = DeviceBuffer(rows * 2 * f * es), a = DeviceBuffer(rows * f * es);
    y = DeviceBuffer(rows * h * es);
    kernels::launch_fill_uniform(c.precision.dtype, x.get(), rows * h, 1.0f, 7, nullptr);
    kernels::launch_fill_uniform(c.precision.dtype, a.get(), rows * f, 1.0f, 8, nullptr);
    const std::size_t ges = c.training.main_grad_fp32 ? 4 : es;
    if (train) grad_w1 = DeviceBuffer(2 * f * h * ges), grad_w2 = DeviceBuffer(h * f * ges);
  }
  // fprop/dgrad/wgrad of FC1 [2f x h] and FC2 [h x f]; the gradient buffers reuse the activations.
  void dense(const StepWeights& w, cudaStream_t s) {
    const int64_t h = c.layer.hidden, f = c.layer.ffn;
    const DType dt = c.precision.dtype, gt = c.training.main_grad_fp32 ? DType::kFP32 : dt;
    auto gemm = [&](bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda, const void* B,
                    int64_t ldb, void* C, int64_t ldc, DType ct, float beta) {
      RowMajorGemm g{ta, tb, m, n, k, A, lda, B, ldb, C, ldc, dt, ct, beta};
      lt.run(g, s);
    };
    gemm(false, true, rows, 2 * f, h, x.get(), h, w.w1, h, h1.get(), 2 * f, dt, 0);  // fc1 fprop
    gemm(false, true, rows, h, f, a.get(), f, w.w2, f, y.get(), h, dt, 0);           // fc2 fprop
    if (!train) return;
    const float beta = c.training.main_grad_fp32 ? 1.0f : 0.0f;
    gemm(false, false, rows, f, h, y.get(), h, w.w2, f, a.get(), f, dt, 0);                        // fc2 dgrad
    gemm(true, false, h, f, rows, y.get(), h, a.get(), f, grad_w2.get(), f, gt, beta);            // fc2 wgrad
    gemm(false, false, rows, h, 2 * f, h1.get(), 2 * f, w.w1, h, x.get(), h, dt, 0);              // fc1 dgrad
    gemm(true, false, 2 * f, h, rows, h1.get(), 2 * f, x.get(), h, grad_w1.get(), h, gt, beta);   // fc1 wgrad
  }
};

struct Row {
  std::vector<OpTime> ops, graph_ops;  // --ops: eager, and inside replays of a captured eager step
  std::size_t kernel_nodes = 0;          // --ops: kernel nodes of that captured step
  int64_t tokens, rows;
  uint64_t dropped;
  double capture_ms, eager_ms, replay_ms, replay_quarter_ms, host_us, dense_ms, legacy_ms, flops;
  double active_experts, bytes;  // experts that receive rows; the step's fewest bytes (step_bytes)
};

// The fewest bytes of one step of bucket `tokens` at the routing replayed (tools/bench/roofline.hpp).
// Experts only: the routings drawn for the replays; the whole layer routes by its router, about
// uniformly on the benchmark's random x.
// Bytes per weight element that fprop and dgrad read: the dtype's for bf16; 1 + 1/32 for the MXFP8
// copies, or 2 where their values are kept in bf16 (dequantized_weights) and the bucket's route
// reads them (groups past the swap-AB bound: the config of its FC1 fprop says so).
double weight_bytes_read(const Config& c, int64_t tokens, int64_t capacity_rows) {
  if (c.precision.recipe != Recipe::kMXFP8) return static_cast<double>(dtype_size(c.precision.dtype));
  if (c.precision.dequantized_weights) {
    const MoeLayerOptions o = moe_layer_options(c, tokens);
    if (linear::gemm_config(layer::expert_linear_options(o, 1, capacity_rows), kernels::GemmPhase::kFprop)
            .dequantized_weights)
      return 2.0;
  }
  return 1.0 + 1.0 / 32;
}

StepTraffic step_traffic(const Config& c, int64_t tokens, int64_t capacity_rows, double drawn_active) {
  const bool layer = c.step == StepKind::kMoeLayer;
  StepTraffic t;
  t.hidden = c.layer.hidden, t.ffn = c.layer.ffn, t.experts = c.layer.experts;
  t.active_experts = layer ? expected_active_experts(c.layer.experts, c.layer.top_k, tokens) : drawn_active;
  t.io_rows = layer ? tokens : tokens * c.layer.top_k;
  t.act_bytes = static_cast<double>(dtype_size(c.precision.dtype));
  t.weight_bytes = weight_bytes_read(c, tokens, capacity_rows);
  t.training = c.training.enabled;
  t.main_grad_fp32 = c.training.main_grad_fp32;
  return t;
}

// `baseline`: 16-bit weights of the same values for the cuBLASLt baselines.
int run_bucket(StepGraphs& step, const StepWeights& baseline, int b, const Config& c, int replays, bool ops,
               cudaStream_t s, DeviceBuffer& l2_flush, Row& row) {
  const BucketIO io = step.io(b);
  const bool train = c.training.enabled;
  const bool layer = c.step == StepKind::kMoeLayer;
  const int64_t h = c.layer.hidden, f = c.layer.ffn;
  std::mt19937_64 rng(c.routing.seed + b);
  const int64_t full_tokens = std::max<int64_t>(1, static_cast<int64_t>(io.tokens * c.bench.fill));
  const int64_t quarter_tokens = std::max<int64_t>(1, io.tokens / 4);
  const int64_t routed_rows = full_tokens * c.layer.top_k, quarter_rows = quarter_tokens * c.layer.top_k;
  RoutingPool full(rng, c, routed_rows, 16);
  RoutingPool quarter(rng, c, c.routing.kind == RoutingKind::kFixed ? routed_rows : quarter_rows, 16);
  // The whole layer routes by itself; the legacy baseline still needs splits of its own.
  DeviceBuffer own_splits(layer ? c.layer.experts * sizeof(int32_t) : 0);
  int32_t* splits = layer ? own_splits.as<int32_t>() : io.splits;
  const int64_t io_rows = layer ? io.tokens : io.rows;
  kernels::launch_fill_uniform(c.precision.dtype, io.x, io_rows * h, 1.0f, 11 + b, s);
  if (train) kernels::launch_fill_uniform(c.precision.dtype, io.dy, io_rows * h, 1.0f, 13 + b, s);
  // A fresh routing for replay i.
  auto reroute = [&](const RoutingPool& pool, int i) {
    if (!layer) return pool.select(i, io.splits, s);
    const int32_t n = static_cast<int32_t>(pool.rows / c.layer.top_k);
    MG_CUDA_CHECK(cudaMemcpyAsync(io.num_tokens, &n, sizeof(n), cudaMemcpyHostToDevice, s));
    kernels::launch_fill_uniform(c.precision.dtype, io.x, io_rows * h, 1.0f, 1000 + 17 * b + i, s);
    MG_CUDA_CHECK(cudaStreamSynchronize(s));  // `n` lives on this stack frame
  };

  auto step_once = [&](bool graph) {
    if (!train) {
      graph ? step.forward(b, s) : step.run_eager(b, StepPhase::kForward, s);
      return;
    }
    graph ? step.forward_train(b, s) : step.run_eager(b, StepPhase::kForwardTrain, s);
    graph ? step.backward(b, s) : step.run_eager(b, StepPhase::kBackward, s);
    if (c.training.delay_wgrad) graph ? step.wgrad(b, s) : step.run_eager(b, StepPhase::kWgrad, s);
  };
  auto flush = [&] { MG_CUDA_CHECK(cudaMemsetAsync(l2_flush.get(), b & 0xff, l2_flush.bytes(), s)); };
  EventTimer timer;
  auto timed = [&](const RoutingPool& pool, int count, bool graph, double* host_us) {
    std::vector<float> t;
    double host = 0;
    for (int i = 0; i < c.bench.warmup + count; ++i) {
      reroute(pool, i);
      flush();
      const auto h0 = std::chrono::steady_clock::now();
      double launch_us = 0;
      const float ms = timer.time(s, [&] {
        step_once(graph);
        launch_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count();
      });
      if (i >= c.bench.warmup) t.push_back(ms), host += launch_us;
    }
    if (host_us) *host_us = host / count;
    return median(t);
  };
  row.tokens = io.tokens;
  row.rows = routed_rows;
  row.capture_ms = step.capture_ms(b);
  row.eager_ms = timed(full, std::min(replays, 10), false, nullptr);
  row.replay_ms = timed(full, replays, true, &row.host_us);
  row.replay_quarter_ms = timed(quarter, replays, true, nullptr);
  if (ops && layer) {  // each operator, eager, on the same routings as the eager step
    OpTimer op_timer;
    for (int i = 0; i < c.bench.warmup + std::min(replays, 10); ++i) {
      reroute(full, i);
      flush();
      op_timer.start(s);
      step_once(false);
      if (i >= c.bench.warmup) op_timer.finish();
      MG_CUDA_CHECK(cudaStreamSynchronize(s));
    }
    row.ops = op_timer.medians();
    // The same eager step captured once with an event node after every operator: each operator's
    // time inside a replay, launch gaps included (each replay draws a new routing).
    OpTimer graph_timer(true);
    const GraphExec graph(s, [&] {
      graph_timer.start(s);
      step_once(false);
    }, cudaStreamCaptureModeThreadLocal);
    for (int i = 0; i < c.bench.warmup + replays; ++i) {
      reroute(full, i);
      flush();
      graph.launch(s);
      if (i >= c.bench.warmup) graph_timer.finish();
      MG_CUDA_CHECK(cudaStreamSynchronize(s));
    }
    row.graph_ops = graph_timer.medians();
    row.kernel_nodes = graph.kernel_nodes();
  }
  step.check_device_errors(s);
  row.dropped = step.read_dropped(s);
  row.flops = (train ? 18.0 : 6.0) * routed_rows * h * f;
  const StepTraffic traffic = step_traffic(c, full_tokens, io.rows, full.active);
  row.active_experts = traffic.active_experts;
  row.bytes = step_bytes(traffic);

  // Baselines on the same total rows.
  Baselines base(c, routed_rows);
  base.dense(baseline, s);  // warm-up outside capture (cuBLASLt heuristics)
  GraphExec dense(s, [&] { base.dense(baseline, s); });
  std::vector<float> td;
  for (int i = 0; i < replays; ++i) {
    flush();
    td.push_back(timer.time(s, [&] { dense.launch(s); }));
  }
  row.dense_ms = median(td);
  LegacyExpertLoop fc1(c.layer.experts, 2 * f, h, routed_rows, 1, c.precision.dtype);
  LegacyExpertLoop fc2(c.layer.experts, h, f, routed_rows, 1, c.precision.dtype);
  // The per-expert loop writes every expert's weight gradient: the step's own [G, ...] buffers.
  const StepWeights& w = baseline;
  std::vector<float> tl;
  for (int i = 0; i < std::min(replays, 10) + 1; ++i) {
    full.select(i, splits, s);
    flush();
    const float ms = timer.time(s, [&] {
      fc1.fprop_not_capturable(base.x.get(), splits, w.w1, base.h1.get(), s);
      fc2.fprop_not_capturable(base.a.get(), splits, w.w2, base.y.get(), s);
      if (!train) return;
      fc2.dgrad_not_capturable(base.y.get(), splits, w.w2, base.a.get(), s);
      fc2.wgrad_not_capturable(base.y.get(), base.a.get(), splits, w.dw2, w.main_grad2, s);
      fc1.dgrad_not_capturable(base.h1.get(), splits, w.w1, base.x.get(), s);
      fc1.wgrad_not_capturable(base.h1.get(), base.x.get(), splits, w.dw1, w.main_grad1, s);
    });
    if (i > 0) tl.push_back(ms);  // the first run picks cuBLASLt algorithms
  }
  row.legacy_ms = median(tl);
  return 0;
}

}  // namespace

int run_step_bench(const Config& c, const StepBenchOptions& options) {
  const int replays = options.replays > 0 ? options.replays : c.bench.replays;
  cudaDeviceProp prop{};
  const DeviceInfo device = require_supported_device();  // "no CUDA device" or a wrong GPU, said plainly
  MG_CUDA_CHECK(cudaGetDeviceProperties(&prop, device.device));
  std::printf("device: %s, %d SMs, L2 %d MB\nconfig: %s (%d experts, hidden %lld, ffn %lld, top-%d, %s, %s)\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, c.name.c_str(), c.layer.experts,
              static_cast<long long>(c.layer.hidden), static_cast<long long>(c.layer.ffn), c.layer.top_k,
              std::string(dtype_name(c.precision.dtype)).c_str(),
              c.training.enabled ? (c.training.delay_wgrad ? "training, delayed wgrad" : "training") : "inference");
  const TorchResults* torch = options.torch ? &*options.torch : nullptr;
  if (torch) {
    std::printf("torch: %s (PyTorch %s, %s, graph replay of the whole layer%s)\n", torch->path.c_str(),
                torch->torch_version.c_str(), torch->grouped_mm.c_str(),
                c.step == StepKind::kMoeLayer ? "" : "; this config times the experts alone");
    if (torch->device != prop.name)
      std::printf("WARNING: the torch results were measured on '%s', this run is on '%s'\n", torch->device.c_str(),
                  prop.name);
  }
  cudaStream_t s;
  MG_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::fprintf(stderr, "measuring the roofline...\n");
  const Roofline roof = measure_roofline(s);  // before the step's buffers: it borrows ~2 GiB
  std::printf("%s\n", roof.describe().c_str());
  std::fprintf(stderr, "capturing %zu buckets...\n", c.buckets.size());
  const StepGraphsOptions step_options = step_graphs_options(c);
  const testing::OwnedStepWeights weights = testing::make_step_weights(step_options, s);  // the caller's parameters
  StepGraphs step(step_options, weights.weights);
  // The 16-bit baselines (dense GEMMs, per-expert loop) need 16-bit weights: the step's own, or,
  // when the step reads prequantized MXFP8 weights, the same values in bf16 next to them.
  StepGraphsOptions baseline_options = step_options;
  baseline_options.layer.prequantized_weights = false;
  const testing::OwnedStepWeights baseline = step_options.layer.prequantized_weights
                                                 ? testing::make_step_weights(baseline_options, s)
                                                 : testing::OwnedStepWeights{};
  const StepWeights& baseline_weights = step_options.layer.prequantized_weights ? baseline.weights : weights.weights;
  DeviceBuffer l2_flush(2 * static_cast<std::size_t>(prop.l2CacheSize));
  std::vector<Row> rows(step.num_buckets());
  for (int b = 0; b < step.num_buckets(); ++b) {
    progress(b, step.num_buckets(), "buckets");
    run_bucket(step, baseline_weights, b, c, replays, options.ops, s, l2_flush, rows[b]);
  }
  progress(step.num_buckets(), step.num_buckets(), "buckets");
  std::fprintf(stderr, "\n");
  MG_CUDA_CHECK(cudaStreamDestroy(s));

  const char* what = c.training.enabled ? "train step (forward_train + backward + wgrad)" : "inference forward";
  if (c.step == StepKind::kMoeLayer) {
    std::vector<layer::OpSpec> ops = layer::moe_layer_ops(moe_layer_options(c, c.buckets.front()));
    if (c.router.fuse_weights) layer::fuse_routing_weights(ops);
    std::printf("step: whole MoE layer (%s router%s%s): %s\n", std::string(router_score_name(c.router.score)).c_str(),
                c.router.renormalize ? ", renormalized" : "", c.router.aux_loss_coef > 0 ? ", aux loss" : "",
                layer::describe(ops).c_str());
  } else {
    std::printf("step: experts only (FC1 -> SwiGLU -> FC2 on grouped rows, %s routing)\n",
                std::string(routing_kind_name(c.routing.kind)).c_str());
  }
  if (c.precision.recipe == Recipe::kMXFP8) {
    // The experts' saved activations (every slot's x and, with delayed wgrad, dy of FC1 and FC2:
    // their slots' copies, sized here; bf16 training keeps the same bytes as the layer's per-slot
    // tensors that FC1 and FC2 point to) against the same layer in bf16, and the whole bucket.
    Config bf16 = c;
    bf16.precision.recipe = Recipe::kBF16;
    bf16.precision.prequantized_weights = false;
    bf16.precision.dequantized_weights = false;
    auto saved = [](const Config& cfg, int64_t rows) {
      std::size_t bytes = 0;
      const MoeLayerOptions o = moe_layer_options(cfg, 1);
      for (int fc : {1, 2})
        for (const auto& buf : GroupedLinear::workspace_buffers(layer::expert_linear_options(o, fc, rows)))
          if (buf.name.find("slot") != std::string::npos) bytes += buf.bytes;
      return bytes;
    };
    const StepPlan mx_plan = plan_step(step_graphs_options(c)), bf_plan = plan_step(step_graphs_options(bf16));
    std::printf("recipe mxfp8 (row_align %d, weights %s), per bucket, mxfp8 / bf16 MiB: the experts' saved tensors, "
                "the bucket's arena, and the device memory of the bucket alone (arena, weights and gradients, mxfp8 "
                "copies):\n", c.row_align,
                c.precision.prequantized_weights
                    ? (c.precision.dequantized_weights ? "prequantized by the caller, with their bf16 values"
                                                       : "prequantized by the caller")
                    : (c.precision.dequantized_weights ? "quantized by the step, one shared copy, kept dequantized too"
                                                       : "quantized by the step, one shared copy"));
    for (std::size_t b = 0; b < mx_plan.buckets.size(); ++b)
      std::printf("  %lld tokens: saved %.1f / %.1f, arena %.1f / %.1f, device %.1f / %.1f\n",
                  static_cast<long long>(mx_plan.buckets[b].tokens), saved(c, mx_plan.buckets[b].rows) / 1048576.0,
                  saved(bf16, bf_plan.buckets[b].rows) / 1048576.0, mx_plan.buckets[b].bytes / 1048576.0,
                  bf_plan.buckets[b].bytes / 1048576.0, mx_plan.bucket_device_bytes(b) / 1048576.0,
                  bf_plan.bucket_device_bytes(b) / 1048576.0);
  }
  std::printf("%s, median of %d replays (eager and legacy: %d), fill %.2f, arena %.1f MiB for %d graphs\n\n", what,
              replays, std::min(replays, 10), c.bench.fill, step.plan().arena_bytes / 1048576.0, step.graph_count());
  Table table;
  uint64_t dropped = 0;
  for (const Row& r : rows) dropped += r.dropped;
  if (c.router.capacity_factor > 0)
    std::printf("capacity factor %.3g: %llu (token, expert) assignments dropped over all replays\n\n",
                c.router.capacity_factor, static_cast<unsigned long long>(dropped));
  std::printf("floor = max(FLOPs at the dense rate, fewest bytes at the copy bandwidth) of the step at the configured "
              "fill (bytes: docs/PERF.md, Method); of roofline = floor / replay ms%s\n\n",
              torch ? "; vs torch = torch ms / replay ms (above 1: faster than PyTorch)" : "");
  // PyTorch's graph replay of a bucket, or nothing where that bucket or its capture failed there.
  auto torch_ms = [&](const Row& r) { return torch ? torch->at(r.tokens).graph_ms : std::nullopt; };
  for (const Row& r : rows) {
    std::vector<std::string> cells = {
        std::to_string(r.tokens), std::to_string(r.rows), fmt(r.capture_ms, 1), fmt(r.eager_ms, 3),
        fmt(r.replay_ms, 3), fmt(r.replay_quarter_ms, 3), fmt(r.host_us, 1), fmt(r.flops / r.replay_ms / 1e9, 1),
        fmt(roof.floor_ms(r.flops, r.bytes), 3), roof.bound(r.flops, r.bytes),
        fmt(roof.floor_ms(r.flops, r.bytes) / r.replay_ms, 2), fmt(r.legacy_ms, 3), fmt(r.legacy_ms / r.replay_ms, 2)};
    if (torch) {
      const std::optional<double> t = torch_ms(r);
      cells.push_back(t ? fmt(*t, 3) : "failed");
      cells.push_back(t ? fmt(*t / r.replay_ms, 2) : "-");
    }
    table.add(cells);
  }
  std::vector<std::string> header = {"tokens", "rows", "capture ms", "eager ms", "replay ms", "replay@25% ms",
                                     "host us", "TFLOP/s", "floor ms", "bound", "of roofline", "legacy ms",
                                     "vs legacy"};
  if (torch) header.insert(header.end(), {"torch ms", "vs torch"});
  table.print(header);
  if (options.ops && c.step != StepKind::kMoeLayer) std::printf("\n--ops: only whole-layer configs run operator by operator\n");
  auto print_ops = [](const std::vector<OpTime>& ops, const std::string& head) {
    double sum = 0;
    for (const OpTime& t : ops) sum += t.total();
    std::printf("\n%s; share of their sum, %.3f ms):\n\n", head.c_str(), sum);
    Table table;
    for (const OpTime& t : ops)
      table.add({t.op, fmt(t.forward_ms, 3), fmt(t.backward_ms, 3), fmt(t.wgrad_ms, 3), fmt(t.total(), 3),
                 fmt(100 * t.total() / sum, 1) + "%"});
    table.print({"operator", "forward ms", "backward ms", "wgrad ms", "total ms", "share"});
  };
  for (const Row& r : rows) {
    if (r.ops.empty()) continue;
    const std::string tokens = std::to_string(r.tokens) + " tokens, per operator";
    print_ops(r.ops, tokens + " (eager, median of " + std::to_string(std::min(replays, 10)) +
                         " runs, against the eager step's " + fmt(r.eager_ms, 3) + " ms");
    print_ops(r.graph_ops, tokens + " (inside replays of the eager step captured once, " +
                               std::to_string(r.kernel_nodes) +
                               " kernel nodes, an event node after each operator; median of " +
                               std::to_string(replays) + " replays, against the step graphs' replay of " +
                               fmt(r.replay_ms, 3) + " ms");
  }

  if (!options.json_path.empty()) {
    nlohmann::json out;
    out["device"] = prop.name;
    out["config"] = nlohmann::json::parse(to_json(c));
    out["phase"] = what;
    out["replays"] = replays;
    out["arena_bytes"] = step.plan().arena_bytes;
    out["roofline"] = {{"dense_tflops", roof.dense_tflops}, {"copy_gbps", roof.copy_gbps}};
    if (torch)
      out["torch"] = {{"file", torch->path}, {"device", torch->device}, {"torch", torch->torch_version},
                      {"grouped_mm", torch->grouped_mm}};
    for (const Row& r : rows) {
      const double floor = roof.floor_ms(r.flops, r.bytes);
      nlohmann::json jb = {{"tokens", r.tokens}, {"rows", r.rows}, {"capture_ms", r.capture_ms},
                           {"eager_ms", r.eager_ms}, {"replay_ms", r.replay_ms},
                           {"replay_quarter_fill_ms", r.replay_quarter_ms}, {"host_us_per_replay", r.host_us},
                           {"tflops", r.flops / r.replay_ms / 1e9}, {"dense_ms", r.dense_ms},
                           {"legacy_ms", r.legacy_ms}, {"flops", r.flops}, {"dropped_assignments", r.dropped},
                           {"step_bytes", r.bytes}, {"active_experts", r.active_experts}, {"floor_ms", floor},
                           {"bound", roof.bound(r.flops, r.bytes)}, {"of_roofline", floor / r.replay_ms}};
      for (const OpTime& t : r.ops)
        jb["ops"].push_back({{"op", t.op}, {"forward_ms", t.forward_ms}, {"backward_ms", t.backward_ms},
                             {"wgrad_ms", t.wgrad_ms}});
      for (const OpTime& t : r.graph_ops)
        jb["ops_in_graph"].push_back({{"op", t.op}, {"forward_ms", t.forward_ms}, {"backward_ms", t.backward_ms},
                                      {"wgrad_ms", t.wgrad_ms}});
      if (!r.graph_ops.empty()) jb["ops_graph_kernel_nodes"] = r.kernel_nodes;
      if (torch) {
        const std::optional<double> t = torch_ms(r);
        jb["torch_ms"] = t ? nlohmann::json(*t) : nlohmann::json(nullptr);
        jb["vs_torch"] = t ? nlohmann::json(*t / r.replay_ms) : nlohmann::json(nullptr);
      }
      out["buckets"].push_back(jb);
    }
    out["step"] = std::string(step_kind_name(c.step));
    out["recipe"] = std::string(recipe_name(c.precision.recipe));
    write_json_results(out, options.json_path);
  }
  return 0;
}

}  // namespace moegraph::bench
