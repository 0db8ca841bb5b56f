// moegraph-bench CONFIG for an expert-parallel config (parallel.expert_parallel = R > 1): one process
// per GPU under scripts/launch, each running its rank of the captured step; rank 0 prints. Per bucket
// (tokens per rank): the step's graph replay and eager times (rank 0's median and the slowest rank's
// median), the dispatch and combine alone (events around each operator, forward and backward) with
// the bytes each rank stores into windows and their rate, and, in the same run, NCCL's own
// all-to-all of the same bytes per rank (ncclAlltoAll), the ceiling the exchanges are judged
// against. The operators are timed twice: eagerly (each kernel launched from the host as it comes),
// and inside a graph replay, as the captured step runs them (the eager step captured once with an
// external event after every operator; the all-to-all captured alone between two such events).
// Each rank draws its own tokens (so the routing differs per rank and per replay);
// the ranks meet on a small all-reduce before every timed run, outside the timing, and L2 is
// flushed before it.
#include "tools/bench/ep_bench.hpp"

#include <nccl.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "graphs/graph_exec.hpp"
#include "kernels/elementwise/elementwise.hpp"
#include "moegraph/nccl_ep.hpp"
#include "moegraph/step_graphs.hpp"
#include "src/core/checks.hpp"
#include "src/core/device_buffer.hpp"
#include "testing/step_weights.hpp"
#include "tools/bench/bench_util.hpp"
#include "tools/bench/json_results.hpp"
#include "tools/bench/op_timer.hpp"
#include "tools/bench/ranks.hpp"

namespace moegraph::bench {
namespace {

// The dispatch's and combine's medians per phase.
struct ExchangeTimes {
  double dispatch_fwd_ms = 0, combine_fwd_ms = 0, dispatch_bwd_ms = 0, combine_bwd_ms = 0;
};

struct EpRow {
  int64_t tokens = 0, rows = 0;  // per rank: capacity, and the (token, expert) rows it sends
  double replay_ms = 0, replay_max_ms = 0, eager_ms = 0;
  ExchangeTimes eager, in_graph;  // launched from the host as they come; inside graph replays
  double exchange_bytes = 0;      // per rank and exchange: every row it sends, once
  double alltoall_ms = 0, alltoall_graph_ms = 0;
  double gbps(double ms) const { return ms > 0 ? exchange_bytes / ms / 1e6 : 0.0; }
};

void run_bucket(StepGraphs& step, int b, const Config& c, int replays, int rank, Ranks& group, cudaStream_t s,
                DeviceBuffer& l2_flush, EpRow& row) {
  const BucketIO io = step.io(b);
  const bool train = c.training.enabled;
  const int64_t h = c.layer.hidden;
  const int64_t n = std::max<int64_t>(1, static_cast<int64_t>(io.tokens * c.bench.fill));
  const int32_t n32 = static_cast<int32_t>(n);
  MG_CUDA_CHECK(cudaMemcpy(io.num_tokens, &n32, sizeof n32, cudaMemcpyHostToDevice));
  if (train) kernels::launch_fill_uniform(c.precision.dtype, io.dy, io.tokens * h, 1.0f, 13 + b, s);
  const uint64_t seed = 1000 + 17 * b + 7919 * static_cast<uint64_t>(rank);
  auto step_once = [&](bool graph) {
    if (!train) return graph ? step.forward(b, s) : step.run_eager(b, StepPhase::kForward, s);
    graph ? step.forward_train(b, s) : step.run_eager(b, StepPhase::kForwardTrain, s);
    graph ? step.backward(b, s) : step.run_eager(b, StepPhase::kBackward, s);
    if (c.training.delay_wgrad) graph ? step.wgrad(b, s) : step.run_eager(b, StepPhase::kWgrad, s);
  };
  // Before each run: new tokens on this rank (a new routing), L2 flushed, the ranks together.
  auto prepare = [&](int i) {
    kernels::launch_fill_uniform(c.precision.dtype, io.x, io.tokens * h, 1.0f, seed + i, s);
    MG_CUDA_CHECK(cudaMemsetAsync(l2_flush.get(), i & 0xff, l2_flush.bytes(), s));
    group.meet(rank, s);
  };
  EventTimer timer;
  auto timed = [&](int count, bool graph) {
    std::vector<float> t;
    for (int i = 0; i < c.bench.warmup + count; ++i) {
      prepare(i);
      const float ms = timer.time(s, [&] { step_once(graph); });
      if (i >= c.bench.warmup) t.push_back(ms);
    }
    return median(t);
  };
  row.tokens = io.tokens;
  row.rows = n * c.layer.top_k;
  row.exchange_bytes = static_cast<double>(row.rows) * h * dtype_size(c.precision.dtype);
  row.eager_ms = timed(std::min(replays, 10), false);
  row.replay_ms = timed(replays, true);
  row.replay_max_ms = group.max(rank, row.replay_ms, s);
  // The exchanges among the step's operators: `run` once per timed run, `ops` recording an event
  // after every operator.
  auto time_exchanges = [&](OpTimer& ops, int runs, auto run) {
    for (int i = 0; i < c.bench.warmup + runs; ++i) {
      prepare(i);
      run();
      if (i >= c.bench.warmup) ops.finish();
      MG_CUDA_CHECK(cudaStreamSynchronize(s));
    }
    ExchangeTimes e;
    for (const OpTime& t : ops.medians()) {
      if (t.op == "dispatch") e.dispatch_fwd_ms = t.forward_ms, e.dispatch_bwd_ms = t.backward_ms;
      if (t.op == "combine") e.combine_fwd_ms = t.forward_ms, e.combine_bwd_ms = t.backward_ms;
    }
    return e;
  };
  {
    OpTimer ops;
    row.eager = time_exchanges(ops, std::min(replays, 10), [&] {
      ops.start(s);
      step_once(false);
    });
  }
  {
    // The eager step captured once (its host bookkeeping ends where it began: a whole step), an
    // event node after every operator; each replay draws new tokens, so a new routing.
    OpTimer ops(true);
    const GraphExec graph(s, [&] {
      ops.start(s);
      step_once(false);
    }, cudaStreamCaptureModeThreadLocal);
    row.in_graph = time_exchanges(ops, replays, [&] { graph.launch(s); });
  }
  step.check_device_errors(s);
  // NCCL's all-to-all of the same bytes per rank: an equal share to every rank.
  const int ranks = std::max(1, c.parallel.expert_parallel);
  const std::size_t per_peer = static_cast<std::size_t>(row.exchange_bytes) / ranks;
  DeviceBuffer send(per_peer * ranks + 1), recv(per_peer * ranks + 1);
  auto alltoall = [&] { MG_NCCL_CHECK(ncclAlltoAll(send.get(), recv.get(), per_peer, ncclChar, group.nccl(), s)); };
  std::vector<float> t;
  for (int i = 0; i < c.bench.warmup + replays; ++i) {
    MG_CUDA_CHECK(cudaMemsetAsync(l2_flush.get(), i & 0xff, l2_flush.bytes(), s));
    group.meet(rank, s);
    const float ms = timer.time(s, alltoall);
    if (i >= c.bench.warmup) t.push_back(ms);
  }
  row.alltoall_ms = median(t);
  // Captured between two event nodes, as the operators above.
  EventTimer span;
  const GraphExec graph(s, [&] {
    span.begin(s, cudaEventRecordExternal);
    alltoall();
    span.end(s, cudaEventRecordExternal);
  }, cudaStreamCaptureModeThreadLocal);
  t.clear();
  for (int i = 0; i < c.bench.warmup + replays; ++i) {
    MG_CUDA_CHECK(cudaMemsetAsync(l2_flush.get(), i & 0xff, l2_flush.bytes(), s));
    group.meet(rank, s);
    graph.launch(s);
    if (i >= c.bench.warmup) t.push_back(span.ms());
  }
  row.alltoall_graph_ms = median(t);
}

}  // namespace

int run_ep_bench(const Config& c, const StepBenchOptions& options) {
  const int ranks = c.parallel.expert_parallel;
  MG_CHECK(c.step == StepKind::kMoeLayer, "expert parallelism needs step \"moe_layer\"");  // before any launch advice
  MG_CHECK(nccl_ep_environment_present(), "the config spreads its experts over ", ranks,
           " rank(s): run one process per GPU, e.g. scripts/launch -n ", ranks,
           " -- moegraph-bench followed by the same arguments");
  const std::shared_ptr<NcclEpComm> comm = nccl_ep_comm_from_environment();
  MG_CHECK(comm->ranks() == ranks, "the launch has ", comm->ranks(), " ranks but parallel.expert_parallel is ", ranks);
  const bool lead = comm->rank() == 0;
  const int replays = options.replays > 0 ? options.replays : c.bench.replays;
  cudaDeviceProp prop{};
  MG_CUDA_CHECK(cudaGetDeviceProperties(&prop, comm->device()));
  if (lead)
    std::printf("device: %s x %d ranks, %s\nconfig: %s (%d experts, %d per rank, hidden %lld, ffn %lld, top-%d, %s)\n",
                prop.name, ranks, comm->transport().c_str(), c.name.c_str(), c.layer.experts, c.layer.experts / ranks,
                static_cast<long long>(c.layer.hidden), static_cast<long long>(c.layer.ffn), c.layer.top_k,
                c.training.enabled ? "training" : "inference");
  cudaStream_t s = nullptr;
  MG_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const StepGraphsOptions step_options = step_graphs_options(c);
  const testing::OwnedStepWeights weights = testing::make_step_weights(step_options, s);
  if (lead) std::fprintf(stderr, "capturing %zu buckets on every rank...\n", c.buckets.size());
  StepGraphs step(step_options, weights.weights, comm);
  Ranks group(ranks, comm);
  DeviceBuffer l2_flush(2 * static_cast<std::size_t>(prop.l2CacheSize));
  std::vector<EpRow> rows(step.num_buckets());
  for (int b = 0; b < step.num_buckets(); ++b) {
    if (lead) progress(b, step.num_buckets(), "buckets");
    run_bucket(step, b, c, replays, comm->rank(), group, s, l2_flush, rows[b]);
  }
  if (lead) progress(step.num_buckets(), step.num_buckets(), "buckets"), std::fprintf(stderr, "\n");
  MG_CUDA_CHECK(cudaStreamDestroy(s));
  if (!lead) return 0;

  std::printf("median of %d replays (eager runs and eager exchanges: %d), fill %.2f; every rank draws its own "
              "tokens anew "
              "before each run\nexchange bytes: each rank's routed rows x hidden x %zu bytes, stored once into the "
              "owners' windows (its own rows included); all-to-all: ncclAlltoAll of the same bytes per rank\n\n",
              replays, std::min(replays, 10), c.bench.fill, dtype_size(c.precision.dtype));
  if (c.parallel.exchange == EpExchange::kSendRecv) {
    // The chunk of the largest bucket (each bucket's is its own max_tokens * top_k or the bound).
    const MoeLayerOptions largest = moe_layer_options(c, c.buckets.back());
    std::printf("exchange send_recv (grouped ncclSend / ncclRecv): every exchange moves %d chunks of %lld rows "
                "per rank in the largest bucket, whatever the routing; MB/rank and GB/s count the routed rows only\n\n",
                ranks, static_cast<long long>(moe_ep_chunk_rows(largest)));
  }
  if (ranks == 1)
    std::printf("a group of one: the layer runs without expert parallelism, so \"dispatch\" and \"combine\" are the "
                "single-GPU operators (no window exchange); this checks the benchmark's plumbing, not an exchange\n\n");
  Table table;
  for (const EpRow& r : rows) {
    const double a2a = r.gbps(r.alltoall_ms);
    auto vs = [&](double ms) { return a2a > 0 && ms > 0 ? fmt(r.gbps(ms) / a2a, 2) : std::string("-"); };
    table.add({std::to_string(r.tokens), fmt(r.replay_ms, 3), fmt(r.replay_max_ms, 3), fmt(r.eager_ms, 3),
               fmt(r.exchange_bytes / 1e6, 2), fmt(r.eager.dispatch_fwd_ms, 3),
               fmt(r.gbps(r.eager.dispatch_fwd_ms), 0), fmt(r.eager.combine_fwd_ms, 3),
               fmt(r.gbps(r.eager.combine_fwd_ms), 0), fmt(r.alltoall_ms, 3), fmt(a2a, 0),
               vs(r.eager.dispatch_fwd_ms), vs(r.eager.combine_fwd_ms)});
  }
  table.print({"tokens/rank", "replay ms", "slowest rank", "eager ms", "MB/rank", "dispatch ms", "GB/s",
               "combine ms", "GB/s", "all-to-all ms", "GB/s", "dispatch/a2a", "combine/a2a"});
  if (c.training.enabled) {
    std::printf("\nbackward exchanges (the combine's backward is a dispatch of dy rows, the dispatch's a combine):\n");
    Table back;
    for (const EpRow& r : rows)
      back.add({std::to_string(r.tokens), fmt(r.eager.combine_bwd_ms, 3), fmt(r.gbps(r.eager.combine_bwd_ms), 0),
                fmt(r.eager.dispatch_bwd_ms, 3), fmt(r.gbps(r.eager.dispatch_bwd_ms), 0)});
    back.print({"tokens/rank", "combine bwd ms", "GB/s", "dispatch bwd ms", "GB/s"});
  }
  // Inside graph replays: the forward exchanges, and for training the backward ones.
  using Column = std::pair<const char*, double ExchangeTimes::*>;
  std::vector<Column> exchanges = {{"dispatch", &ExchangeTimes::dispatch_fwd_ms},
                                   {"combine", &ExchangeTimes::combine_fwd_ms}};
  if (c.training.enabled)
    exchanges.insert(exchanges.end(), {{"combine bwd", &ExchangeTimes::combine_bwd_ms},
                                       {"dispatch bwd", &ExchangeTimes::dispatch_bwd_ms}});
  std::printf("\ninside graph replays (the step captured with an event after every operator; ncclAlltoAll captured "
              "alone between two events; median of %d):\n", replays);
  Table in_graph;
  for (const EpRow& r : rows) {
    const double a2a = r.gbps(r.alltoall_graph_ms);
    std::vector<std::string> cells = {std::to_string(r.tokens)};
    for (const Column& e : exchanges) cells.push_back(fmt(r.in_graph.*e.second, 3));
    cells.insert(cells.end(), {fmt(r.alltoall_graph_ms, 3), fmt(a2a, 0)});
    for (const Column& e : exchanges) {
      const double ms = r.in_graph.*e.second;
      cells.push_back(a2a > 0 && ms > 0 ? fmt(r.gbps(ms) / a2a, 2) : std::string("-"));
    }
    in_graph.add(cells);
  }
  std::vector<std::string> head = {"tokens/rank"};
  for (const Column& e : exchanges) head.push_back(std::string(e.first) + " ms");
  head.insert(head.end(), {"all-to-all ms", "GB/s"});
  for (const Column& e : exchanges) head.push_back(std::string(e.first) + "/a2a");
  in_graph.print(head);
  if (!options.json_path.empty()) {
    nlohmann::json out;
    out["config"] = nlohmann::json::parse(to_json(c));
    out["device"] = prop.name;
    out["ranks"] = ranks;
    out["transport"] = comm->transport();
    out["exchange"] = std::string(ep_exchange_name(c.parallel.exchange));
    out["replays"] = replays;
    for (const EpRow& r : rows)
      out["buckets"].push_back({{"tokens_per_rank", r.tokens}, {"rows_per_rank", r.rows},
                                {"replay_ms", r.replay_ms}, {"replay_ms_slowest_rank", r.replay_max_ms},
                                {"eager_ms", r.eager_ms}, {"exchange_bytes_per_rank", r.exchange_bytes},
                                {"dispatch_forward_ms", r.eager.dispatch_fwd_ms},
                                {"combine_forward_ms", r.eager.combine_fwd_ms},
                                {"dispatch_backward_ms", r.eager.dispatch_bwd_ms},
                                {"combine_backward_ms", r.eager.combine_bwd_ms},
                                {"alltoall_ms", r.alltoall_ms},
                                {"in_graph",
                                 {{"dispatch_forward_ms", r.in_graph.dispatch_fwd_ms},
                                  {"combine_forward_ms", r.in_graph.combine_fwd_ms},
                                  {"dispatch_backward_ms", r.in_graph.dispatch_bwd_ms},
                                  {"combine_backward_ms", r.in_graph.combine_bwd_ms},
                                  {"alltoall_ms", r.alltoall_graph_ms}}}});
    write_json_results(out, options.json_path);
  }
  return 0;
}

}  // namespace moegraph::bench
