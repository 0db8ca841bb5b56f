// measure_roofline (tools/bench/roofline.hpp): the dense cuBLASLt rate and the best of four
// memory streams, a copy, a read-only and a write-only stream with 16-byte accesses, four in flight
// per thread, and cudaMemcpy.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "graphs/graph_exec.hpp"
#include "kernels/elementwise/elementwise.hpp"
#include "moegraph/error.hpp"
#include "src/core/device_buffer.hpp"
#include "src/core/lt_gemm.hpp"
#include "tools/bench/bench_util.hpp"
#include "tools/bench/roofline.hpp"

namespace moegraph::bench {
namespace {

enum class StreamKind { kCopy, kRead, kWrite };

constexpr int kThreads = 256, kUnroll = 4;

__global__ void stream_copy(uint4* __restrict__ dst, const uint4* __restrict__ src, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * kThreads;
  std::size_t i = static_cast<std::size_t>(blockIdx.x) * kThreads + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldcs(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) __stcs(dst + i + u * stride, v[u]);
  }
  for (; i < n; i += stride) __stcs(dst + i, __ldcs(src + i));
}

// Folds everything it reads into one word per thread, stored only if it matches a value the data
// never holds, so the loads cannot be dropped and nothing is written.
__global__ void stream_read(const uint4* __restrict__ src, std::size_t n, unsigned* sink) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * kThreads;
  std::size_t i = static_cast<std::size_t>(blockIdx.x) * kThreads + threadIdx.x;
  unsigned acc = 0;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint4 v = __ldcs(src + i + u * stride);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
  }
  for (; i < n; i += stride) {
    const uint4 v = __ldcs(src + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

__global__ void stream_write(uint4* __restrict__ dst, std::size_t n, unsigned value) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * kThreads;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride)
    __stcs(dst + i, make_uint4(value, value, value, value));
}

void launch_stream(StreamKind kind, void* dst, const void* src, std::size_t bytes, int grid, cudaStream_t stream) {
  const std::size_t n = bytes / 16;
  switch (kind) {
    case StreamKind::kCopy:
      stream_copy<<<grid, kThreads, 0, stream>>>(static_cast<uint4*>(dst), static_cast<const uint4*>(src), n);
      break;
    case StreamKind::kRead:
      stream_read<<<grid, kThreads, 0, stream>>>(static_cast<const uint4*>(src), n, static_cast<unsigned*>(dst));
      break;
    case StreamKind::kWrite: stream_write<<<grid, kThreads, 0, stream>>>(static_cast<uint4*>(dst), n, 0x3c3c3c3cu); break;
  }
  MG_LAUNCH_CHECK();
}

}  // namespace

void launch_copy_kernel(void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
  int sms = 0, device = 0;
  MG_CUDA_CHECK(cudaGetDevice(&device));
  MG_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  launch_stream(StreamKind::kCopy, dst, src, bytes, sms * 8, stream);
}

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
    // cudaMemcpy timed on the stream, not replayed: captured into a graph it becomes a memcpy node,
    // about 2.7 TB/s on an H200, while on a stream it reaches about 4.25 TB/s, the fastest read +
    // write stream measured there. It runs no kernel that Nsight Compute sees, and no SM copy
    // measured reaches it (docs/PERF.md, "What a copy can reach"). Four copies back to back per
    // timing, so the host's enqueue is not timed.
    {
      auto copy = [&] {
        MG_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, stream));
      };
      copy();
      constexpr int kBatch = 4;
      EventTimer timer;
      std::vector<float> t;
      for (int i = 0; i < 10; ++i)
        t.push_back(timer.time(stream, [&] {
          for (int j = 0; j < kBatch; ++j) copy();
        }) / kBatch);
      r.memcpy_gbps = 2.0 * bytes / median(t) / 1e6;
    }
    r.copy_kernel_gbps = gbps(2.0 * bytes, [&] { launch_copy_kernel(dst.get(), src.get(), bytes, stream); });
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
