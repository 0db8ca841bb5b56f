// MXFP8 expert weights as the mxfp8 recipe's GEMMs read them (docs/mxfp8.md, "Layouts"), for
// callers that hold them already quantized: a server loading an MXFP8 checkpoint (no 16-bit copy
// anywhere), or one quantized copy shared by several operators (StepGraphs shares one across its
// buckets). An operator reads them when its options say prequantized_weights.
#pragma once

#include "moegraph/export.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "moegraph/types.hpp"

namespace moegraph {

// Device pointers to the MXFP8 copies of grouped weights W [G, N, K] (G experts of N outputs and K
// inputs). Every pointer is 16-byte aligned.
//   data     [G, N, K]      E4M3, expert e's element (n, k) at (e * N + n) * K + k
//   scales   [G, N, K / 32] E8M0, the block of inputs [32j, 32j + 32) of (e, n) at (e * N + n) * (K / 32) + j
//   data_t   [G, K, N]      E4M3 of each W_e^T: element (n, k) of expert e at (e * K + k) * N + n
//   scales_t [G, K, N / 32] E8M0, the block of outputs [32j, 32j + 32) of (e, k) at (e * K + k) * (N / 32) + j
// fprop reads data and scales (blocks along K); dgrad reads data_t and scales_t (blocks along N),
// so an inference-only operator needs the first pair alone. wgrad reads neither.
//
// Optional, for operators with dequantized_weights (bf16 activations): the same values dequantized
// to bf16 (docs/mxfp8.md, "Dequantized weights"), 2 bytes per element each:
//   dequantized   [G, N, K] bf16, the values of data and scales, in data's order
//   dequantized_t [G, K, N] bf16, the values of data_t and scales_t, in data_t's order
// fprop and dgrad then read these in place of dequantizing their pair on every call.
//
// Optional, for the GEMM route of groups of few rows (decode, fine-grained experts; `--plan` prints
// it as swap-AB): the scales again, in that route's tile order (docs/mxfp8.md, "Tiled scales"),
// mxfp8_tiled_scale_bytes each:
//   scales_tiled   scales in tiles of 128 rows of N by stages of 128 of K
//   scales_t_tiled scales_t in tiles of 128 rows of K by stages of 128 of N
// With them each stage of a tile reads its scales as one contiguous copy; without them the route
// gathers them from the row-wise scales (correct, and measured slower: docs/PERF.md).
struct Mxfp8Weights {
  uint8_t* data = nullptr;
  uint8_t* scales = nullptr;
  uint8_t* data_t = nullptr;
  uint8_t* scales_t = nullptr;
  void* dequantized = nullptr;
  void* dequantized_t = nullptr;
  uint8_t* scales_tiled = nullptr;
  uint8_t* scales_t_tiled = nullptr;
};

// Bytes of data (and of data_t), G * N * K, and of scales (and of scales_t), G * N * K / 32. Throws
// moegraph::Error for sizes the quantizer refuses (see quantize_mxfp8_weights). Touches no GPU.
MOEGRAPH_API std::size_t mxfp8_weight_data_bytes(int groups, int64_t n, int64_t k);
MOEGRAPH_API std::size_t mxfp8_weight_scale_bytes(int groups, int64_t n, int64_t k);
// Bytes of dequantized (and of dequantized_t): 2 * G * N * K.
MOEGRAPH_API std::size_t mxfp8_dequantized_weight_bytes(int groups, int64_t n, int64_t k);
// Bytes of scales_tiled (and of scales_t_tiled): 512 * G * ceil(N / 128) * ceil(K / 128).
MOEGRAPH_API std::size_t mxfp8_tiled_scale_bytes(int groups, int64_t n, int64_t k);

// Quantizes w [G, N, K] (bf16 or fp16, device) into the pairs of `out` that are set: data with
// scales, data_t with scales_t (a pair is both pointers or neither; at least one pair), and writes
// the dequantized copies that are set (each needs its pair: dequantized with data), in the same
// pass, and the tiled scales that are set (each needs its pair: scales_tiled with data): no output
// may overlap w. The rules (scale choice, rounding, NaN blocks) are docs/mxfp8.md's,
// bit-exact. G in [1, 1024]; N and K
// multiples of 32 in [32, 2^21]. An enqueue path (graph-capturable): it never synchronizes,
// allocates or reads device memory on the host.
MOEGRAPH_API void quantize_mxfp8_weights(DType dtype, const void* w, int groups, int64_t n, int64_t k,
                                         const Mxfp8Weights& out, cudaStream_t stream);

// Writes the dequantized copies of `w` that are set (at least one) from their pairs, the same bits
// quantize_mxfp8_weights writes while quantizing: for weights that arrive already quantized (an
// MXFP8 checkpoint) and are read with dequantized_weights. Sizes and pointers as above; an enqueue
// path (graph-capturable).
MOEGRAPH_API void dequantize_mxfp8_weights(int groups, int64_t n, int64_t k, const Mxfp8Weights& w,
                                           cudaStream_t stream);

// Writes the tiled scales of `w` that are set (at least one) from their pairs' scales, the same
// bytes quantize_mxfp8_weights writes: for weights that arrive already quantized (an MXFP8
// checkpoint). Call it after every change of the scales. Sizes and pointers as above; an enqueue
// path (graph-capturable).
MOEGRAPH_API void tile_mxfp8_weight_scales(int groups, int64_t n, int64_t k, const Mxfp8Weights& w,
                                           cudaStream_t stream);

}  // namespace moegraph
