// The MoE layer's routing kernels (host-callable launchers; no device code in this header):
// router top-k, the dispatch plan (tokens -> expert-contiguous rows), row permutation, combine,
// and their backward. Every launcher is an enqueue path: no synchronization, allocation or
// device read on the host. The number of tokens of a step is a device scalar, so one capture
// serves any token count up to the bucket's capacity; tokens at or past it are neither read nor
// written unless a launcher says otherwise.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "moegraph/types.hpp"

namespace moegraph::kernels {

// ---- Router ---------------------------------------------------------------------------------
struct RouterTopkParams {
  const float* logits = nullptr;       // [max_tokens, E] fp32 (x · W_r^T)
  const int32_t* num_tokens = nullptr;  // device scalar n; tokens [0, n) are routed
  int64_t max_tokens = 0;
  int experts = 0, top_k = 0;           // 1 <= top_k <= 8, top_k <= experts <= 1024
  RouterScore score = RouterScore::kSoftmax;
  bool renormalize = false;             // chosen weights divided by their sum
  float* scores = nullptr;              // [max_tokens, E]: softmax probabilities or sigmoids
  int32_t* topk_ids = nullptr;          // [max_tokens, top_k]: descending score, ties to the lower id
  float* topk_weights = nullptr;        // [max_tokens, top_k]: scores of the chosen (renormalized)
  DeviceErrorRecord* error = nullptr;   // kDeviceErrorTokenCount (n is then clamped into [0, max_tokens])
};
void launch_router_topk(const RouterTopkParams& p, cudaStream_t stream);

// The logits of a small batch (at most kRouterSmallTokens tokens), straight from x: one kernel where
// the GEMM path takes four at decode sizes (the copy of x, cuBLASLt's split-K GEMM and its
// reduction, and the copy of the token count). For inference, which keeps no copy of x. The bound
// is where it measured faster than that path on one H200 (docs/PERF.md, "Decode with few tiles":
// 2-8% at 1 token, 1-3% at 2 and 4, even at 8, slower at 16); each thread keeps a sum per token.
inline constexpr int64_t kRouterSmallTokens = 4;
struct RouterLogitsParams {
  const void* x = nullptr;              // [max_tokens, hidden]; rows t < n are read
  const void* w = nullptr;              // W_r [E, hidden]
  DType dtype = DType::kBF16;           // of x and w: bf16 or fp16
  const int32_t* num_tokens = nullptr;  // device scalar n
  int32_t* tokens_out = nullptr;        // or null: receives *num_tokens (the micro-batch's own copy)
  int64_t max_tokens = 0, hidden = 0;   // max_tokens <= kRouterSmallTokens; hidden a multiple of 8
  int experts = 0;
  float* logits = nullptr;              // [max_tokens, E] fp32: rows t < n written, the rest untouched
  DeviceErrorRecord* error = nullptr;   // kDeviceErrorTokenCount (n is then clamped into [0, max_tokens])
};
void launch_router_logits_small(const RouterLogitsParams& p, cudaStream_t stream);

// Auxiliary load-balancing loss (Switch-style, on assignments before any dropping):
//   aux = coef * E / (k * n^2) * sum_e counts[e] * sum_{t < n} scores[t, e]   (0 when n == 0).
// Deterministic (fixed reduction order, the same on every device). Writes one float.
// `workspace`: kRouterAuxLossWorkspaceBytes, 8-byte aligned, zeroed before the first launch: its
// ticket must be zero, and each launch leaves it zero. Launches on one workspace must not overlap.
constexpr std::size_t kRouterAuxLossWorkspaceBytes = 256 * sizeof(double) + 16;  // partials, ticket (padded)
void launch_router_aux_loss(const float* scores, const int32_t* counts, const int32_t* num_tokens,
                            int64_t max_tokens, int experts, int top_k, float coef, float* aux_loss, void* workspace,
                            cudaStream_t stream);

struct RouterBackwardParams {
  const float* scores = nullptr;          // [max_tokens, E] saved by launch_router_topk
  const int32_t* topk_ids = nullptr;      // [max_tokens, k]
  const float* topk_weights = nullptr;    // [max_tokens, k] (after renormalization)
  const float* d_topk_weights = nullptr;  // [max_tokens, k] gradient of the combine weights
  const int32_t* counts = nullptr;        // [E] assignments before dropping (aux-loss gradient)
  const int32_t* num_tokens = nullptr;
  int64_t max_tokens = 0;
  int experts = 0, top_k = 0;
  RouterScore score = RouterScore::kSoftmax;
  bool renormalize = false;
  float aux_coef = 0.0f;                  // d aux / d aux = 1: the loss is added to the caller's
  DType dtype = DType::kBF16;
  void* d_logits = nullptr;               // [max_tokens, E] in dtype; rows >= n are written as zero
};
// Renormalization:   ds_{id_j} = (dw_j - sum_i dw_i w_i) / S   (S = sum of the chosen scores), else dw_j;
// aux loss:          ds[t, e] += coef * E * counts[e] / (k * n^2);
// softmax:           dlogit_e = p_e (ds_e - sum_e' p_e' ds_e');   sigmoid: dlogit_e = ds_e s_e (1 - s_e).
void launch_router_backward(const RouterBackwardParams& p, cudaStream_t stream);

// ---- Dispatch: tokens -> expert-contiguous rows ---------------------------------------------------
struct DispatchParams {
  const int32_t* topk_ids = nullptr;      // [max_tokens, k]
  const float* topk_weights = nullptr;    // [max_tokens, k]
  const int32_t* num_tokens = nullptr;
  int64_t max_tokens = 0;
  int experts = 0, top_k = 0;
  int row_align = 1;                      // each expert's rows start on a multiple of this
  int64_t capacity_rows = 0;              // rows of the permuted buffers
  // 0: dropless. Else each expert keeps at most C = ceil(capacity_factor * n * k / E) assignments
  // (computed in double), the first ones in (token, j) order; the rest are dropped and counted.
  double capacity_factor = 0.0;
  int32_t* counts = nullptr;              // [E] assignments per expert before dropping
  int32_t* splits = nullptr;              // [E] rows per expert (kept assignments)
  int64_t* offsets = nullptr;             // [E + 1] aligned starts, as launch_group_offsets computes them
  int32_t* row_of = nullptr;              // [max_tokens, k]: row of assignment (t, j); -1 if dropped or t >= n
  int32_t* token_of_row = nullptr;        // [capacity_rows]: the token of each data row (gap rows -1)
  float* row_weight = nullptr;            // [capacity_rows]: topk weight of each data row (gap rows 0)
  unsigned long long* dropped = nullptr;  // += assignments dropped by this step (cumulative counter)
  int32_t* workspace = nullptr;           // dispatch_workspace_bytes(max_tokens, experts, top_k)
  DeviceErrorRecord* error = nullptr;     // kDeviceErrorTokenCount
};
// The chunk counts' scratch: 0 for a batch the one-block kernel takes (max_tokens * top_k <= 1024).
std::size_t dispatch_workspace_bytes(int64_t max_tokens, int experts, int top_k);
// Rows are ordered by expert, then token, then j (a stable counting sort): deterministic.
void launch_dispatch(const DispatchParams& p, cudaStream_t stream);

// permuted[r] = x[token_of_row[r]] for data rows, zero for alignment-gap rows, for r < offsets[E].
void launch_permute_rows(DType dtype, const void* x, const int32_t* token_of_row, const int32_t* splits,
                         const int64_t* offsets, int experts, int64_t hidden, void* permuted, cudaStream_t stream);

// ---- Combine ------------------------------------------------------------------------------------
// y[t] = sum_j w[t, j] * rows[row_of[t, j]] over kept assignments (w = 1 when topk_weights is null:
// the weights were applied earlier), fp32 sums, for t < n. A token whose assignments were all
// dropped gets zeros.
void launch_combine(DType dtype, const void* rows, const int32_t* row_of, const float* topk_weights,
                    const int32_t* num_tokens, int64_t max_tokens, int top_k, int64_t hidden, void* y,
                    cudaStream_t stream);

// For every row r < offsets[E]: d_rows[r] = w_r * dy[token_of_row[r]] (w_r = row_weight[r], or 1
// when row_weight is null); gap rows get zeros. When rows and d_row_weight are given, also
// d_row_weight[r] = <dy[token_of_row[r]], rows[r]> in fp32 (gap rows 0).
void launch_combine_backward(DType dtype, const void* dy, const int32_t* token_of_row, const float* row_weight,
                             const void* rows, const int32_t* splits, const int64_t* offsets, int experts,
                             int64_t hidden, void* d_rows, float* d_row_weight, cudaStream_t stream);

// d_topk_weights[t, j] = row_of[t, j] >= 0 ? d_row_weight[row_of[t, j]] : 0, for t < max_tokens
// (rows t >= n get 0).
void launch_gather_row_values(const float* d_row_weight, const int32_t* row_of, const int32_t* num_tokens,
                              int64_t max_tokens, int top_k, float* d_topk_weights, cudaStream_t stream);

// dx[t] = sum_j d_rows[row_of[t, j]] for t < n (fp32 sums, rounded once) and 0 for
// n <= t < max_tokens: every row written in one pass (the router's dx GEMM then adds into all rows).
void launch_unpermute(DType dtype, const void* d_rows, const int32_t* row_of, const int32_t* num_tokens,
                      int64_t max_tokens, int top_k, int64_t hidden, void* dx, cudaStream_t stream);

// dst[t] = src[t] for t < n, zero for n <= t < max_tokens (e.g. the router's saved input, so
// a GEMM over all max_tokens rows never meets stale data).
void launch_copy_tokens(const void* src, void* dst, std::size_t row_bytes, const int32_t* num_tokens,
                        int64_t max_tokens, cudaStream_t stream);

// ---- SwiGLU with the routing weight fused in (FC2 then scales its bias by the same weight) --------
// a[r, j] = w_r * silu(gate[r, j]) * up[r, j] over rows r < offsets[E] (gap rows: w_r = 0 -> zeros).
void launch_swiglu_weighted_forward(DType dtype, const void* h, const float* row_weight, void* a, int64_t ffn,
                                    const int64_t* offsets, int experts, cudaStream_t stream);
// With da the gradient of a:  dgate, dup of w_r * silu(gate) * up  into dh = [rows, 2 * ffn], and
// d_row_weight[r] = <da_r, silu(gate_r) * up_r> + (extra ? extra[r] : 0) in fp32 (extra: the
// gradient FC2 gives its bias scale).
void launch_swiglu_weighted_backward(DType dtype, const void* h, const float* row_weight, const void* da, void* dh,
                                     const float* extra, float* d_row_weight, int64_t ffn, const int64_t* offsets,
                                     int experts, cudaStream_t stream);

}  // namespace moegraph::kernels
