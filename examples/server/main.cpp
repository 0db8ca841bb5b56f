// moegraph-server-example: how an inference server embeds moegraph. One set of caller-owned
// weights, one StepGraphs per serving thread (a handle serves one thread at a time), and each
// request replays the captured forward graph of the smallest bucket that holds it. Public headers
// and the CUDA runtime only: it builds against an installed package as it does in the tree.
#include <cuda_runtime_api.h>

#include <moegraph/config.hpp>
#include <moegraph/error.hpp>
#include <moegraph/step_graphs.hpp>
#include <moegraph/types.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "server.hpp"

namespace {

constexpr int kNoGpuExit = 77;  // what test harnesses (Meson) count as a skip

constexpr const char* kUsage =
    "usage: moegraph-server-example [CONFIG.json] [--threads N] [--requests N] [--max-tokens N]\n"
    "                               [--seed S] [--check-every K]\n"
    "  CONFIG.json      the layer and its buckets (docs/config.md); default: the built-in preset.\n"
    "                   Served as inference (training is switched off); \"step\" must be \"moe_layer\"\n"
    "  --threads N      serving threads, each with its own stream and StepGraphs (default 4)\n"
    "  --requests N     requests per thread (default 200)\n"
    "  --max-tokens N   largest request in tokens (default: the largest bucket); sizes are log-uniform\n"
    "                   in [1, N]\n"
    "  --seed S         seed of the weights, inputs and request sizes (default 1)\n"
    "  --check-every K  compare 1 of every K requests with the eager path; 0: none (default 10)\n"
    "exit codes: 0 served and every check passed, 1 a check or the run failed, 2 bad arguments or\n"
    "config, 77 no CUDA device\n";

struct Args {
  std::string config_path;
  int threads = 4, requests = 200, check_every = 10;
  int64_t max_tokens = 0;  // 0: the largest bucket
  uint64_t seed = 1;
};

int usage_error(const std::string& what) {
  std::fprintf(stderr, "moegraph-server-example: %s\n%s", what.c_str(), kUsage);
  return 2;
}

// Returns an exit code to stop with (--help, a bad argument), or -1 to go on.
int parse_args(int argc, char** argv, Args& args) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    if (a.empty() || a[0] != '-') {
      if (!args.config_path.empty())
        return usage_error("more than one config given ('" + args.config_path + "', '" + a + "')");
      args.config_path = a;
      continue;
    }
    if (i + 1 >= argc) return usage_error(a + " needs a value");
    const std::string v = argv[++i];
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(v.c_str(), &end, 10);
    const bool integer = !v.empty() && *end == '\0' && errno == 0;
    auto in = [&](long long lo, long long hi) { return integer && n >= lo && n <= hi; };
    auto bad = [&](const char* range) {
      return usage_error(a + " needs an integer in " + range + ", got '" + v + "'");
    };
    if (a == "--threads") {
      if (!in(1, 256)) return bad("[1, 256]");
      args.threads = static_cast<int>(n);
    } else if (a == "--requests") {
      if (!in(1, 10'000'000)) return bad("[1, 10000000]");
      args.requests = static_cast<int>(n);
    } else if (a == "--max-tokens") {
      if (!in(1, moegraph::kMaxLayerTokens)) return bad("[1, the largest bucket]");
      args.max_tokens = n;
    } else if (a == "--seed") {
      if (!in(0, INT64_MAX)) return bad("[0, 2^63)");
      args.seed = static_cast<uint64_t>(n);
    } else if (a == "--check-every") {
      if (!in(0, 10'000'000)) return bad("[0, 10000000]");
      args.check_every = static_cast<int>(n);
    } else {
      return usage_error("unknown option '" + a + "'");
    }
  }
  return -1;
}

// The config as an inference step. Anything wrong here is the config's fault: ConfigError.
moegraph::StepGraphsOptions inference_options(const moegraph::Config& config) {
  auto refuse = [](const std::string& why) { throw moegraph::ConfigError(__FILE__, __LINE__, why); };
  if (config.step != moegraph::StepKind::kMoeLayer)
    refuse("\"step\": \"" + std::string(moegraph::step_kind_name(config.step)) + "\" is not served by this " +
           "example: a server hands the layer tokens, not rows already grouped by expert (use \"moe_layer\")");
  if (config.parallel.expert_parallel != 1)
    refuse("parallel.expert_parallel = " + std::to_string(config.parallel.expert_parallel) +
           ": this example serves one GPU (set it to 1)");
  moegraph::StepGraphsOptions o = moegraph::step_graphs_options(config);
  // Inference captures forward only and reserves nothing for backward: no saved activations, no
  // gradients, so StepWeights needs no main_grad or d* buffers.
  o.layer.training = false;
  o.layer.delay_wgrad = false;
  o.layer.wgrad_slots = 1;
  // Every handle is created before any thread serves, so the default global capture mode (which
  // proves that replays never synchronize or allocate) is safe. A server that builds handles while
  // other threads serve must use cudaStreamCaptureModeThreadLocal.
  o.capture_mode = cudaStreamCaptureModeGlobal;
  try {
    moegraph::validate(o);
  } catch (const moegraph::Error& e) {
    throw moegraph::ConfigError(e.file(), e.line(), e.message());
  }
  return o;
}

// Nearest rank: a latency some request actually had.
double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t rank = static_cast<std::size_t>(std::ceil(p * static_cast<double>(v.size())));
  return v[std::clamp<std::size_t>(rank, 1, v.size()) - 1];
}

std::string latency(const std::vector<double>& us) {
  char line[128];
  std::snprintf(line, sizeof line, "p50 %.1f us, p99 %.1f us, max %.1f us", percentile(us, 0.50), percentile(us, 0.99),
                us.empty() ? 0.0 : *std::max_element(us.begin(), us.end()));
  return line;
}

// Returns the exit code: 1 when any check failed.
int print_report(const std::vector<server::ThreadReport>& reports, double wall_s, int check_every) {
  server::ThreadReport all;
  for (std::size_t t = 0; t < reports.size(); ++t) {
    const server::ThreadReport& r = reports[t];
    std::printf("thread %zu: %zu requests, %lld tokens, %s, checks %d/%d passed\n", t, r.latency_us.size(),
                static_cast<long long>(r.tokens), latency(r.latency_us).c_str(), r.checks_passed,
                r.checks_passed + r.checks_failed);
    all.latency_us.insert(all.latency_us.end(), r.latency_us.begin(), r.latency_us.end());
    all.tokens += r.tokens;
    for (const auto& [bucket, uses] : r.bucket_uses) all.bucket_uses[bucket] += uses;
    all.checks_passed += r.checks_passed;
    all.checks_failed += r.checks_failed;
    all.bitwise_different += r.bitwise_different;
    all.max_abs_diff = std::max(all.max_abs_diff, r.max_abs_diff);
    all.dropped += r.dropped;
    if (!r.first_failure.empty()) std::printf("thread %zu: check FAILED: %s\n", t, r.first_failure.c_str());
  }
  const double requests = static_cast<double>(all.latency_us.size()), tokens = static_cast<double>(all.tokens);
  std::printf("all: %.0f requests, %.0f tokens in %.3f s: %.1f requests/s, %.0f tokens/s; %s\n", requests, tokens,
              wall_s, requests / wall_s, tokens / wall_s, latency(all.latency_us).c_str());
  std::string buckets;
  for (const auto& [bucket, uses] : all.bucket_uses)
    buckets += (buckets.empty() ? "" : ", ") + std::to_string(bucket) + " tokens x " + std::to_string(uses);
  std::printf("requests per bucket: %s\n", buckets.c_str());
  if (all.dropped > 0)
    std::printf("dropped by router.capacity_factor: %llu (token, expert) assignments\n",
                static_cast<unsigned long long>(all.dropped));
  std::string checks = "checks off";
  if (check_every > 0) {
    const int total = all.checks_passed + all.checks_failed;
    std::printf("checks (graph vs eager, 1 of every %d requests): %d passed, %d failed; max |graph - eager| %g, "
                "%llu elements differ bitwise\n",
                check_every, all.checks_passed, all.checks_failed, all.max_abs_diff,
                static_cast<unsigned long long>(all.bitwise_different));
    checks = "checks " + std::to_string(all.checks_passed) + "/" + std::to_string(total) + " passed";
  }
  std::printf("server: %.0f requests, %zu thread%s, p50 %.1f us, p99 %.1f us, %.0f tokens/s, %s\n", requests,
              reports.size(), reports.size() == 1 ? "" : "s", percentile(all.latency_us, 0.50),
              percentile(all.latency_us, 0.99), tokens / wall_s, checks.c_str());
  return all.checks_failed > 0 ? 1 : 0;
}

// Everything from the config to the report; errors propagate to main, which maps them to exit codes.
int serve(const Args& args) {
  const moegraph::Config config =
      args.config_path.empty() ? moegraph::default_config() : moegraph::load_config(args.config_path);
  const moegraph::StepGraphsOptions options = inference_options(config);
  const int64_t largest = options.buckets.back();
  if (args.max_tokens > largest)
    return usage_error("--max-tokens " + std::to_string(args.max_tokens) + " exceeds the largest bucket (" +
                       std::to_string(largest) + " tokens)");
  const int64_t max_tokens = args.max_tokens > 0 ? args.max_tokens : largest;

  // Before touching CUDA otherwise: without a device there is nothing to serve, which is a skip.
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "moegraph-server-example: no CUDA device (%s): nothing to serve\n",
                 status != cudaSuccess ? cudaGetErrorString(status) : "the driver sees none");
    return kNoGpuExit;
  }
  int device = 0;
  server::cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cudaDeviceProp prop{};
  server::cuda_check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  const moegraph::MoeLayerOptions& l = options.layer;
  std::printf("config %s: %d experts, hidden %lld, ffn %lld, top_k %d, %s, recipe %s; inference; max %lld tokens\n",
              config.name.c_str(), l.experts, static_cast<long long>(l.hidden), static_cast<long long>(l.ffn), l.top_k,
              std::string(moegraph::dtype_name(l.dtype)).c_str(), std::string(moegraph::recipe_name(l.recipe)).c_str(),
              static_cast<long long>(max_tokens));
  std::printf("device %d: %s (sm_%d%d)\n", device, prop.name, prop.major, prop.minor);

  const server::DeviceWeights weights(options, args.seed);
  // One handle per serving thread, created here one after another (see inference_options on the
  // capture mode). They share the weights; each has its own arena and graphs.
  std::vector<std::unique_ptr<moegraph::StepGraphs>> graphs;
  double capture_ms = 0.0;
  for (int t = 0; t < args.threads; ++t) {
    graphs.push_back(std::make_unique<moegraph::StepGraphs>(options, weights.w));
    for (int b = 0; b < graphs.back()->num_buckets(); ++b) capture_ms += graphs.back()->capture_ms(b);
  }
  std::printf("%d StepGraphs: %d buckets, %d graphs and a %.1f MiB arena each; captured in %.0f ms in all\n",
              args.threads, graphs[0]->num_buckets(), graphs[0]->graph_count(),
              static_cast<double>(graphs[0]->plan().arena_bytes) / (1 << 20), capture_ms);
  if (l.recipe == moegraph::Recipe::kMXFP8) {
    // MXFP8 GEMMs read quantized copies of the weights: made again from what the weights hold now
    // (the contract after every write of the weights).
    for (auto& g : graphs) g->weights_changed(cudaStreamPerThread);
    server::cuda_check(cudaStreamSynchronize(cudaStreamPerThread), "cudaStreamSynchronize");
  }

  std::vector<std::unique_ptr<server::ServingThread>> servers;
  for (int t = 0; t < args.threads; ++t) {
    const uint64_t thread_seed = server::Rng(args.seed ^ (0xd1b54a32d192ed03ull * (t + 1))).next();
    servers.push_back(std::make_unique<server::ServingThread>(
        *graphs[t], server::ServeParams{device, args.requests, max_tokens, args.check_every, thread_seed}));
  }
  double wall_s = 0.0;
  const std::vector<server::ThreadReport> reports = server::serve_concurrently(servers, wall_s);
  return print_report(reports, wall_s, args.check_every);
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (const int code = parse_args(argc, argv, args); code >= 0) return code;
  try {
    return serve(args);
  } catch (const moegraph::ConfigError& e) {
    std::fprintf(stderr, "moegraph-server-example: invalid config: %s\n", e.message().c_str());
    return 2;
  } catch (const moegraph::Error& e) {
    std::fprintf(stderr, "moegraph-server-example: %s\n", e.message().c_str());
    return e.kind() == moegraph::ErrorKind::kNoDevice ? kNoGpuExit : 1;
  } catch (const std::exception& e) {  // out of memory and the like: a reason, never an abort
    std::fprintf(stderr, "moegraph-server-example: %s\n", e.what());
    return 1;
  }
}
