// Grouped GEMM launchers (host-callable; no device code here). Every launcher reads the group
// sizes from device splits/offsets only: the grid is fixed at set-up and blocks walk the tiles
// that exist, so a captured launch serves any routing and its cost follows the real rows.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "moegraph/types.hpp"

namespace moegraph::kernels {

// fprop: C[r, :] = A[r, :] · W_e^T (+ s_r b_e)   A = x [rows, K], W [G, N, K], C = y [rows, N]
// dgrad: C[r, :] = A[r, :] · W_e                 A = dy [rows, N], W [G, N, K], C = dx [rows, K]
enum class RaggedGemmKind { kFprop, kDgrad };

// How the wgmma kernels feed their tensor cores: cp.async by every thread with CTA-wide barriers
// (sm90_grouped_gemm_wgmma.cuh), or a warp-specialized TMA producer and mbarrier ring
// (sm90_grouped_gemm_tma.cuh).
enum class GemmPipeline { kCpAsync, kTma };
const char* pipeline_name(GemmPipeline p);

struct RaggedGemmParams {
  const void* a = nullptr;          // [capacity_rows, red], row-major
  const void* w = nullptr;          // [G, N, K]
  int64_t n = 0, k = 0;             // the layer's N and K
  const int32_t* splits = nullptr;  // [G]
  const int64_t* offsets = nullptr; // [G + 1], aligned group starts
  int num_groups = 0;
  const void* bias = nullptr;       // [G, N] (fprop only) or null
  const float* bias_scale = nullptr;// [capacity_rows] or null
  void* c = nullptr;                // [capacity_rows, cols], row-major
  int64_t capacity_rows = 0;        // rows of a and c (the TMA pipeline's tensor extent)
  bool reference = false;           // the foundation WMMA kernel (differential tests) instead of wgmma
  int tile_n = 128;                 // wgmma tile width: 128 or 256 (choose_tile)
  GemmPipeline pipeline = GemmPipeline::kTma;
};

// dW_e = dy_e^T · x_e over group e's rows: written (empty group: zeros) or added into main_grad.
struct WgradParams {
  const void* dy = nullptr;         // [capacity_rows, N]
  const void* x = nullptr;          // [capacity_rows, K]
  int64_t n = 0, k = 0;
  const int32_t* splits = nullptr;
  const int64_t* offsets = nullptr;
  int num_groups = 0;
  void* dweight = nullptr;          // [G, N, K] in the input dtype, or
  float* main_grad = nullptr;       // [G, N, K] fp32, accumulated (beta = 1)
  int64_t capacity_rows = 0;        // rows of dy and x (the TMA pipeline's tensor extent)
  bool reference = false;           // the foundation WMMA kernel (differential tests) instead of wgmma
  int tile_n = 128;                 // wgmma tile width: 128 or 256 (choose_tile)
  GemmPipeline pipeline = GemmPipeline::kTma;
};

// MXFP8 ragged GEMM: C[r, :] = A[r, :] · B_e^T (+ s_r b_e) for the rows r of group e, with A and B
// E4M3 (K-major) and one E8M0 scale per 32 K elements (OCP MX, kernels/quantize/mxfp8.hpp).
// fprop: A = x row-wise, B = W [G, N, K] row-wise; dgrad: A = dy row-wise along N, B = W^T
// [G, K, N] with its scales along N.
struct Mxfp8RaggedGemmParams {
  const uint8_t* a = nullptr;         // [capacity_rows, k] e4m3
  const uint8_t* a_scales = nullptr;  // [capacity_rows, k / 32] e8m0
  const uint8_t* b = nullptr;         // [G, n, k] e4m3
  const uint8_t* b_scales = nullptr;  // [G, n, k / 32] e8m0
  int64_t n = 0, k = 0;               // output columns; the reduction, a multiple of 128
  const int32_t* splits = nullptr;
  const int64_t* offsets = nullptr;
  int num_groups = 0;
  const void* bias = nullptr;         // [G, n] in the output dtype, or null
  const float* bias_scale = nullptr;  // [capacity_rows] or null
  void* c = nullptr;                  // [capacity_rows, n] bf16 or fp16
};
// MXFP8 wgrad: dW_e = dy_e^T · x_e from the column-wise copies (blocks of 32 rows along each column,
// stored transposed; groups start on multiples of 32 rows). Scales are block-major:
// scale of rows [32j, 32j + 32) of column c at j * cols + c.
struct Mxfp8WgradParams {
  const uint8_t* dy_t = nullptr;         // [n, capacity_rows] e4m3
  const uint8_t* dy_t_scales = nullptr;  // [capacity_rows / 32, n] e8m0
  const uint8_t* x_t = nullptr;          // [k, capacity_rows] e4m3
  const uint8_t* x_t_scales = nullptr;   // [capacity_rows / 32, k] e8m0
  int64_t n = 0, k = 0, capacity_rows = 0;  // n, k multiples of 16; capacity_rows of 32
  const int32_t* splits = nullptr;
  const int64_t* offsets = nullptr;      // group starts on multiples of 32
  int num_groups = 0;
  void* dweight = nullptr;               // [G, n, k] bf16 / fp16, written (empty group: zeros), or
  float* main_grad = nullptr;            // [G, n, k] fp32, accumulated
};
// Set-up (before capture): raises the kernels' shared-memory limit.
void prepare_mxfp8_gemm();
void launch_mxfp8_ragged_gemm(DType out, const Mxfp8RaggedGemmParams& p, int sm_count, cudaStream_t stream);
void launch_mxfp8_wgrad(DType out, const Mxfp8WgradParams& p, int sm_count, cudaStream_t stream);

// A kernel's tile configuration, printable.
struct GemmTileConfig {
  const char* name;
  int block_m, block_n, block_k, stages, threads;
  std::string to_string() const;
};
GemmTileConfig wgmma_tile_config(int tile_n, GemmPipeline pipeline);  // the default kernels (wgmma)
GemmTileConfig foundation_tile_config();       // the reference kernels (WMMA)

enum class GemmPhase { kFprop, kDgrad, kWgrad };
// The wgmma tile width for a phase of a layer with `groups` experts, `capacity_rows` rows and
// weights [groups, n, k]; decided at set-up from these shapes alone (the splits live on the
// device). MOEGRAPH_TILE_N=128|256 overrides it (for tuning).
int choose_tile_n(GemmPhase phase, int groups, int64_t capacity_rows, int64_t n, int64_t k);
// The pipeline of a phase on tiles of width tile_n (decided at set-up, after the tile width);
// MOEGRAPH_GEMM_PIPELINE=cp_async|tma overrides it (for tuning and side-by-side measurements).
GemmPipeline choose_pipeline(GemmPhase phase, int tile_n);

// Raises the kernels' shared-memory limits and records how many CTAs of each fit on an SM (the
// persistent grids). Must run at set-up, before capture, before the launchers of that dtype.
void prepare_grouped_gemm(DType dtype);

// `sm_count`: multiprocessors of the device; each kernel launches sm_count x its occupancy CTAs.
void launch_ragged_gemm(DType dtype, RaggedGemmKind kind, const RaggedGemmParams& p, int sm_count,
                        cudaStream_t stream);
void launch_grouped_wgrad(DType dtype, const WgradParams& p, int sm_count, cudaStream_t stream);

}  // namespace moegraph::kernels
