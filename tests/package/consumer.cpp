// A C++ program built against an installed moegraph with pkg-config alone (tests/package/install_test).
// Without a GPU it plans a config and exits 77; with one it captures a small layer's step, replays the
// forward graph and checks it against the eager path, bit for bit.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <random>
#include <vector>

#include <moegraph/config.hpp>
#include <moegraph/step_graphs.hpp>

namespace {

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

void* upload(std::size_t count, std::mt19937& rng, float scale) {
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<uint16_t> host(count);
  for (auto& v : host) v = to_bf16(u(rng));
  void* p = nullptr;
  if (cudaMalloc(&p, count * 2) != cudaSuccess || cudaMemcpy(p, host.data(), count * 2, cudaMemcpyHostToDevice) != cudaSuccess)
    throw std::runtime_error("cuda allocation failed");
  return p;
}

}  // namespace

int main() try {
  const moegraph::Config config = moegraph::parse_config(
      R"({"layer": {"experts": 8, "hidden": 256, "ffn": 128, "top_k": 2},
          "training": {"enabled": false}, "buckets": [16, 64]})", "consumer");
  moegraph::StepGraphsOptions options = moegraph::step_graphs_options(config);
  const moegraph::StepPlan plan = moegraph::plan_step(options);
  std::printf("cpp-consumer: %zu buckets, arena %zu bytes\n", plan.buckets.size(), plan.arena_bytes);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("cpp-consumer: no GPU, stopping before the device calls\n");
    return 77;
  }
  const auto& l = options.layer;
  std::mt19937 rng(11);
  moegraph::StepWeights w;
  w.router = upload(l.experts * l.hidden, rng, 0.06f);
  w.w1 = upload(l.experts * 2 * l.ffn * l.hidden, rng, 0.06f);
  w.w2 = upload(l.experts * l.hidden * l.ffn, rng, 0.09f);
  moegraph::StepGraphs step(options, w);
  const int bucket = step.bucket_for(40);
  const moegraph::BucketIO io = step.io(bucket);
  const int32_t tokens = 40;
  void* x = upload(io.tokens * l.hidden, rng, 1.0f);
  cudaMemcpy(io.x, x, io.tokens * l.hidden * 2, cudaMemcpyDeviceToDevice);
  cudaMemcpy(io.num_tokens, &tokens, 4, cudaMemcpyHostToDevice);
  std::vector<uint16_t> graph(tokens * l.hidden), eager(graph.size());
  step.forward(bucket, nullptr);
  cudaMemcpy(graph.data(), io.y, graph.size() * 2, cudaMemcpyDeviceToHost);
  step.run_eager(bucket, moegraph::StepPhase::kForward, nullptr);
  cudaMemcpy(eager.data(), io.y, eager.size() * 2, cudaMemcpyDeviceToHost);
  step.check_device_errors(nullptr);
  int nonzero = 0;
  for (std::size_t i = 0; i < graph.size(); ++i) {
    if (graph[i] != eager[i]) {
      std::fprintf(stderr, "cpp-consumer: y element %zu differs between graph and eager\n", i);
      return 1;
    }
    nonzero += (graph[i] & 0x7fff) != 0;
  }
  if (nonzero < static_cast<int>(graph.size()) / 2) {
    std::fprintf(stderr, "cpp-consumer: only %d of %zu outputs are non-zero\n", nonzero, graph.size());
    return 1;
  }
  std::printf("cpp-consumer: bucket %d (%lld tokens): the forward graph matches the eager path\n", bucket,
              static_cast<long long>(io.tokens));
  return 0;
} catch (const moegraph::Error& e) {
  std::fprintf(stderr, "cpp-consumer: %s\n", e.what());
  return 1;
}
