// fp64 references of the MoE layer's operators and of the whole layer (router -> dispatch ->
// FC1 -> SwiGLU -> FC2 -> combine, and backward through all of it, router included).
// The layer reference rounds what the device stores in the activation dtype (permuted x, FC1
// output, SwiGLU output, expert output, d_logits, ...) at the same points, so the comparison
// measures the kernels; with round_intermediates = false it is exact fp64 math (used by the
// finite-difference gradient tests). With the mxfp8 recipe the expert linears' GEMMs read the
// MXFP8 copies the device makes (docs/mxfp8.md "Where the recipe uses them"), quantized and
// dequantized exactly here too (testing/mxfp8_operands.hpp), so that comparison still measures
// the kernels and not the format. Formulas: kernels/routing/moe_routing.hpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moegraph/types.hpp"
#include "testing/data.hpp"
#include "testing/reference.hpp"

namespace moegraph::testing {

struct RouterSpec {
  int experts = 0, top_k = 1;
  bool sigmoid = false;          // scores: softmax (false) or sigmoid (true)
  bool renormalize = false;
  double aux_coef = 0.0;         // auxiliary loss coefficient (0: none)
  double capacity_factor = 0.0;  // 0: dropless
  int row_align = 1;
};

// ---- Router ----
struct RouterRef {
  int64_t tokens = 0;               // n
  Mat scores;                       // [n, E]
  std::vector<int32_t> topk_ids;    // [n, k]
  Mat topk_weights;                 // [n, k]
  std::vector<int32_t> counts;      // [E] assignments before dropping
  double aux_loss = 0.0;
};
// Scores, top-k (descending score, ties to the lower id), weights and the aux loss from
// logits [n, E]. With `forced_ids` (e.g. the device's choice, [n, k]) those ids are used instead
// of the reference's own selection: check them first with check_topk_selection.
RouterRef ref_router_forward(const Mat& logits, int64_t n, const RouterSpec& spec,
                             const std::vector<int32_t>* forced_ids = nullptr);
// d_logits [n, E] from the gradient of the chosen weights [n, k] (and d aux = 1 when aux_coef != 0).
Mat ref_router_backward(const RouterRef& r, const Mat& d_topk_weights, const RouterSpec& spec);
// The device's ids are a valid top-k of the reference scores: k distinct ids in [0, E), in
// descending score order, and no unchosen score above a chosen one by more than `eps`
// (near-ties may legitimately resolve differently in fp32).
CompareResult check_topk_selection(const RouterRef& r, const std::vector<int32_t>& ids, int top_k, double eps);

// ---- Dispatch ----
struct DispatchRef {
  GroupLayout layout;                 // splits (kept assignments) and aligned offsets
  std::vector<int32_t> row_of;        // [n, k]: row of (t, j), -1 if dropped
  std::vector<int32_t> token_of_row;  // [capacity_rows]: token of each data row, -1 otherwise
  std::vector<double> row_weight;     // [capacity_rows]: the assignment's weight, 0 otherwise
  int64_t dropped = 0;                // assignments dropped by the capacity factor
};
// Rows ordered by expert, then token, then j. C = ceil(capacity_factor * n * k / E) in double.
DispatchRef ref_dispatch(const RouterRef& r, const RouterSpec& spec, int64_t capacity_rows);
// [capacity_rows, hidden]: data rows copy their token's row of x [n, hidden]; every other row 0.
Mat ref_permute(const DispatchRef& d, const Mat& x, int64_t hidden);
// y [n, hidden] = sum_j w[t, j] rows[row_of[t, j]] (weights empty: w = 1).
Mat ref_combine(const DispatchRef& d, const Mat& rows, const Mat& topk_weights, int64_t n, int top_k,
                int64_t hidden);

// ---- The whole layer ----
struct MoeLayerInputs {
  const Mat* x = nullptr;   // [n, hidden]
  const Mat* wr = nullptr;  // [E, hidden] router weight
  const Mat* w1 = nullptr;  // [E, 2 * ffn, hidden]
  const Mat* b1 = nullptr;  // [E, 2 * ffn] or empty
  const Mat* w2 = nullptr;  // [E, hidden, ffn]
  const Mat* b2 = nullptr;  // [E, hidden] or empty
  const Mat* dy = nullptr;  // [n, hidden], or null: forward only
  int64_t tokens = 0, hidden = 0, ffn = 0;
  int64_t capacity_rows = 0;            // rows of the permuted buffers
  RouterSpec router;
  bool fuse_weights = false;            // routing weights in the SwiGLU output (FC2 bias scaled by them)
  DType dtype = DType::kBF16;
  // kMXFP8: FC1's and FC2's fprop, dgrad and wgrad read MXFP8 copies of x, dy and W as the device
  // makes them (row-wise along K for fprop, along N for dgrad, column-wise in blocks of 32 rows of
  // a group for wgrad), dequantized exactly; the bias gradients, the router, SwiGLU and the combine
  // read the unquantized values, as on the device. Needs hidden and ffn multiples of 32 (the device
  // needs multiples of 128: its GEMMs stage 128 at a time) and, with dy, router.row_align 32 or 128.
  // Independent of round_intermediates: the quantization is part of the recipe's math.
  Recipe recipe = Recipe::kBF16;
  bool round_intermediates = true;      // false: exact fp64 (gradient checks)
  const std::vector<int32_t>* forced_ids = nullptr;  // see ref_router_forward
};

struct MoeLayerRef {
  RouterRef router;
  DispatchRef dispatch;
  Mat logits;                 // [n, E]
  // The experts' stored activations, in the dispatch's rows [capacity_rows, .]: FC1's output h1
  // (gate | up), the SwiGLU output a (times the routing weight when fused), FC2's output.
  Mat h1, a, expert_out;
  Mat y;                      // [n, hidden]
  double aux_loss = 0.0;
  // Gradients (when dy is given): of the loss sum(y * dy) + aux_loss.
  Mat dx;                     // [n, hidden]
  Mat dwr;                    // [E, hidden]
  Mat dw1, dw2, db1, db2;     // db* empty without bias
  Mat d_logits;               // [n, E]
  Mat da, dh1;                // the stored gradients of a and of h1 (FC2's dgrad, the SwiGLU backward)
};
MoeLayerRef ref_moe_layer(const MoeLayerInputs& in);

}  // namespace moegraph::testing
