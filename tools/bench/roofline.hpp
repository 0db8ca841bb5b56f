// The roofline every benchmark judges against, measured on this GPU in the same run: the dense
// cuBLASLt bf16 rate (a large square GEMM) and the device-memory streaming bandwidth (the best of a
// copy, a read-only and a write-only stream, so no phase can beat it). A phase's floor
// is the larger of its FLOPs at the dense rate and its fewest bytes at the copy bandwidth; the
// fraction reached is floor / measured time (1.0 = at the roofline). Ratios to a dense GEMM of the
// same rows mean nothing for a memory-bound MoE layer; this does.
#pragma once

#include <cuda_runtime_api.h>

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

// Times both on the current device (medians of graph replays; L2 cannot hold the copy's 2 x 1 GiB).
// Allocates ~2 GiB for the duration of the call.
Roofline measure_roofline(cudaStream_t stream);

}  // namespace moegraph::bench
