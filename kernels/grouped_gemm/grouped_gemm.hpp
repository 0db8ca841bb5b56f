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
  bool reference = false;           // the foundation WMMA kernel (differential tests) instead of wgmma
  int tile_n = 128;                 // wgmma tile width: 128 or 256 (choose_tile)
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
  bool reference = false;           // the foundation WMMA kernel (differential tests) instead of wgmma
  int tile_n = 128;                 // wgmma tile width: 128 or 256 (choose_tile)
};

// A kernel's tile configuration, printable.
struct GemmTileConfig {
  const char* name;
  int block_m, block_n, block_k, stages, threads;
  std::string to_string() const;
};
GemmTileConfig wgmma_tile_config(int tile_n);  // the default kernels: fprop, dgrad, wgrad on wgmma
GemmTileConfig foundation_tile_config();       // the reference kernels (WMMA)

enum class GemmPhase { kFprop, kDgrad, kWgrad };
// The wgmma tile width for a phase of a layer with `groups` experts, `capacity_rows` rows and
// weights [groups, n, k]; decided at set-up from these shapes alone (the splits live on the
// device). MOEGRAPH_TILE_N=128|256 overrides it (for tuning).
int choose_tile_n(GemmPhase phase, int groups, int64_t capacity_rows, int64_t n, int64_t k);

// Raises the kernels' shared-memory limits and records how many CTAs of each fit on an SM (the
// persistent grids). Must run at set-up, before capture, before the launchers of that dtype.
void prepare_grouped_gemm(DType dtype);

// `sm_count`: multiprocessors of the device; each kernel launches sm_count x its occupancy CTAs.
void launch_ragged_gemm(DType dtype, RaggedGemmKind kind, const RaggedGemmParams& p, int sm_count,
                        cudaStream_t stream);
void launch_grouped_wgrad(DType dtype, const WgradParams& p, int sm_count, cudaStream_t stream);

}  // namespace moegraph::kernels
