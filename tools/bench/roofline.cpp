#include "tools/bench/roofline.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "graphs/graph_exec.hpp"
#include "kernels/elementwise/elementwise.hpp"
#include "src/core/device_buffer.hpp"
#include "src/core/lt_gemm.hpp"
#include "tools/bench/bench_util.hpp"

namespace moegraph::bench {

double Roofline::floor_ms(double flops, double bytes) const { return std::max(compute_ms(flops), memory_ms(bytes)); }

const char* Roofline::bound(double flops, double bytes) const {
  return compute_ms(flops) >= memory_ms(bytes) ? "compute" : "memory";
}

std::string Roofline::describe() const {
  char buf[200];
  std::snprintf(buf, sizeof buf, "roofline (measured in this run): dense bf16 %.0f TFLOP/s (cuBLASLt 8192^3), "
                "device copy %.0f GB/s (read + write)", dense_tflops, copy_gbps);
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

namespace {

template <class F>
double replayed_median(cudaStream_t stream, F work, int replays) {
  work();  // warm-up outside capture (cuBLASLt heuristics, module loading)
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));
  GraphExec graph(stream, work);
  EventTimer timer;
  std::vector<float> t;
  for (int i = 0; i < replays; ++i) t.push_back(timer.time(stream, [&] { graph.launch(stream); }));
  return median(t);
}

}  // namespace

Roofline measure_roofline(cudaStream_t stream) {
  Roofline r;
  {
    const std::size_t bytes = std::size_t{1} << 30;
    DeviceBuffer src(bytes), dst(bytes);
    MG_CUDA_CHECK(cudaMemsetAsync(src.get(), 0x3c, bytes, stream));
    const double ms = replayed_median(stream, [&] {
      MG_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, stream));
    }, 20);
    r.copy_gbps = 2.0 * bytes / ms / 1e6;
  }
  {
    constexpr int64_t n = 8192;
    DeviceBuffer a(n * n * 2), b(n * n * 2), c(n * n * 2);
    kernels::launch_fill_uniform(DType::kBF16, a.get(), n * n, 1.0f, 3, stream);  // random non-zero data
    kernels::launch_fill_uniform(DType::kBF16, b.get(), n * n, 1.0f, 4, stream);
    LtGemm lt;
    RowMajorGemm g;
    g.trans_b = true, g.m = n, g.n = n, g.k = n;
    g.a = a.get(), g.lda = n, g.b = b.get(), g.ldb = n, g.c = c.get(), g.ldc = n;
    const double ms = replayed_median(stream, [&] { lt.run(g, stream); }, 20);
    r.dense_tflops = 2.0 * n * n * n / ms / 1e9;
  }
  return r;
}

}  // namespace moegraph::bench
