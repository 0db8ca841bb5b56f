// MoeLayer: a whole MoE layer on device-resident routing. Router (x · W_r^T, softmax or sigmoid,
// top-k, optional renormalization and auxiliary loss) -> dispatch (tokens to expert-contiguous
// rows) -> FC1 (grouped, N = 2 * ffn) -> SwiGLU -> FC2 (grouped) -> combine, and backward through
// all of it, router included. The token count of a step is a device scalar and the per-expert
// splits are produced on the device, so every phase is graph-capturable and one capture serves any
// routing and any token count up to max_tokens.
// Every enqueue method never synchronizes, allocates or reads device memory on the host; set-up
// (the constructor) may do all three and must happen before capture.
// Threading: one thread at a time per handle; the whole contract is in moegraph/step_graphs.hpp.
#pragma once

#include "moegraph/export.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moegraph/mxfp8_weights.hpp"
#include "moegraph/types.hpp"

namespace moegraph {

struct Config;
class EpComm;  // moegraph/expert_parallel.hpp

// Upper bounds of the options. validate() refuses past them, naming the field, its value and the
// limit, so every size derived from the options stays exact in 64-bit arithmetic. The products
// moe_layer_rows * max(2 * ffn, hidden) * element size (the widest row buffer: FC1's output or the
// rows of x) and experts * 2 * ffn * hidden * 4 (FC1's fp32 main_grad) must also be at most 2^48
// bytes, and so must the whole workspace (the buffer that would pass it is named).
inline constexpr int64_t kMaxLayerWidth = int64_t{1} << 20;   // hidden and ffn (as the JSON config's layer)
inline constexpr int64_t kMaxLayerTokens = int64_t{1} << 24;  // max_tokens

struct MoeLayerOptions {
  int experts = 0;                  // E, 1..kMaxGroups (1024)
  int64_t hidden = 0, ffn = 0;      // multiples of 16, at most kMaxLayerWidth (2^20)
  int top_k = 1;                    // 1..8, at most experts
  bool bias = false;                // FC1 and FC2 biases
  RouterScore score = RouterScore::kSoftmax;
  bool renormalize = false;         // the chosen weights sum to 1
  double aux_loss_coef = 0.0;       // 0: no auxiliary loss
  double capacity_factor = 0.0;     // 0: dropless; else at most ceil(cf * n * k / E) rows per expert
  bool fuse_weights = false;        // weights applied in the SwiGLU output (FC2 bias scaled) instead of at the combine
  int64_t max_tokens = 0;           // the bucket's capacity in tokens, 1..kMaxLayerTokens (2^24)
  int row_align = 1;                // 1, 16, 32, 128
  DType dtype = DType::kBF16;
  Recipe recipe = Recipe::kBF16;    // kMXFP8: FC1 and FC2 on MXFP8 copies (training: row_align 32 or 128)
  // kMXFP8 only: FC1 and FC2 read the caller's MXFP8 weights (MoeLayerWeights::w1_mxfp8, w2_mxfp8)
  // and the layer keeps no copy; w1 and w2 are then not needed (serving from an MXFP8 checkpoint,
  // or one quantized copy shared by several layers).
  bool prequantized_weights = false;
  // kMXFP8, bf16 only: FC1's and FC2's MXFP8 weights also kept dequantized to bf16
  // (GroupedLinearOptions::dequantized_weights; with prequantized_weights, in w1_mxfp8 / w2_mxfp8).
  bool dequantized_weights = false;
  bool training = true;             // reserve what forward_train / backward need
  int wgrad_slots = 1;              // forward_train contexts in flight at once
  bool delay_wgrad = false;         // backward queues the weight gradients for backward_dw()
  bool main_grad_fp32 = true;       // weight gradients accumulate into fp32 main_grad (else written)
  // Expert parallelism (moegraph/expert_parallel.hpp): the experts are spread over this many ranks,
  // experts % expert_parallel == 0, at most kMaxExpertParallel (64). max_tokens is per rank. Not
  // yet combined with capacity_factor or fuse_weights.
  int expert_parallel = 1;
  // Rows of each rank's receive buffer: 0 for the worst case (every rank's max_tokens * top_k rows
  // to one rank: no row is ever dropped), else a bound (a multiple of row_align); rows past it are
  // dropped, counted on their source rank (read_dropped) and contribute zero to their tokens. A
  // bound at or above the worst case means the worst case (StepGraphs applies one bound to every
  // bucket).
  int64_t ep_recv_rows = 0;
  // How rows move between ranks (EpExchange). kSendRecv moves fixed chunks: ep_chunk_rows rows from
  // each rank to each rank per exchange, 0 for the worst case (max_tokens * top_k: nothing dropped;
  // a larger bound means the same).
  // A source's rows past its chunk are dropped like rows past ep_recv_rows: counted on the source
  // (read_dropped), zero in results.
  EpExchange ep_exchange = EpExchange::kPeerStores;
  int64_t ep_chunk_rows = 0;
};

// The options of one bucket of a config (layer, router, precision, training, row_align).
MOEGRAPH_API MoeLayerOptions moe_layer_options(const Config& config, int64_t max_tokens);
// Throws moegraph::Error naming the field, its value and the rule. Touches no GPU.
MOEGRAPH_API void validate(const MoeLayerOptions& options);
// Rows of the permuted (expert-contiguous) buffers: max_tokens * top_k plus the worst-case
// alignment padding, so dropless routing always fits (validate() keeps it below 2^31).
MOEGRAPH_API int64_t moe_layer_rows(const MoeLayerOptions& options);
// Experts held by one rank (experts / expert_parallel).
MOEGRAPH_API int moe_local_experts(const MoeLayerOptions& options);
// Rows of the experts' grouped buffers: moe_layer_rows without expert parallelism, else the receive
// buffer's rows (ep_recv_rows, or the worst case moe_ep_worst_case_rows).
MOEGRAPH_API int64_t moe_expert_rows(const MoeLayerOptions& options);
// expert_parallel * max_tokens * top_k rows plus the alignment padding of the local experts (with
// kSendRecv, expert_parallel * moe_ep_chunk_rows rows plus that padding).
MOEGRAPH_API int64_t moe_ep_worst_case_rows(const MoeLayerOptions& options);
// kSendRecv: the rows of every chunk (ep_chunk_rows, or max_tokens * top_k when it is 0).
MOEGRAPH_API int64_t moe_ep_chunk_rows(const MoeLayerOptions& options);

// Parameters and their gradients (device). The gradient set follows main_grad_fp32: fp32 main_grad_*
// accumulated into, or d* written in the activation dtype. Biases only with options.bias. With
// expert parallelism the expert tensors hold this rank's experts only (El = E / expert_parallel,
// the first being expert rank * El); the router and its gradient stay whole (the router gradient
// is this rank's tokens' share: sum it over the ranks as for any replicated parameter).
struct MoeLayerWeights {
  const void* router = nullptr;  // [E, hidden]
  const void* w1 = nullptr;      // [El, 2 * ffn, hidden]  (gate | up)
  const void* b1 = nullptr;      // [El, 2 * ffn]
  const void* w2 = nullptr;      // [El, hidden, ffn]
  const void* b2 = nullptr;      // [El, hidden]
  float* main_grad_router = nullptr, *main_grad1 = nullptr, *main_grad2 = nullptr;
  void* d_router = nullptr, *dw1 = nullptr, *dw2 = nullptr;
  void* db1 = nullptr, *db2 = nullptr;
  // options.prequantized_weights: w1 and w2 as MXFP8 (moegraph/mxfp8_weights.hpp); data and scales
  // always, data_t and scales_t for training (dgrad reads them).
  Mxfp8Weights w1_mxfp8, w2_mxfp8;
};

// One step's activations (device). Rows at or past *num_tokens are neither read nor written,
// except dx, whose rows [n, max_tokens) are written as zero: x, y and dy may be buffers of just n
// rows (a graph replayed for several n needs max_tokens), dx must hold max_tokens rows.
struct MoeLayerIO {
  const void* x = nullptr;            // [max_tokens, hidden]
  const int32_t* num_tokens = nullptr;  // device scalar n, 0 <= n <= max_tokens
  void* y = nullptr;                  // [max_tokens, hidden]
  float* aux_loss = nullptr;          // device scalar; may be null when aux_loss_coef == 0
  const void* dy = nullptr;           // backward: [max_tokens, hidden]
  void* dx = nullptr;                 // backward: [max_tokens, hidden]
};

namespace layer {
class LayerProgram;  // src/ops/moe/layer_program.hpp
}

// Streams: a layer's calls share scratch in its workspace and buffers of its own (the router's
// logits, the dispatch's counts, the aux loss's partials, FC1's and FC2's scratch), so their work
// must not overlap on the device: one stream, or streams ordered by events (GroupedLinear says the
// same of its handles). Different layers are independent.
class MOEGRAPH_API MoeLayer {
 public:
  // Validates, builds the operator program (applying fusions), and lays out its workspace
  // (allocated here when `workspace` is null). Before capture. With options.expert_parallel > 1,
  // `comm` is this rank's communicator (its ranks() must equal expert_parallel); the layer
  // allocates its window on it (collective) and keeps it.
  MoeLayer(const MoeLayerOptions& options, const MoeLayerWeights& weights, void* workspace = nullptr,
           std::shared_ptr<EpComm> comm = nullptr);
  ~MoeLayer();
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  // Workspace size (at most 2^48 bytes, else moegraph::Error naming the buffer that would pass it)
  // and its named buffers, for these options. Touches no GPU.
  static std::size_t workspace_bytes(const MoeLayerOptions& options);
  struct WorkspaceBuffer {
    std::string name;
    std::size_t offset, bytes;
  };
  static std::vector<WorkspaceBuffer> workspace_buffers(const MoeLayerOptions& options);
  // Expert parallelism: the bytes of the window each rank allocates on its communicator (0 without
  // expert parallelism), and its named buffers. Touches no GPU.
  static std::size_t window_bytes(const MoeLayerOptions& options);
  static std::vector<WorkspaceBuffer> window_buffers(const MoeLayerOptions& options);

  const MoeLayerOptions& options() const { return options_; }
  // The operators in order (after fusion) and the kernels they use.
  std::string describe() const;

  void forward(const MoeLayerIO& io, cudaStream_t stream);        // inference: saves nothing
  void forward_train(const MoeLayerIO& io, cudaStream_t stream);  // saves into the next free slot
  // Backward of the oldest forward_train: dx, the router and bias gradients, and the weight
  // gradients at once or queued (options.delay_wgrad).
  void backward(const MoeLayerIO& io, cudaStream_t stream);
  void backward_dw(cudaStream_t stream);                          // the oldest queued weight gradients
  // The weights were updated: the MXFP8 recipe re-quantizes FC1's and FC2's copies (nothing to do
  // for bf16, or with prequantized_weights: the caller keeps its copies current). Enqueued; run it
  // before the first forward and after every weight update.
  void weights_changed(cudaStream_t stream);
  // The weights and gradient buffers moved (a framework re-gathered its parameters at a new
  // address, say): the next enqueued calls read and write `weights`. Host only, nothing enqueued;
  // saved micro-batches stay valid (backward reads the new weights, which must hold the same
  // values). The same weights must be set as at creation (gradient buffers may change; backward
  // checks for those it needs), and while delayed weight gradients are queued the buffers they
  // write (main_grad*, d_router, dw1, dw2) may not move. The MXFP8 recipe's copies are not re-made: call
  // weights_changed if the values changed too. Graphs captured before keep the old addresses.
  void set_weights(const MoeLayerWeights& weights);
  int queued_wgrads() const;
  int pending_backwards() const;

  // Device views of the latest forward's routing (valid until the next forward of the same slot):
  // per-expert rows [E] and aligned row offsets [E + 1] of the experts' grouped rows (with expert
  // parallelism: this rank's El experts, the rows it received).
  const int32_t* splits() const;
  const int64_t* offsets() const;

  // Synchronizes `stream`. Returns this rank's (token, expert) assignments dropped by the capacity
  // factor or by a receive bound (ep_recv_rows) since the last call (and resets the counter); 0
  // when dropless.
  uint64_t read_dropped(cudaStream_t stream);
  // Synchronizes `stream` and throws moegraph::Error (kDeviceSplits) for an invalid token count
  // or invalid splits recorded by any kernel of the layer (then clears the records).
  void check_device_errors(cudaStream_t stream);

 private:
  MoeLayerOptions options_;
  std::unique_ptr<layer::LayerProgram> program_;
};

}  // namespace moegraph
