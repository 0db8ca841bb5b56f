// GroupedLinear: G linear layers ("experts") over one grouped-row buffer whose per-group row counts
// (splits) live on the device. Every enqueue method is graph-capturable: it never synchronizes,
// allocates, or reads device memory on the host. Set-up (the constructor) may do all three and
// must happen before capture.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moegraph/types.hpp"

namespace moegraph {

class LayoutWalker;  // src/common/layout.hpp

struct GroupedLinearOptions {
  int num_groups = 0;          // G, 1..1024
  int64_t in_features = 0;     // K, multiple of 16
  int64_t out_features = 0;    // N, multiple of 16
  int64_t capacity_rows = 0;   // rows of every grouped buffer (including alignment padding)
  int row_align = 1;           // each group starts on a multiple of this many rows: 1, 16, 32, 128
  DType dtype = DType::kBF16;  // kBF16 or kFP16
  bool bias = false;           // bias [G, N]
  int wgrad_slots = 1;         // forward_train contexts that may be in flight at once
  bool delay_wgrad = false;    // reserve room so backward can queue wgrad (it then saves dy)
  bool reference_kernels = false;  // the simple WMMA kernels instead of wgmma (differential tests)
  int tile_n = 0;                  // wgmma tile width: 0 = chosen from the shapes, or 128 / 256
  // How the wgmma kernels load operands: chosen at set-up (kAuto), cp.async by all threads, or a
  // warp-specialized TMA producer (tuning and differential tests).
  enum class Loads { kAuto, kCpAsync, kTma };
  Loads loads = Loads::kAuto;
  // kMXFP8: the GEMMs run on MXFP8 copies (x and dy quantized on the fly; the saved activations
  // are kept as MXFP8 column-wise copies instead of a 16-bit copy; the weights are quantized by
  // quantize_weights()). Needs K and N multiples of 128 and row_align 32 or 128.
  Recipe recipe = Recipe::kBF16;
};

// Throws moegraph::Error naming the field, its value and the rule. Touches no GPU.
void validate(const GroupedLinearOptions& options);

// Buffers are device pointers; all row buffers have options.capacity_rows rows. Group e occupies
// rows [offsets[e], offsets[e] + splits[e]); gap rows up to the next aligned start read as zero
// and are written as zero; rows past the last group are neither read nor written.
struct ForwardArgs {
  const void* x = nullptr;            // [capacity_rows, K]
  const int32_t* splits = nullptr;    // [G] int32, device
  const void* weight = nullptr;       // [G, N, K]
  const void* bias = nullptr;         // [G, N]; options.bias must be set
  const float* bias_scale = nullptr;  // [capacity_rows]: y_r = x_r W^T + s_r b (needs bias)
  void* y = nullptr;                  // [capacity_rows, N]
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
};

class GroupedLinear {
 public:
  // Validates the options, picks kernels and allocates its workspace (the saved-context slots and
  // scratch). Before capture.
  explicit GroupedLinear(const GroupedLinearOptions& options);
  // The same, on caller-provided device memory of workspace_bytes(options) bytes, 256-byte aligned
  // (e.g. a step arena shared by shape buckets). Its contents are transient: the saved contexts live
  // there between forward_train and backward / backward_dw.
  GroupedLinear(const GroupedLinearOptions& options, void* workspace);
  // Workspace size and its named buffers for these options. Touches no GPU.
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
  // The kernels and tile configurations chosen (MOEGRAPH_PRINT_CONFIG=1 prints it at set-up).
  std::string describe() const;
  // Device bytes this operator uses (workspace and error record).
  std::size_t device_bytes() const;

  // Inference: y = x W^T (+ s b). Saves nothing.
  void forward(const ForwardArgs& args, cudaStream_t stream);
  // Training: the same, and saves x, splits, offsets and the bias scale into the next free slot.
  // Throws if all wgrad_slots are in use.
  void forward_train(const ForwardArgs& args, cudaStream_t stream);
  // Backward of the oldest forward_train not yet backwarded: dx, dbias, dbias_scale, and the
  // weight gradient at once or queued (then dy is saved in the slot until backward_dw()).
  void backward(const BackwardArgs& args, Recipe recipe, WgradMode mode, cudaStream_t stream);
  // Runs the oldest queued weight gradient. Bit-identical to the immediate one.
  void backward_dw(cudaStream_t stream);
  // MXFP8 recipe: quantizes `weight` [G, N, K] into the operator's row-wise copy (fprop) and its
  // transposed copy W_e^T blocked along N (dgrad). An enqueue path: call it once before the first
  // forward and again whenever the weights change (e.g. after each optimizer step).
  void quantize_weights(const void* weight, cudaStream_t stream);
  int queued_wgrads() const { return static_cast<int>(wgrad_queue_.size()); }
  int pending_backwards() const { return static_cast<int>(backward_queue_.size()); }

  // Synchronizes `stream`, reads the device error record that invalid splits raise, clears it, and
  // throws moegraph::Error naming the group and value. Never call it inside capture.
  void check_device_errors(cudaStream_t stream);

 private:
  struct Slot;
  struct QueuedWgrad {
    int slot;
    void* dweight;
    float* main_grad;
  };
  struct Scratch;
  struct Mxfp8State;
  // MXFP8: quantizes x (row-wise, and column-wise into `save`'s x_t when given) and runs fprop.
  void run_mxfp8_fprop(const ForwardArgs& args, const int32_t* splits, const int64_t* offsets,
                       const float* bias_scale, Slot* save, cudaStream_t stream);
  void run_mxfp8_wgrad(const Slot& slot, const void* dy_t, const void* dy_t_scales, void* dweight, float* main_grad,
                       cudaStream_t stream);
  static void lay_out(const GroupedLinearOptions& o, LayoutWalker& walk, std::vector<std::unique_ptr<Slot>>* slots,
                      Scratch* scratch, Mxfp8State* mx_state);
  void run_fprop(const ForwardArgs& args, const int32_t* splits, const int64_t* offsets,
                 const float* bias_scale, cudaStream_t stream);
  void run_wgrad(const void* dy, const void* x, const int32_t* splits, const int64_t* offsets,
                 void* dweight, float* main_grad, cudaStream_t stream);

  GroupedLinearOptions options_;
  int tile_n_fprop_ = 128, tile_n_dgrad_ = 128, tile_n_wgrad_ = 128;  // chosen at set-up from the shapes
  using Loads = GroupedLinearOptions::Loads;
  Loads loads_fprop_ = Loads::kTma, loads_dgrad_ = Loads::kTma, loads_wgrad_ = Loads::kTma;  // likewise
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<int> free_slots_;
  std::deque<int> backward_queue_;
  std::deque<QueuedWgrad> wgrad_queue_;
  std::unique_ptr<Scratch> scratch_;
  std::unique_ptr<Mxfp8State> mx_;  // MXFP8 recipe only
};

// Last-resort device check usable by any caller: the record type the offset kernel writes.
struct DeviceErrorRecord {
  int32_t code;   // 0: none, 1: negative split, 2: splits past capacity
  int32_t group;  // first offending group
  int64_t value;  // the split (code 1) or the aligned row total (code 2)
  int64_t limit;  // capacity_rows (code 2)
};

}  // namespace moegraph
