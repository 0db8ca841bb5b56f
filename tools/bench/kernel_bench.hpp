// moegraph-bench --kernels: the grouped GEMM kernels alone, against their roofline and baselines.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moegraph::bench {

// One grouped FC: `groups` experts of weight [n, k], `rows` routed rows in all (tokens * top_k).
struct KernelShape {
  std::string name;
  int groups = 0;
  int64_t k = 0, n = 0, rows = 0;
};

// NAME:GROUPS:K:N:ROWS, e.g. "olmoe_fc1:64:2048:2048:16384". Limits (checked, with a reason):
// 1 <= GROUPS <= 1024; K and N multiples of 16 in [16, 65536]; 1 <= ROWS <= 2^24; the weights
// (GROUPS * N * K) at most 2^34 elements. Throws moegraph::Error (invalid argument).
KernelShape parse_kernel_shape(const std::string& spec);

struct KernelBenchOptions {
  std::string set = "presets";      // presets | quick | fine | all (presets and fine)
  std::vector<KernelShape> shapes;  // --shape: replaces the set
  std::string json_path;            // --json FILE: every result, the roofline and the routings
  int replays = 0;                  // 0: 40 (quick: 15)
  bool mxfp8_dequantized = false;   // --mxfp8-dequantized: MXFP8 fprop/dgrad also on weights kept dequantized
};
// The shapes `options` names (the set, or the --shape list).
std::vector<KernelShape> kernel_bench_shapes(const KernelBenchOptions& options);

int run_kernel_bench(const KernelBenchOptions& options);

}  // namespace moegraph::bench
