// moegraph-bench CONFIG for sharded expert weights (parallel.sharding.ranks = W > 1).
//
// Under scripts/launch -n W (one process per GPU, NCCL), per bucket (tokens per rank): the
// unsharded step's graph replay on this GPU (the same layer holding every weight) and the sharded
// step's (rank 0's median and the slowest rank's); then the shard collectives alone, graph-replayed
// — the gather of the full weights and the reduce of every rank's gradient rows — against NCCL's
// ncclAllGather and ncclReduceScatter of the same bytes, in the same run; and each rank's device
// memory for both steps, planned (plan_step) and measured (free memory before and after set-up).
//
// Without a launch the W ranks are emulated on this GPU, one thread each, to check the plumbing:
// their times share one GPU (no multi-GPU measurement), NCCL cannot run there, and memory is the
// plan's only. Before every timed run the ranks meet (outside the timing) and L2 is flushed.
#include "tools/bench/shard_bench.hpp"

#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <thread>

#include "graphs/sharded_weights.hpp"
#include "kernels/elementwise/elementwise.hpp"
#include "moegraph/nccl_ep.hpp"
#include "moegraph/step_graphs.hpp"
#include "src/core/checks.hpp"
#include "src/core/device_buffer.hpp"
#include "testing/graph.hpp"
#include "testing/step_weights.hpp"
#include "tools/bench/bench_util.hpp"
#include "tools/bench/json_results.hpp"
#include "tools/bench/ranks.hpp"

namespace moegraph::bench {
namespace {

struct BucketRow {
  int64_t tokens = 0;
  double unsharded_ms = 0, sharded_ms = 0, sharded_max_ms = 0;
};

struct Results {
  std::vector<BucketRow> buckets;
  double gather_bytes = 0, reduce_bytes = 0;  // the full weights; the full gradients
  double gather_ms = 0, reduce_ms = 0, allgather_ms = 0, reduce_scatter_ms = 0;
  double planned_unsharded = 0, planned_sharded = 0, measured_unsharded = 0, measured_sharded = 0;
};

std::size_t free_bytes() {
  std::size_t free = 0, total = 0;
  MG_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return free;
}

// This rank's shards (rows of every expert tensor under the policy and unit) and their gradients,
// with the router and its gradient whole: what a caller of a sharded step holds.
struct RankShards {
  DeviceBuffer block;
  StepWeights weights;
};

RankShards make_shards(const StepGraphsOptions& o, int rank, cudaStream_t s) {
  const MoeLayerOptions& l = o.layer;
  const std::size_t es = dtype_size(l.dtype), gs = l.main_grad_fp32 ? sizeof(float) : es;
  const auto shapes = sharded_tensor_shapes(o);
  std::vector<std::size_t> offsets;
  std::size_t bytes = 0;
  const auto take = [&](std::size_t n) {
    offsets.push_back(bytes);
    bytes += (n + 255) / 256 * 256;
  };
  const int64_t router = l.experts * l.hidden;
  take(router * es), take(router * gs);
  std::vector<Shard> shard;
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    shard.push_back(shard_for(o.sharding.policy, shapes[t].global_rows, o.sharding.ranks, rank));
    const std::size_t n = static_cast<std::size_t>(shard[t].rows * shapes[t].row_elements);
    take(n * es), take(n * (t < 2 ? gs : es));  // weight gradients fp32 with main_grad_fp32, biases 16-bit
  }
  RankShards out;
  out.block = DeviceBuffer(std::max<std::size_t>(bytes, 1));
  MG_CUDA_CHECK(cudaMemsetAsync(out.block.get(), 0, bytes, s));
  char* base = static_cast<char*>(out.block.get());
  StepWeights& w = out.weights;
  w.router = base + offsets[0];
  kernels::launch_fill_uniform(l.dtype, w.router, router, std::sqrt(3.0f / float(l.hidden)), 5, s);
  if (l.main_grad_fp32) w.main_grad_router = reinterpret_cast<float*>(base + offsets[1]);
  else w.d_router = base + offsets[1];
  void** weight[4] = {&w.w1, &w.w2, &w.b1, &w.b2};
  void* grad[4] = {nullptr, nullptr, nullptr, nullptr};
  const float scale[4] = {1.0f / std::sqrt(float(l.hidden)), 1.0f / std::sqrt(float(l.ffn)), 0.1f, 0.1f};
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    if (shard[t].rows == 0) continue;  // a rank holding no rows passes null
    *weight[t] = base + offsets[2 + 2 * t];
    grad[t] = base + offsets[3 + 2 * t];
    kernels::launch_fill_uniform(l.dtype, *weight[t], shard[t].rows * shapes[t].row_elements, scale[t],
                                 static_cast<uint64_t>(11 + t + 17 * rank), s);
  }
  if (l.main_grad_fp32)
    w.main_grad1 = static_cast<float*>(grad[0]), w.main_grad2 = static_cast<float*>(grad[1]);
  else
    w.dw1 = grad[0], w.dw2 = grad[1];
  w.db1 = grad[2], w.db2 = grad[3];
  MG_CUDA_CHECK(cudaStreamSynchronize(s));
  return out;
}

// One rank's timed runs: before each, `prepare(i)` (new inputs), an L2 flush and a meeting of the
// ranks, all outside the timing; the median over the runs after the warm-up.
struct Runs {
  const Config& c;
  int replays, rank;
  Ranks& ranks;
  cudaStream_t s;
  DeviceBuffer& l2_flush;
  template <class Prepare, class Work>
  double median_ms(Prepare prepare, Work work) {
    EventTimer timer;
    std::vector<float> t;
    for (int i = 0; i < c.bench.warmup + replays; ++i) {
      prepare(i);
      MG_CUDA_CHECK(cudaMemsetAsync(l2_flush.get(), i & 0xff, l2_flush.bytes(), s));
      ranks.meet(rank, s);
      const float ms = timer.time(s, work);
      if (i >= c.bench.warmup) t.push_back(ms);
    }
    return median(t);
  }
};

// A training step (or a forward) of bucket b, graph-replayed, on new tokens each run.
double time_step(StepGraphs& step, int b, Runs& runs) {
  const Config& c = runs.c;
  const cudaStream_t s = runs.s;
  const BucketIO io = step.io(b);
  const int64_t h = c.layer.hidden;
  const int32_t n = static_cast<int32_t>(std::max<int64_t>(1, static_cast<int64_t>(io.tokens * c.bench.fill)));
  MG_CUDA_CHECK(cudaMemcpyAsync(io.num_tokens, &n, sizeof n, cudaMemcpyHostToDevice, s));
  if (c.training.enabled) kernels::launch_fill_uniform(c.precision.dtype, io.dy, io.tokens * h, 1.0f, 13 + b, s);
  const double ms = runs.median_ms(
      [&](int i) {
        kernels::launch_fill_uniform(c.precision.dtype, io.x, io.tokens * h, 1.0f, 1000 + 7919 * runs.rank + i, s);
      },
      [&] {
        if (!c.training.enabled) return step.forward(b, s);
        step.forward_train(b, s);
        step.backward(b, s);
        if (c.training.delay_wgrad) step.wgrad(b, s);
      });
  step.check_device_errors(s);
  return ms;
}

const auto kNoInputs = [](int) {};

void run_rank(const Config& c, int rank, std::shared_ptr<EpComm> comm, Ranks& ranks, int replays, Results& out) {
  const bool lead = rank == 0;
  StepGraphsOptions sharded = step_graphs_options(c);
  StepGraphsOptions full = sharded;
  full.sharding = WeightSharding{};
  // Emulated ranks capture while the other ranks' threads set up and synchronize.
  const cudaStreamCaptureMode mode = ranks.emulated() ? cudaStreamCaptureModeThreadLocal : cudaStreamCaptureModeGlobal;
  sharded.capture_mode = full.capture_mode = mode;
  cudaStream_t s = nullptr;
  MG_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  MG_CUDA_CHECK(cudaGetDeviceProperties(&prop, comm->device() >= 0 ? comm->device() : 0));
  DeviceBuffer l2_flush(2 * static_cast<std::size_t>(prop.l2CacheSize));
  Runs runs{c, replays, rank, ranks, s, l2_flush};
  const int nb = static_cast<int>(c.buckets.size());
  if (lead) {
    out.buckets.resize(nb);
    out.planned_unsharded = static_cast<double>(plan_step(full).device_bytes());
    out.planned_sharded = static_cast<double>(plan_step(sharded).device_bytes());
  }

  // The unsharded step on this GPU: every weight and gradient whole.
  ranks.meet(rank, s);
  std::size_t before = free_bytes();
  {
    const testing::OwnedStepWeights w = testing::make_step_weights(full, s);
    StepGraphs step(full, w.weights);
    if (lead) out.measured_unsharded = static_cast<double>(before - free_bytes());
    for (int b = 0; b < nb; ++b) {
      if (lead) progress(b, 2 * nb, "steps");
      const double ms = time_step(step, b, runs);
      if (lead) out.buckets[b].tokens = c.buckets[b], out.buckets[b].unsharded_ms = ms;
    }
    ranks.meet(rank, s);
  }

  // The sharded step: this rank's shards, the full weights and gradients in the window.
  ranks.meet(rank, s);
  before = free_bytes();
  RankShards shards = make_shards(sharded, rank, s);
  {
    StepGraphs step(sharded, shards.weights, nullptr, comm);
    if (lead) out.measured_sharded = static_cast<double>(before - free_bytes());
    for (int b = 0; b < nb; ++b) {
      if (lead) progress(nb + b, 2 * nb, "steps");
      const double ms = time_step(step, b, runs);
      const double slowest = ranks.max(rank, ms, s);
      if (lead) out.buckets[b].sharded_ms = ms, out.buckets[b].sharded_max_ms = slowest;
    }
    ranks.meet(rank, s);
  }
  if (lead) progress(2 * nb, 2 * nb, "steps"), std::fprintf(stderr, "\n");

  // The collectives alone, on a ShardedWeights of the same options and shards.
  ranks.meet(rank, s);
  ShardedWeights sw(sharded, shards.weights, comm);
  comm->set_up_barrier();
  sw.exchange_shards(s);
  const auto shapes = sharded_tensor_shapes(sharded);
  double weight_bytes = 0, grad_bytes = 0;
  const std::size_t es = dtype_size(c.precision.dtype);
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    const double n = static_cast<double>(shapes[t].global_rows) * static_cast<double>(shapes[t].row_elements);
    weight_bytes += n * es;
    grad_bytes += n * (t < 2 && c.training.main_grad_fp32 ? sizeof(float) : es);
  }
  // The collectives captured once each, replayed.
  testing::Graph gather(s, [&] { sw.gather(s); }, mode);
  const double gather_ms = runs.median_ms(kNoInputs, [&] { gather.launch(s); });
  double reduce_ms = 0;
  if (c.training.enabled) {
    testing::Graph reduce(s, [&] { sw.reduce(/*weights=*/true, /*biases=*/true, s); }, mode);
    reduce_ms = runs.median_ms(kNoInputs, [&] { reduce.launch(s); });
  }
  sw.check_device_errors(s);
  double allgather_ms = 0, reduce_scatter_ms = 0;
  if (!ranks.emulated()) {
    // NCCL's collectives of the same bytes: equal blocks per rank (16-bit words; fp32 words for the
    // reduce when the weight gradients are fp32).
    const int w = c.parallel.sharding.ranks;
    const std::size_t gather_words = static_cast<std::size_t>(std::ceil(weight_bytes / 2 / w));
    const std::size_t word = c.training.main_grad_fp32 ? 4 : 2;
    const std::size_t reduce_words = static_cast<std::size_t>(std::ceil(grad_bytes / word / w));
    DeviceBuffer send(std::max(gather_words * 2, reduce_words * word * w)),
        recv(std::max(gather_words * 2 * w, reduce_words * word));
    allgather_ms = runs.median_ms(kNoInputs, 
        [&] { MG_NCCL_CHECK(ncclAllGather(send.get(), recv.get(), gather_words, ncclBfloat16, ranks.nccl(), s)); });
    if (c.training.enabled)
      reduce_scatter_ms = runs.median_ms(kNoInputs, [&] {
        MG_NCCL_CHECK(ncclReduceScatter(send.get(), recv.get(), reduce_words, word == 4 ? ncclFloat32 : ncclBfloat16,
                                        ncclSum, ranks.nccl(), s));
      });
  }
  const double slow_gather = ranks.max(rank, gather_ms, s), slow_reduce = ranks.max(rank, reduce_ms, s);
  if (lead) {
    out.gather_bytes = weight_bytes, out.reduce_bytes = grad_bytes;
    out.gather_ms = slow_gather, out.reduce_ms = slow_reduce;
    out.allgather_ms = allgather_ms, out.reduce_scatter_ms = reduce_scatter_ms;
  }
  ranks.meet(rank, s);
  MG_CUDA_CHECK(cudaStreamDestroy(s));
}

void print(const Config& c, const Results& r, int replays, bool emulated, const std::string& device,
           const std::string& transport) {
  const int w = c.parallel.sharding.ranks;
  std::printf(
      "device: %s x %d ranks, %s\nconfig: %s (%d experts, hidden %lld, ffn %lld, top-%d, %s), sharding: %s "
      "policy, %s unit, over %d ranks\n",
      device.c_str(), w, transport.c_str(), c.name.c_str(), c.layer.experts, static_cast<long long>(c.layer.hidden),
      static_cast<long long>(c.layer.ffn), c.layer.top_k, c.training.enabled ? "training" : "inference",
      std::string(shard_policy_name(c.parallel.sharding.policy)).c_str(),
      std::string(shard_unit_name(c.parallel.sharding.unit)).c_str(), w);
  if (emulated)
    std::printf(
        "EMULATED ranks: %d threads on one GPU, which their work shares; no multi-GPU measurement, and "
        "NCCL's collectives cannot run here (one process per GPU: scripts/launch -n %d)\n",
        w, w);
  std::printf("median of %d graph replays, fill %.2f; L2 flushed and the ranks met before each\n\n", replays,
              c.bench.fill);
  Table steps;
  for (const BucketRow& b : r.buckets)
    steps.add({std::to_string(b.tokens), fmt(b.unsharded_ms, 3), fmt(b.sharded_ms, 3), fmt(b.sharded_max_ms, 3),
               fmt(b.sharded_ms - b.unsharded_ms, 3)});
  steps.print({"tokens/rank", "unsharded ms", "sharded ms", "slowest rank", "sharded - unsharded"});
  const auto gbps = [](double bytes, double ms) { return ms > 0 ? fmt(bytes / ms / 1e6, 0) : std::string("-"); };
  const auto ms_or_dash = [](double ms) { return ms > 0 ? fmt(ms, 3) : std::string("-"); };
  std::printf("\nshard collectives alone (slowest rank); GB/s = the full tensors' bytes / time, for both:\n");
  Table coll;
  coll.add({"gather weights", fmt(r.gather_bytes / 1e6, 1), ms_or_dash(r.gather_ms), gbps(r.gather_bytes, r.gather_ms),
            ms_or_dash(r.allgather_ms), gbps(r.gather_bytes, r.allgather_ms),
            r.allgather_ms > 0 ? fmt(r.allgather_ms / r.gather_ms, 2) : std::string("-")});
  if (c.training.enabled)
    coll.add({"reduce gradients", fmt(r.reduce_bytes / 1e6, 1), ms_or_dash(r.reduce_ms),
              gbps(r.reduce_bytes, r.reduce_ms), ms_or_dash(r.reduce_scatter_ms),
              gbps(r.reduce_bytes, r.reduce_scatter_ms),
              r.reduce_scatter_ms > 0 ? fmt(r.reduce_scatter_ms / r.reduce_ms, 2) : std::string("-")});
  coll.print({"collective", "MB", "moegraph ms", "GB/s", "NCCL ms", "GB/s", "NCCL ms / moegraph ms"});
  std::printf("NCCL: ncclAllGather (bf16) and ncclReduceScatter (%s, sum) of the same bytes in equal blocks\n",
              c.training.main_grad_fp32 ? "fp32" : "bf16");
  std::printf(
      "\ndevice memory per rank (MB): unsharded step %.1f planned, %s measured; sharded step %.1f planned "
      "(window with the full weights and gradients, plus the shards), %s measured\n",
      r.planned_unsharded / 1e6, emulated ? "-" : fmt(r.measured_unsharded / 1e6, 1).c_str(), r.planned_sharded / 1e6,
      emulated ? "-" : fmt(r.measured_sharded / 1e6, 1).c_str());
}

}  // namespace

int run_shard_bench(const Config& c, const StepBenchOptions& options) {
  const int w = c.parallel.sharding.ranks;
  const int replays = options.replays > 0 ? options.replays : c.bench.replays;
  Results results;
  std::string device, transport;
  bool emulated = !nccl_ep_environment_present();
  if (!emulated) {
    const std::shared_ptr<NcclEpComm> comm = nccl_ep_comm_from_environment();
    MG_CHECK(comm->ranks() == w, "the launch has ", comm->ranks(), " ranks but parallel.sharding.ranks is ", w);
    Ranks ranks(w, comm);
    cudaDeviceProp prop{};
    MG_CUDA_CHECK(cudaGetDeviceProperties(&prop, comm->device()));
    device = prop.name, transport = comm->transport();
    run_rank(c, comm->rank(), comm, ranks, replays, results);
    if (comm->rank() != 0) return 0;
  } else {
    std::fprintf(stderr, "no launch environment: %d emulated ranks on this GPU (plumbing only)\n", w);
    setenv("CUDA_MODULE_LOADING", "EAGER", 0);  // emulated ranks need it before CUDA starts (expert_parallel.hpp)
    EmulatedEpGroup group(w);
    Ranks ranks(w, nullptr);
    cudaDeviceProp prop{};
    MG_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    device = prop.name, transport = group.rank(0)->transport();
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(w);
    for (int r = 0; r < w; ++r)
      threads.emplace_back([&, r] {
        try {
          MG_CUDA_CHECK(cudaSetDevice(0));
          run_rank(c, r, group.rank(r), ranks, replays, results);
        } catch (...) {
          errors[r] = std::current_exception();
        }
      });
    for (auto& t : threads) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }
  print(c, results, replays, emulated, device, transport);
  if (!options.json_path.empty()) {
    nlohmann::json out;
    out["config"] = nlohmann::json::parse(to_json(c));
    out["device"] = device, out["ranks"] = w, out["transport"] = transport, out["emulated"] = emulated;
    out["replays"] = replays;
    for (const BucketRow& b : results.buckets)
      out["buckets"].push_back({{"tokens_per_rank", b.tokens},
                                {"unsharded_ms", b.unsharded_ms},
                                {"sharded_ms", b.sharded_ms},
                                {"sharded_ms_slowest_rank", b.sharded_max_ms}});
    out["gather"] = {
        {"bytes", results.gather_bytes}, {"ms", results.gather_ms}, {"nccl_allgather_ms", results.allgather_ms}};
    out["reduce"] = {{"bytes", results.reduce_bytes},
                     {"ms", results.reduce_ms},
                     {"nccl_reduce_scatter_ms", results.reduce_scatter_ms}};
    out["memory_bytes_per_rank"] = {
        {"unsharded_planned", results.planned_unsharded},
        {"sharded_planned", results.planned_sharded},
        {"unsharded_measured", emulated ? nlohmann::json() : nlohmann::json(results.measured_unsharded)},
        {"sharded_measured", emulated ? nlohmann::json() : nlohmann::json(results.measured_sharded)}};
    write_json_results(out, options.json_path);
  }
  return 0;
}

}  // namespace moegraph::bench
