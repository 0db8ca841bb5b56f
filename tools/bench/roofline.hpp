// The roofline every benchmark judges against, measured on this GPU in the same run: the dense
// cuBLASLt bf16 rate (a large square GEMM) and the device-memory streaming bandwidth (the best of
// cudaMemcpy, a copy kernel, a read-only and a write-only stream, so no phase can beat it). A phase's floor
// is the larger of its FLOPs at the dense rate and its fewest bytes at the copy bandwidth; the
// fraction reached is floor / measured time (1.0 = at the roofline). Ratios to a dense GEMM of the
// same rows mean nothing for a memory-bound MoE layer; this does.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace moegraph::bench {

struct Roofline {
  double dense_tflops = 0;  // cuBLASLt bf16 8192^3, fp32 accumulate
  double copy_gbps = 0;     // the memory roofline, GB/s: the best of the four streams below
  double memcpy_gbps = 0, copy_kernel_gbps = 0;  // device-to-device copies, bytes read + written
  double read_gbps = 0, write_gbps = 0;          // read-only and write-only streams

  double compute_ms(double flops) const { return flops / dense_tflops / 1e9; }
  double memory_ms(double bytes) const { return bytes / copy_gbps / 1e6; }
  double floor_ms(double flops, double bytes) const;
  // "memory" or "compute": which side sets the floor.
  const char* bound(double flops, double bytes) const;
  std::string describe() const;  // one line for the report
};

// What one step of an expert MLP layer (FC1 [2f, h] -> SwiGLU -> FC2 [h, f] per expert) must move
// at the least. The model, a floor that any implementation pays (docs/PERF.md, Method):
//   inference: the weights of the experts that receive rows, read once (3·h·f per expert), and
//              x read and y written once;
//   training:  those weights read twice (forward and dgrad); the weight gradients, either the fp32
//              main_grad of the active experts read and written (8 B per element) or, without it,
//              every expert's gradient written in the layer's dtype (empty experts get zeros); and
//              x, y, dy and dx once each.
// Left out on purpose: the intermediate activations (FC1's output [rows, 2f], SwiGLU's [rows, f]
// and their gradients), which a fused implementation need not write to memory; the router's weight
// (E·h, under 1% of the experts' weights for every preset); the gathered copies of x and the
// scattered rows of y, which the whole layer's dispatch and combine move but a fused one need not.
struct StepTraffic {
  int64_t hidden = 0, ffn = 0;
  int experts = 0;
  double active_experts = 0;  // experts that receive rows (mean over the routings replayed)
  int64_t io_rows = 0;        // rows of x and y: tokens for the whole layer, routed rows for experts only
  double act_bytes = 2;       // element size of x, y, dy, dx and of the weight gradients without main_grad
  double weight_bytes = 2;    // bytes per weight element the GEMMs read: 2 for bf16, 1 + 1/32 for MXFP8 copies
  bool training = false;
  bool main_grad_fp32 = false;
};
double step_bytes(const StepTraffic& t);

// The expected number of experts that receive at least one row when each of `tokens` tokens picks
// `top_k` distinct experts uniformly: E·(1 - (1 - k/E)^tokens). The whole layer's router, on the
// benchmark's random x, routes about uniformly; for one token it is exactly top_k.
double expected_active_experts(int experts, int top_k, int64_t tokens);

// Times both on the current device (medians of graph replays; L2 cannot hold the copy's 2 x 1 GiB).
// Allocates ~2 GiB for the duration of the call.
Roofline measure_roofline(cudaStream_t stream);

// Enqueues the roofline's copy kernel (16-byte loads and stores, four in flight per thread, eight
// 256-thread blocks per SM) over `bytes` (a multiple of 16) from src to dst; capturable.
void launch_copy_kernel(void* dst, const void* src, std::size_t bytes, cudaStream_t stream);

}  // namespace moegraph::bench
