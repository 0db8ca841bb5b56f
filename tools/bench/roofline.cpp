#include "tools/bench/roofline.hpp"

#include <algorithm>
#include <cstdio>
#include <vector>

#include "graphs/graph_exec.hpp"
#include "kernels/elementwise/elementwise.hpp"
#include "src/core/device_buffer.hpp"
#include "src/core/lt_gemm.hpp"
#include "tools/bench/bench_util.hpp"
#include "tools/bench/stream_probe.hpp"

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
    // The best of four streams over 1 GiB (20x the L2): cudaMemcpy, a copy kernel (bytes read +
    // written), a read-only and a write-only stream. Reads alone stream faster than a copy, so the
    // best of them is the floor no phase can beat, whatever its mix of reads and writes.
    const std::size_t bytes = std::size_t{1} << 30;
    DeviceBuffer src(bytes), dst(bytes);
    MG_CUDA_CHECK(cudaMemsetAsync(src.get(), 0x3c, bytes, stream));
    int sms = 0, device = 0;
    MG_CUDA_CHECK(cudaGetDevice(&device));
    MG_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    const int grid = sms * 8;
    auto gbps = [&](double moved, auto work) { return moved / replayed_median(stream, work, 20) / 1e6; };
    r.memcpy_gbps = gbps(2.0 * bytes, [&] {
      MG_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, stream));
    });
    r.copy_kernel_gbps = gbps(2.0 * bytes, [&] { launch_stream(StreamKind::kCopy, dst.get(), src.get(), bytes, grid, stream); });
    r.read_gbps = gbps(bytes, [&] { launch_stream(StreamKind::kRead, dst.get(), src.get(), bytes, grid, stream); });
    r.write_gbps = gbps(bytes, [&] { launch_stream(StreamKind::kWrite, dst.get(), nullptr, bytes, grid, stream); });
    r.copy_gbps = std::max({r.memcpy_gbps, r.copy_kernel_gbps, r.read_gbps, r.write_gbps});
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
