// GroupedLinear: G linear layers ("experts") over one grouped-row buffer whose per-group row counts
// (splits) live on the device. Every enqueue method is graph-capturable: it never synchronizes,
// allocates, or reads device memory on the host. Set-up (the constructor) may do all three and
// must happen before capture.
// Threading: one thread at a time per handle; the whole contract is in moegraph/step_graphs.hpp.
// Streams: a handle's calls share scratch in its workspace (the mxfp8 recipe's operand copies),
// so their work must not overlap on the device: one stream, or streams ordered by events; a
// backward_dw on a side stream may not run beside the next forward or backward.
#pragma once

#include "moegraph/export.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moegraph/mxfp8_weights.hpp"
#include "moegraph/types.hpp"

namespace moegraph {

class LayoutWalker;  // src/core/layout.hpp
namespace linear {
class LinearBackend;  // src/ops/grouped_linear/linear_backend.hpp
}

// Upper bounds of the options. validate() refuses past them, naming the field, its value and the
// limit, so every size derived from the options stays exact in 64-bit arithmetic. The products
// capacity_rows * max(K, N) * element size (the largest row buffer) and G * N * K * 4 (an fp32
// main_grad) must also be at most 2^48 bytes, and so must the whole workspace (the buffer that would
// pass it is named).
inline constexpr int64_t kMaxFeatures = int64_t{1} << 21;           // K and N: FC1 (2 * ffn) of the widest MoE layer
inline constexpr int64_t kMaxCapacityRows = (int64_t{1} << 31) - 1;  // rows are int32 indices on the device

struct GroupedLinearOptions {
  int num_groups = 0;          // G, 1..kMaxGroups (1024)
  int64_t in_features = 0;     // K, multiple of 16, at most kMaxFeatures (2^21)
  int64_t out_features = 0;    // N, multiple of 16, at most kMaxFeatures (2^21)
  int64_t capacity_rows = 0;   // rows of every grouped buffer (including alignment padding), below 2^31
  int row_align = 1;           // each group starts on a multiple of this many rows: 1, 16, 32, 128
  DType dtype = DType::kBF16;  // kBF16 or kFP16
  bool bias = false;           // bias [G, N]
  int wgrad_slots = 1;         // forward_train contexts that may be in flight at once
  bool delay_wgrad = false;    // reserve room so backward can queue wgrad (it then saves dy)
  // bf16 recipe, training: forward_train keeps pointers to x and to the bias scale, and a delayed
  // backward a pointer to dy, instead of copying them into its slot. The caller keeps x and dy
  // unchanged until that micro-batch's weight gradient has run (backward with kImmediate, or its
  // backward_dw), and the bias scale until its backward. The slots then hold no copies: less
  // workspace, and a pass over x (and with delayed wgrad one over dy) fewer per micro-batch (the
  // MoE layer's producers write them where wgrad reads them). Refused with the mxfp8 recipe, whose
  // slots keep quantized copies that it must make anyway.
  bool caller_keeps_activations = false;
  // The operator serves forward() only (e.g. an inference server's layer): no forward_train
  // contexts (its slots: the saved x or its MXFP8 copies, splits, offsets, the bias scale) and no
  // training scratch (dy's copies, the bias-gradient partials) are laid out, so the workspace holds
  // what forward reads and writes. forward_train is refused (recipe_can_train says why), and so
  // are delay_wgrad and caller_keeps_activations, which only training uses.
  bool forward_only = false;
  // Kernel choices, normally left to the GEMM heuristic (tuning and differential tests); where left
  // open, MOEGRAPH_TILE_N / MOEGRAPH_GEMM_PIPELINE may force them.
  bool reference_kernels = false;  // the simple WMMA reference kernels (bf16 recipe only)
  int tile_n = 0;                  // wgmma tile width: 0 = chosen from the shapes, or 128 / 256
  GemmPipeline pipeline = GemmPipeline::kAuto;  // 16-bit wgmma kernels: cp.async or TMA loads
  int wgrad_ping_pong = -1;        // 16-bit TMA wgrad with ping-pong consumers: -1 = chosen from the
                                   // shapes and per call from the destination, dW or main_grad
                                   // (MOEGRAPH_WGRAD_PINGPONG may force it), 0 = no, 1 = yes
  // kMXFP8: the GEMMs run on MXFP8 copies (x and dy quantized on the fly; the saved activations
  // are kept as MXFP8 column-wise copies instead of a 16-bit copy; the weights are quantized by
  // weights_changed()). Needs K and N multiples of 128. Training (forward_train) also needs
  // row_align 32 or 128 (wgrad's column-wise blocks of 32 rows must not straddle two groups); at
  // row_align 1 or 16 the operator serves forward only and keeps no column-wise copies.
  Recipe recipe = Recipe::kBF16;
  // kMXFP8 only: the GEMMs read the caller's MXFP8 weights (ForwardArgs / BackwardArgs::
  // mxfp8_weights, moegraph/mxfp8_weights.hpp) and the operator keeps no copy of its own; the
  // 16-bit weight is then neither needed nor read, and weights_changed() is refused.
  bool prequantized_weights = false;
  // kMXFP8 with bf16 activations only: the weights' MXFP8 values are also kept dequantized to bf16
  // (4 bytes more per weight element: the fprop and dgrad copies, Mxfp8Weights::dequantized and
  // dequantized_t), made once per weight update. fprop and dgrad of groups too large for the
  // swap-AB kernel then run the bf16 kernel on those values and stage only the activations: the
  // same products as every mxfp8 route, at nearly the bf16 recipe's speed (docs/mxfp8.md). Kept
  // by the operator, or with prequantized_weights given by the caller (quantize_mxfp8_weights).
  bool dequantized_weights = false;
};

// Throws moegraph::Error naming the field, its value and the rule (the recipe's own rules
// included). Touches no GPU.
MOEGRAPH_API void validate(const GroupedLinearOptions& options);
// The recipe's shape rules for these options: "" when its kernels can run them, else the reason
// ("the mxfp8 recipe needs ..."). Touches no GPU.
MOEGRAPH_API std::string recipe_can_implement(const GroupedLinearOptions& options);
// The recipe's further rules for training (forward_train, backward, backward_dw): "" when these
// options can train, else the reason; forward_train refuses with it. Touches no GPU.
MOEGRAPH_API std::string recipe_can_train(const GroupedLinearOptions& options);

// Buffers are device pointers; all row buffers have options.capacity_rows rows. Group e occupies
// rows [offsets[e], offsets[e] + splits[e]); gap rows up to the next aligned start read as zero
// and are written as zero; rows past the last group are never written and their values never reach
// a result, but the kernels may read them (whole tiles of rows, up to capacity_rows).
struct ForwardArgs {
  const void* x = nullptr;            // [capacity_rows, K] (but see x_rows and x_swiglu)
  const int32_t* splits = nullptr;    // [G] int32, device
  const void* weight = nullptr;       // [G, N, K]
  const void* bias = nullptr;         // [G, N]; options.bias must be set
  const float* bias_scale = nullptr;  // [capacity_rows]: y_r = x_r W^T + s_r b (needs bias)
  void* y = nullptr;                  // [capacity_rows, N]
  // Optional [G + 1] int64, device: the group offsets of `splits` already computed for this
  // operator's row_align and capacity_rows (e.g. by a dispatch), so the operator skips its own
  // scan (and the device check of the splits that comes with it: the producer checks them).
  // forward_train then keeps pointers to splits and offsets instead of copies: both must stay
  // unchanged until the micro-batch's backward (and delayed wgrad) has run.
  const int64_t* offsets = nullptr;
  // options.prequantized_weights: W as MXFP8 (data and scales; `weight` may be null).
  Mxfp8Weights mxfp8_weights;
  // Optional [capacity_rows] int32, device; the mxfp8 recipe only: x is then the source the grouped
  // rows are gathered from ([any rows, K]): input row r is row x_rows[r] of x, for the rows that
  // hold data (a gap row reads as zero and its entry is never read). E.g. the MoE layer's tokens
  // and its dispatch's token_of_row: the quantizer reads each token where it is, and no permuted
  // copy is written. Each entry of a data row must be a row of x: a negative entry reads as a row
  // of zeros; one at or past x_rows_bound reads as zeros too and is reported (check_device_errors:
  // kDeviceErrorSourceRow). Read during the call only (the slot keeps the quantized copy).
  const int32_t* x_rows = nullptr;
  int64_t x_rows_bound = 0;  // with x_rows (required): the rows of x, 1..2^31 - 1
  // Optional; the mxfp8 recipe only, not with x_rows: x is then [capacity_rows, 2K], each row's
  // gate (its first K values) then its up, and input row r is silu(gate) * up, times
  // x_row_weight[r] where that is given, rounded to the dtype as kernels::launch_swiglu_forward
  // (and its weighted form) rounds it. The quantizer computes it as it reads x, with the same
  // bits as quantizing that SwiGLU's output, which is never written. E.g. the MoE layer's FC2
  // reading FC1's output. Rows without data (alignment gaps, past the groups) read as zeros.
  bool x_swiglu = false;
  const float* x_row_weight = nullptr;  // [capacity_rows] fp32, device; with x_swiglu only
};

struct BackwardArgs {
  const void* dy = nullptr;        // [capacity_rows, N]
  const void* weight = nullptr;    // [G, N, K]
  const void* bias = nullptr;      // [G, N]; needed for dbias_scale
  void* dx = nullptr;              // [capacity_rows, K]; may be null (no input gradient)
  void* dbias = nullptr;           // [G, N]: db_e = sum_r s_r dy_r (s = 1 without a bias scale)
  float* dbias_scale = nullptr;    // [capacity_rows]: ds_r = <dy_r, b_e>
  void* dweight = nullptr;         // [G, N, K] written (an empty group gets zeros), or
  float* main_grad = nullptr;      // [G, N, K] fp32 accumulated into (an empty group: unchanged)
  // options.prequantized_weights: W as MXFP8; dx reads data_t and scales_t (`weight` may be null).
  Mxfp8Weights mxfp8_weights;
  // Optional; the mxfp8 recipe only, N a multiple of 256, no bias gradients: dy is then da
  // [capacity_rows, N / 2], the gradient of a = silu(gate) * up, and this is the [capacity_rows, N]
  // gate | up that a was made of (e.g. FC1's output, which FC2 read with ForwardArgs::x_swiglu).
  // The output gradient is dgate | dup, computed by dy's quantizer as it reads, with the bits of
  // kernels::launch_swiglu_backward's output, which is never written. Read during the call only.
  const void* dy_swiglu_gate_up = nullptr;
};

class MOEGRAPH_API GroupedLinear {
 public:
  // Validates the options, picks kernels and allocates its workspace (the saved-context slots and
  // scratch). Before capture.
  explicit GroupedLinear(const GroupedLinearOptions& options);
  // The same, on caller-provided device memory of workspace_bytes(options) bytes, 256-byte aligned
  // (e.g. a step arena shared by shape buckets). Its contents are transient: the saved contexts live
  // there between forward_train and backward / backward_dw.
  GroupedLinear(const GroupedLinearOptions& options, void* workspace);
  // Workspace size (at most 2^48 bytes, else moegraph::Error naming the buffer that would pass it)
  // and its named buffers for these options. Touches no GPU.
  static std::size_t workspace_bytes(const GroupedLinearOptions& options);
  struct WorkspaceBuffer {
    std::string name;
    std::size_t offset, bytes;
  };
  static std::vector<WorkspaceBuffer> workspace_buffers(const GroupedLinearOptions& options);
  ~GroupedLinear();
  GroupedLinear(const GroupedLinear&) = delete;
  GroupedLinear& operator=(const GroupedLinear&) = delete;

  const GroupedLinearOptions& options() const { return options_; }
  // The options and the kernel each GEMM runs (MOEGRAPH_PRINT_CONFIG=1 prints it at set-up).
  std::string describe() const;
  // The kernel each GEMM (fprop, dgrad, wgrad) of these options runs, as describe() prints them;
  // the same heuristic and overrides as set-up. Touches no GPU (--plan).
  static std::string describe_kernels(const GroupedLinearOptions& options);
  // Device bytes this operator uses (workspace, error record, and the mxfp8 recipe's own weight
  // copies unless prequantized_weights).
  std::size_t device_bytes() const;

  // Inference: y = x W^T (+ s b). Saves nothing.
  void forward(const ForwardArgs& args, cudaStream_t stream);
  // Training: the same, and saves x, splits, offsets and the bias scale into the next free slot
  // (or keeps pointers to them: ForwardArgs::offsets, options.caller_keeps_activations).
  // Throws if all wgrad_slots are in use.
  void forward_train(const ForwardArgs& args, cudaStream_t stream);
  // Backward of the oldest forward_train not yet backwarded: dx, dbias, dbias_scale, and the
  // weight gradient at once or queued (then dy is saved in the slot until backward_dw()).
  void backward(const BackwardArgs& args, WgradMode mode, cudaStream_t stream);
  // Runs the oldest queued weight gradient. Bit-identical to the immediate one.
  void backward_dw(cudaStream_t stream);
  // The weights [G, N, K] changed: the recipe prepares what its GEMMs read (MXFP8: the row-wise
  // copy for fprop and the transposed copy W_e^T blocked along N for dgrad; bf16: nothing). An
  // enqueue path: call it before the first forward and after every weight update. Refused with
  // prequantized_weights (the caller keeps its MXFP8 weights current: quantize_mxfp8_weights).
  void weights_changed(const void* weight, cudaStream_t stream);
  // Throws unless a forward (and dgrad) can run: the mxfp8 recipe's own copies need weights_changed
  // first. Host only; forward, forward_train and backward check it before enqueuing anything.
  void require_weights_ready() const;
  int queued_wgrads() const { return static_cast<int>(wgrad_queue_.size()); }
  int pending_backwards() const { return static_cast<int>(backward_queue_.size()); }

  // Synchronizes `stream`, reads the device error record that invalid device inputs raise (splits,
  // an x_rows entry), clears it, and throws moegraph::Error naming the group or row and the value.
  // Never call it inside capture.
  void check_device_errors(cudaStream_t stream);
  // The same record, read and cleared without throwing (code kDeviceErrorNone: none), for a caller
  // that reports it itself; the stream that wrote it must be synchronized. Never inside capture.
  DeviceErrorRecord take_device_error();

 private:
  struct Slot;
  struct Scratch;
  struct QueuedWgrad {
    int slot;
    void* dweight;
    float* main_grad;
  };
  // One walk lays out the workspace: with a null base it only sizes (sizing_walk), with the
  // workspace it binds the slots, the scratch and the backend.
  static void lay_out(const GroupedLinearOptions& o, LayoutWalker& walk, linear::LinearBackend& backend,
                      std::vector<Slot>& slots, Scratch& scratch);
  static LayoutWalker sizing_walk(const GroupedLinearOptions& options);
  // Group offsets for a forward: the caller's, or computed into `computed`.
  const int64_t* group_offsets(const ForwardArgs& args, int64_t* computed, cudaStream_t stream);

  GroupedLinearOptions options_;
  std::unique_ptr<linear::LinearBackend> backend_;  // the recipe's GEMMs and operand copies
  std::vector<Slot> slots_;  // wgrad_slots saved contexts (common part; the backend keeps its own)
  std::vector<int> free_slots_;
  std::deque<int> backward_queue_;
  std::deque<QueuedWgrad> wgrad_queue_;
  std::unique_ptr<Scratch> scratch_;
};

}  // namespace moegraph
