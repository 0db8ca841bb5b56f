#include "tools/bench/plan_report.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moegraph/error.hpp"
#include "moegraph/moe_layer.hpp"
#include "moegraph/step_graphs.hpp"
#include "src/core/byte_units.hpp"
#include "src/core/device_info.hpp"

namespace moegraph::bench {
namespace {

using nlohmann::json;

// One bucket's expert-parallel window per rank, for the worst case (dropless) and for the bound
// parallel.recv_rows when one is configured; the plan counts the one allocated.
struct EpWindow {
  int64_t tokens = 0;
  int64_t worst_case_rows = 0;
  std::size_t worst_case_bytes = 0;
  int64_t bound_rows = 0;  // 0: no bound
  std::size_t bound_bytes = 0;
  int64_t chunk_rows = 0;  // send/recv: rows of each chunk (0: peer stores)
  std::size_t chunk_bytes = 0;
  bool chunk_bounded = false;  // the chunks hold fewer rows than a source may route: the "worst case" drops
};

std::vector<EpWindow> ep_windows(const Config& config) {
  std::vector<EpWindow> out;
  if (config.parallel.expert_parallel <= 1) return out;
  for (int64_t tokens : config.buckets) {
    const MoeLayerOptions o = moe_layer_options(config, tokens);
    MoeLayerOptions dropless = o;
    dropless.ep_recv_rows = 0;
    EpWindow w;
    w.tokens = tokens;
    w.worst_case_rows = moe_ep_worst_case_rows(dropless);
    w.worst_case_bytes = MoeLayer::window_bytes(dropless);
    // A bound at or above this bucket's worst case bounds nothing here (the layer sizes the worst case).
    w.bound_rows = o.ep_recv_rows < w.worst_case_rows ? o.ep_recv_rows : 0;
    if (w.bound_rows > 0) w.bound_bytes = MoeLayer::window_bytes(o);
    if (o.ep_exchange == EpExchange::kSendRecv) {
      w.chunk_rows = moe_ep_chunk_rows(o);
      w.chunk_bytes = static_cast<std::size_t>(w.chunk_rows) * o.hidden * dtype_size(o.dtype);
      // A token's k experts are distinct, so a source sends one peer at most tokens * min(k, the
      // peer's experts) rows (validated sizes: the product is exact).
      const int64_t to_one_peer = o.max_tokens * std::min<int64_t>(o.top_k, moe_local_experts(o));
      w.chunk_bounded = w.chunk_rows < to_one_peer;
    }
    out.push_back(w);
  }
  return out;
}

void print_ep_windows(const Config& config, const std::vector<EpWindow>& windows) {
  if (windows.empty()) return;
  std::printf("expert parallel: %d ranks, %d experts per rank, exchange %s; tokens per bucket and every size below "
              "are per rank\n", config.parallel.expert_parallel, config.layer.experts / config.parallel.expert_parallel,
              std::string(ep_exchange_name(config.parallel.exchange)).c_str());
  for (const EpWindow& w : windows) {
    std::printf("  %lld tokens: window %s with %lld receive rows (%s)", static_cast<long long>(w.tokens),
                human_bytes(w.worst_case_bytes).c_str(), static_cast<long long>(w.worst_case_rows),
                w.chunk_bounded ? "worst case of the chunks: rows past a chunk are dropped and counted"
                                : "worst case: dropless");
    if (w.bound_rows > 0)
      std::printf("; %s with the bound of %lld rows (the one allocated; rows past it dropped and counted)",
                  human_bytes(w.bound_bytes).c_str(), static_cast<long long>(w.bound_rows));
    if (w.chunk_rows > 0)
      std::printf("; send/recv chunks of %lld rows (%s) per peer: every exchange moves %d of them, %s, whatever "
                  "the routing (staged once to send and twice to receive)",
                  static_cast<long long>(w.chunk_rows), human_bytes(w.chunk_bytes).c_str(),
                  config.parallel.expert_parallel,
                  human_bytes(w.chunk_bytes * static_cast<std::size_t>(config.parallel.expert_parallel)).c_str());
    std::printf("\n");
  }
}

// The line a reader looks for: does the step fit this machine's GPU?
void print_fit(const StepPlan& plan, const std::optional<DeviceInfo>& gpu) {
  const std::string total = human_bytes(plan.device_bytes());
  if (!gpu) {
    std::printf("no GPU found to compare against: the step needs %s of device memory\n", total.c_str());
    return;
  }
  const std::string name =
      detail::concat("GPU ", gpu->device, " (", gpu->name, ", ", human_bytes(gpu->total_memory), ")");
  if (plan.device_bytes() <= gpu->total_memory) {
    std::printf("fits %s: the step needs %s (%.0f%%), plus the CUDA context\n", name.c_str(), total.c_str(),
                100.0 * plan.device_bytes() / gpu->total_memory);
    return;
  }
  std::string fitting;
  for (std::size_t b = 0; b < plan.buckets.size(); ++b)
    if (plan.bucket_device_bytes(b) <= gpu->total_memory)
      fitting.append(" ").append(std::to_string(plan.buckets[b].tokens));
  std::printf("WARNING: the step needs %s of device memory, more than %s has; buckets that fit alone:%s\n",
              total.c_str(), name.c_str(), fitting.empty() ? " none" : fitting.c_str());
}

json plan_json(const Config& config, const StepPlan& plan, const std::vector<EpWindow>& windows,
               const std::optional<DeviceInfo>& gpu) {
  json out;
  out["name"] = config.name;
  out["config"] = json::parse(to_json(config));
  out["buckets"] = json::array();
  for (std::size_t i = 0; i < plan.buckets.size(); ++i) {
    const BucketPlan& b = plan.buckets[i];
    json buffers = json::array();
    for (const PlannedBuffer& buf : b.buffers) {
      json entry = {{"name", buf.name}, {"offset", buf.offset}, {"bytes", buf.bytes}};
      if (!buf.within.empty()) entry["within"] = buf.within;
      buffers.push_back(std::move(entry));
    }
    out["buckets"].push_back({{"tokens", b.tokens}, {"rows", b.rows}, {"bytes", b.bytes},
                              {"window_bytes", b.window_bytes}, {"device_bytes", plan.bucket_device_bytes(i)},
                              {"buffers", std::move(buffers)}});
  }
  out["arena_bytes"] = plan.arena_bytes;
  out["sum_of_buckets"] = plan.sum_of_buckets;
  out["weight_bytes"] = plan.weight_bytes;
  out["mxfp8_copy_bytes"] = plan.mxfp8_copy_bytes;
  out["mxfp8_dequantized_bytes"] = plan.mxfp8_dequantized_bytes;
  out["window_bytes"] = plan.window_bytes;
  out["shard_window_bytes"] = plan.shard_window_bytes;
  out["device_bytes"] = plan.device_bytes();
  out["kernels"] = plan.kernels;
  out["expert_parallel"] = nullptr;
  if (!windows.empty()) {
    json per_bucket = json::array();
    for (const EpWindow& w : windows)
      per_bucket.push_back({{"tokens", w.tokens}, {"worst_case_rows", w.worst_case_rows},
                            {"worst_case_bytes", w.worst_case_bytes}, {"recv_rows", w.bound_rows},
                            {"bound_bytes", w.bound_bytes}, {"chunk_rows", w.chunk_rows},
                            {"chunk_bytes", w.chunk_bytes}, {"chunk_bounded", w.chunk_bounded}});
    out["expert_parallel"] = {{"ranks", config.parallel.expert_parallel},
                              {"exchange", std::string(ep_exchange_name(config.parallel.exchange))},
                              {"experts_per_rank", config.layer.experts / config.parallel.expert_parallel},
                              {"windows", std::move(per_bucket)}};
  }
  out["gpu_name"] = gpu ? json(gpu->name) : json(nullptr);
  out["gpu_memory_bytes"] = gpu ? json(gpu->total_memory) : json(nullptr);
  out["fits"] = gpu ? json(plan.device_bytes() <= gpu->total_memory) : json(nullptr);
  return out;
}

}  // namespace

int run_plan(const Config& config, const std::string& json_path) {
  const StepPlan plan = plan_step(step_graphs_options(config));
  const std::vector<EpWindow> windows = ep_windows(config);
  const std::optional<DeviceInfo> gpu = find_current_device();
  std::printf("config: %s\n", config.name.c_str());
  print_ep_windows(config, windows);
  std::printf("%s", plan.to_string().c_str());
  print_fit(plan, gpu);
  if (json_path.empty()) return 0;
  std::ofstream f(json_path);
  f << plan_json(config, plan, windows, gpu).dump(2) << "\n";
  MG_CHECK(f.good(), "cannot write the plan to ", json_path);
  std::printf("plan written to %s\n", json_path.c_str());
  return 0;
}

}  // namespace moegraph::bench
