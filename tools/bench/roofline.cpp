// The roofline model (no GPU here; measure_roofline is in roofline_measure.cu).
#include "tools/bench/roofline.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>


namespace moegraph::bench {

double Roofline::floor_ms(double flops, double bytes) const { return std::max(compute_ms(flops), memory_ms(bytes)); }

const char* Roofline::bound(double flops, double bytes) const {
  return compute_ms(flops) >= memory_ms(bytes) ? "compute" : "memory";
}

std::string Roofline::describe() const {
  char buf[320];
  std::snprintf(buf, sizeof buf, "roofline (measured in this run): dense bf16 %.0f TFLOP/s (cuBLASLt 8192^3), "
                "memory %.0f GB/s (best stream: cudaMemcpy %.0f, copy kernel %.0f, read %.0f, write %.0f)",
                dense_tflops, copy_gbps, memcpy_gbps, copy_kernel_gbps, read_gbps, write_gbps);
  return buf;
}

double step_bytes(const StepTraffic& t) {
  const double weights = 3.0 * t.hidden * t.ffn;  // elements of FC1 [2f, h] and FC2 [h, f], one expert
  const double rows = static_cast<double>(t.io_rows) * t.hidden * t.act_bytes;  // one of x, y, dy, dx
  if (!t.training) return t.active_experts * weights * t.weight_bytes + 2 * rows;
  const double grads = t.main_grad_fp32 ? t.active_experts * weights * 8.0 : t.experts * weights * t.act_bytes;
  return 2 * t.active_experts * weights * t.weight_bytes + grads + 4 * rows;
}

double expected_active_experts(int experts, int top_k, int64_t tokens) {
  const double unpicked = 1.0 - static_cast<double>(std::min(top_k, experts)) / experts;  // one token misses an expert
  return experts * (1.0 - std::pow(unpicked, static_cast<double>(tokens)));
}

}  // namespace moegraph::bench
