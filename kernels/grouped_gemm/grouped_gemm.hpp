// Grouped GEMMs (host-callable; no device code here): a problem goes into one heuristic that returns
// a printable config; set-up prepares it on the device (a plan); launches take the plan. Every
// kernel reads the group sizes from device splits/offsets only: the grid is fixed at set-up and
// blocks walk the tiles that exist, so a captured launch serves any routing and its cost follows
// the real rows.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "moegraph/types.hpp"

namespace moegraph::kernels {

// fprop: C[r, :] = A[r, :] · W_e^T (+ s_r b_e)   A = x [rows, K], W [G, N, K], C = y [rows, N]
// dgrad: C[r, :] = A[r, :] · W_e                 A = dy [rows, N], W [G, N, K], C = dx [rows, K]
// wgrad: dW_e = dy_e^T · x_e over group e's rows
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
};

// MXFP8 ragged GEMM: C[r, :] = A[r, :] · B_e^T (+ s_r b_e) for the rows r of group e, with A and B
// E4M3 (K-major) and one E8M0 scale per 32 K elements (OCP MX, kernels/quantize/mxfp8.hpp).
// fprop: A = x row-wise, B = W [G, N, K] row-wise; dgrad: A = dy row-wise along N, B = W^T
// [G, K, N] with its scales along N.
struct Mxfp8RaggedGemmParams {
  const uint8_t* a = nullptr;         // [capacity_rows, k] e4m3
  const uint8_t* a_scales = nullptr;  // [capacity_rows, k / 32] e8m0
  // The same scales as fp32, 2^(e - 127), stage-major (Mxfp8Rowwise::scale_floats of the copy of
  // capacity_rows rows; 16-byte aligned): required by the swap-AB route (kMxfp8SwapAb), which reads
  // them instead of a_scales; the others ignore them.
  const float* a_scale_floats = nullptr;
  const uint8_t* b = nullptr;         // [G, n, k] e4m3
  const uint8_t* b_scales = nullptr;  // [G, n, k / 32] e8m0
  // Optional, the swap-AB route only: b_scales in its tile order (launch_tile_mxfp8_scales with
  // rows n, cols k; 16-byte aligned), one contiguous copy a stage. Null: it copies the stage's 128
  // words from b_scales one by one (measured slower: docs/PERF.md).
  const uint8_t* b_scales_tiled = nullptr;
  int64_t n = 0, k = 0;               // output columns; the reduction, a multiple of 128
  const int32_t* splits = nullptr;
  const int64_t* offsets = nullptr;
  int num_groups = 0;
  const void* bias = nullptr;         // [G, n] in the output dtype, or null
  const float* bias_scale = nullptr;  // [capacity_rows] or null
  void* c = nullptr;                  // [capacity_rows, n] bf16 or fp16
  int64_t capacity_rows = 0;          // rows of a and c (the swap-AB kernel's tensor extent)
  // Device scratch of at least mxfp8_staging_bytes(): the staged route (kMxfp8Staged) dequantizes
  // the operands to bf16 there before the bf16 kernel reads them; the swap-AB route keeps the
  // partial sums of its split reductions there (decode: fewer tiles than CTAs).
  void* staging = nullptr;
  std::size_t staging_bytes = 0;
  // The staged route only: A's bf16 values [capacity_rows, k] are already at the start of staging
  // (the quantizer wrote them: Mxfp8Rowwise::values), so a and a_scales are not read (may be null).
  bool a_staged = false;
  // A config with dequantized_weights only: B's values already dequantized to bf16 [G, n, k] (kept
  // from the last weight update); the launch reads them instead of b and b_scales (which may be null).
  const void* b_dequantized = nullptr;
};
// MXFP8 wgrad: dW_e = dy_e^T · x_e from the column-wise copies (blocks of 32 rows along each column,
// tiled in 128-column strips: kernels::Mxfp8Colwise; groups start on multiples of 32 rows). Scales
// are block-major: scale of rows [32j, 32j + 32) of column c at j * cols + c.
struct Mxfp8WgradParams {
  const uint8_t* dy_t = nullptr;         // [n x capacity_rows] e4m3, tiled
  const uint8_t* dy_t_scales = nullptr;  // [capacity_rows / 32, n] e8m0
  const uint8_t* x_t = nullptr;          // [k x capacity_rows] e4m3, tiled
  const uint8_t* x_t_scales = nullptr;   // [capacity_rows / 32, k] e8m0
  int64_t n = 0, k = 0, capacity_rows = 0;  // n, k multiples of 16; capacity_rows of 32
  const int32_t* splits = nullptr;
  const int64_t* offsets = nullptr;      // group starts on multiples of 32
  int num_groups = 0;
  void* dweight = nullptr;               // [G, n, k] bf16 / fp16, written (empty group: zeros), or
  float* main_grad = nullptr;            // [G, n, k] fp32, accumulated
  void* staging = nullptr;               // the staged route only, as in Mxfp8RaggedGemmParams
  std::size_t staging_bytes = 0;
  // The staged route only: dy's bf16 values [capacity_rows, n], row-major, already made (the
  // quantizer wrote them: Mxfp8Colwise::values), so dy_t and dy_t_scales are not read (may be null)
  // and the staging holds x's values alone (mxfp8_staged_wgrad_bytes).
  const void* dy_values = nullptr;
};
// ---- Problem -> config -> plan -> launch ---------------------------------------------------------
enum class GemmPhase { kFprop, kDgrad, kWgrad };
std::string_view gemm_phase_name(GemmPhase phase);

// The kernel families, one file each (named by arch, format and pipeline).
enum class GemmFamily {
  kReference,      // sm80_grouped_gemm_16bit_wmma.cuh: simple WMMA kernels, the differential-test reference
  kCpAsync16,      // sm90_grouped_gemm_16bit_cp_async.cuh: wgmma fed by cp.async from every thread
  kTma16,          // sm90_grouped_gemm_16bit_tma.cuh: wgmma, warp-specialized TMA producer, mbarrier ring
  kMxfp8CpAsync,   // sm90_grouped_gemm_mxfp8_cp_async.cuh: e4m3 wgmma with per-32 scale promotion
  kMxfp8SwapAb,    // sm90_grouped_gemm_mxfp8_swap_ab.cuh: the same for groups of few rows, operands
                   // swapped (weight rows on M, the group's rows on N), TMA producer (fprop, dgrad)
  kMxfp8Dequant,   // sm90_grouped_gemm_mxfp8_dequant.cuh: MXFP8 operands dequantized to bf16 in shared
                   // memory, bf16 wgmma, TMA producer (fprop, dgrad)
  kMxfp8Staged,    // mxfp8_staged.cpp: MXFP8 operands dequantized to bf16 in device scratch, then the
                   // 16-bit TMA kernel of the config's tile (every phase; bf16 outputs)
};
std::string_view gemm_family_name(GemmFamily family);

// One GEMM of a layer, as far as the host knows it at set-up (the splits live on the device).
struct GemmProblem {
  GemmPhase phase = GemmPhase::kFprop;
  Recipe recipe = Recipe::kBF16;
  DType dtype = DType::kBF16;           // activations (and the bf16 recipe's operands)
  int groups = 0;
  int64_t capacity_rows = 0;
  int64_t expected_rows_per_group = 0;  // the routing the layer expects (today: capacity_rows / groups)
  int64_t n = 0, k = 0;                 // the layer's weights are [groups, n, k]
  bool into_main_grad = false;          // wgrad: accumulated into fp32 main_grad (else written to dW)
  // mxfp8 fprop/dgrad: the weights' values are kept dequantized to bf16 (GroupedLinearOptions::
  // dequantized_weights), so the staged route costs only the activations' pass.
  bool dequantized_weights = false;
};

// The kernel of an MXFP8 GEMM: E4M3 wgmma on 128-row tiles, E4M3 wgmma with the operands swapped
// (groups of few rows), the operands dequantized to bf16 on chip (bf16 wgmma), or dequantized to
// bf16 in device scratch for the bf16 kernel (staged). wgrad takes E4M3 or staged (swap_ab and
// dequant are fprop/dgrad kernels: wgrad keeps E4M3 under them). Staged needs bf16 activations:
// forced on fp16 ones, the heuristic's route runs.
enum class Mxfp8Route { kAuto, kE4m3, kSwapAb, kDequant, kStaged };

// Choices forced by the caller or, where the caller left them open, by the environment.
struct GemmOverrides {
  bool reference = false;                         // the reference (WMMA) kernels
  int tile_n = 0;                                 // 0: the heuristic's; 128 or 256
  GemmPipeline pipeline = GemmPipeline::kAuto;    // 16-bit wgmma kernels: cp.async or TMA
  int mxfp8_ping_pong = -1;                       // -1: the heuristic's; 0 or 1
  Mxfp8Route mxfp8_route = Mxfp8Route::kAuto;    // mxfp8 fprop/dgrad
  int wgrad_ping_pong = -1;                       // 16-bit TMA wgrad: -1 the heuristic's; 0 or 1
};
// `base` completed from MOEGRAPH_TILE_N=128|256, MOEGRAPH_GEMM_PIPELINE=tma|cp_async,
// MOEGRAPH_MXFP8_PINGPONG=0|1, MOEGRAPH_MXFP8_ROUTE=e4m3|swap_ab|dequant|staged and MOEGRAPH_WGRAD_PINGPONG=0|1 where it
// leaves a choice open: the one place the environment is read.
// Throws on a malformed value.
GemmOverrides with_environment(GemmOverrides base);

// The kernel a GEMM runs: printable, and the same object set-up, describe() and --plan show.
struct GemmConfig {
  GemmPhase phase = GemmPhase::kFprop;
  GemmFamily family = GemmFamily::kTma16;
  DType dtype = DType::kBF16;     // the kernel's 16-bit type (activations or outputs)
  int block_m = 0, block_n = 0, block_k = 0, stages = 0, threads = 0;
  bool ping_pong = false;         // mxfp8: two fp32 partials per 32-deep block; TMA wgrad: each
                                  // consumer warpgroup owns whole tiles, alternating
  bool dequantized_weights = false;  // kMxfp8Staged fprop/dgrad: B read from Mxfp8RaggedGemmParams::
                                     // b_dequantized, only A staged
  bool into_main_grad = false;  // ping-pong TMA wgrad (kTma16, kMxfp8Staged): the plan for fp32 main_grad,
                                // whose kernel streams main_grad through a ring (its own stages); the
                                // launch takes the kernel its arguments need
  std::string to_string() const;  // e.g. "wgmma_tma_ws_sw128 128x128x64 stages=5 threads=384"
};
// The heuristic: shapes and overrides in, a config out. Touches no GPU.
GemmConfig choose_gemm_config(const GemmProblem& problem, const GemmOverrides& overrides);

// A config made ready on the current device at set-up (before capture): the kernel's
// shared-memory limit raised, its persistent grid sized from its residency on this device.
// Held by the operator that launches it, so each device keeps its own.
struct GemmPlan {
  GemmConfig config;
  int grid = 0;                      // sm_count x resident CTAs per SM
  int sm_count = 0;                  // the device's, at prepare_gemm
  void* encode_tensor_map = nullptr; // the driver's cuTensorMapEncodeTiled (TMA family)
};
GemmPlan prepare_gemm(const GemmConfig& config, int sm_count);
// Whether a swap-AB launch (kMxfp8SwapAb) of this problem takes the deep-ring kernel: its tiles,
// bounded from the capacity and the group count, are at most one per SM and too many to split.
bool mxfp8_swap_ab_deep_ring(const GemmPlan& plan, int groups, int64_t capacity_rows, int64_t n);

// Device scratch the config's launches need (Mxfp8*Params::staging): 0 except for kMxfp8Staged and
// kMxfp8SwapAb. Swap-AB: its split reductions' counters and fp32 partials (about 4.1 MiB) where the
// problem may have a quarter as many tiles as CTAs or fewer (at most 66 tiles of 128 output columns
// and up to 32 rows), else 0. Staged: its wgrad dequantizes dy and x, [capacity_rows, n + k]. Its fprop/dgrad hold A's bf16 values
// [capacity_rows, k] at the start (dequantized there, or written by the quantizer: a_staged; all
// they stage with dequantized_weights) and then the weights a run of
// experts at a time: as many experts as the given staging_bytes hold past A (at least one). This
// size holds runs of `experts_per_run`, or by default as many experts as fit kStagedWeightBytes
// (at least one). n and k as in the launch's
// params (output columns and reduction; wgrad: the layer's N and K); throws past 2^48 bytes.
inline constexpr std::size_t kStagedWeightBytes = std::size_t{256} << 20;
std::size_t mxfp8_staging_bytes(const GemmConfig& config, int groups, int64_t capacity_rows, int64_t n, int64_t k,
                                int experts_per_run = 0);
// The staged wgrad's scratch: x's values [capacity_rows, k] and, unless they arrive made
// (Mxfp8WgradParams::dy_values), dy's [capacity_rows, n]. mxfp8_staging_bytes of a staged wgrad
// config is this without dy_values.
std::size_t mxfp8_staged_wgrad_bytes(int64_t capacity_rows, int64_t n, int64_t k, bool dy_values);

// Launches (enqueue paths: capturable). The plan's phase and family pick the kernel; the params
// must be of that phase (RaggedGemmParams: fprop and dgrad; WgradParams: wgrad) and family
// (Mxfp8*: the kMxfp8* families; wgrad: kMxfp8CpAsync or kMxfp8Staged).
void launch_ragged_gemm(const GemmPlan& plan, const RaggedGemmParams& p, cudaStream_t stream);
void launch_grouped_wgrad(const GemmPlan& plan, const WgradParams& p, cudaStream_t stream);
void launch_mxfp8_ragged_gemm(const GemmPlan& plan, const Mxfp8RaggedGemmParams& p, cudaStream_t stream);
void launch_mxfp8_wgrad(const GemmPlan& plan, const Mxfp8WgradParams& p, cudaStream_t stream);

}  // namespace moegraph::kernels
