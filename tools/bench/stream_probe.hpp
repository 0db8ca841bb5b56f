// Streaming probes of the device memory (bench only): copy, read-only and write-only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace moegraph::bench {

enum class StreamKind { kCopy, kRead, kWrite };
// bytes: a multiple of 16; dst and src 16-byte aligned. kRead ignores dst's contents but needs a
// writable word there; kWrite ignores src.
void launch_stream(StreamKind kind, void* dst, const void* src, std::size_t bytes, int grid, cudaStream_t stream);

}  // namespace moegraph::bench
