// A recipe's half of GroupedLinear: the operand copies its GEMMs read (laid out in the operator's
// workspace), weight preparation, fprop, dgrad and wgrad, and describe. GroupedLinear keeps the
// slots and queues, the group offsets and the bias gradients, and hands the backend the slot of
// each micro-batch; a backend never sees another recipe. Adding a recipe: docs/recipes.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/grouped_gemm/grouped_gemm.hpp"
#include "moegraph/grouped_linear.hpp"
#include "src/core/layout.hpp"

namespace moegraph::linear {

// One micro-batch's group layout as the GEMMs read it (device).
struct Groups {
  const int32_t* splits = nullptr;   // [G]
  const int64_t* offsets = nullptr;  // [G + 1], aligned starts
  DeviceErrorRecord* error = nullptr;  // where a kernel records invalid device inputs (the operator's)
};

class LinearBackend {
 public:
  virtual ~LinearBackend() = default;
  // Lays out the backend's scratch, then (lay_out_slot) what one slot keeps for backward and
  // wgrad. With a null base the walk only sizes; with the workspace it binds the pointers.
  virtual void lay_out_scratch(LayoutWalker& walk) = 0;
  virtual void lay_out_slot(LayoutWalker& walk, int slot, const std::string& prefix) = 0;
  // Set-up on the current device, after the layout on real memory: GEMM plans, weight copies.
  virtual void prepare(int sm_count) = 0;
  virtual std::string describe() const = 0;
  // Device bytes the backend keeps outside the workspace (the mxfp8 recipe's weight copies).
  virtual std::size_t weight_copy_bytes() const { return 0; }

  // The weights changed (an enqueue path).
  virtual void weights_changed(const void* weight, cudaStream_t stream) = 0;
  // Throws unless the GEMMs that read the weights (fprop, dgrad) can run: called before a call
  // enqueues anything, so a refused call leaves nothing behind.
  virtual void require_weights_ready() const {}
  // y = x W^T (+ s b); with save_slot >= 0 also keeps in that slot what wgrad reads of x.
  virtual void fprop(const ForwardArgs& args, Groups groups, int save_slot, cudaStream_t stream) = 0;
  // dx = dy W (when args.dx), and the weight gradient now (kImmediate) or dy kept in the slot for
  // delayed_wgrad (kDelayed).
  virtual void backward(const BackwardArgs& args, Groups groups, int slot, WgradMode mode, cudaStream_t stream) = 0;
  // The weight gradient of a micro-batch whose backward ran with kDelayed.
  virtual void delayed_wgrad(int slot, Groups groups, void* dweight, float* main_grad, cudaStream_t stream) = 0;
};

// The backend of options.recipe (sizing only until prepare()).
std::unique_ptr<LinearBackend> make_linear_backend(const GroupedLinearOptions& options);

// Each recipe's GEMM configs for these options, from the one heuristic (kernels/grouped_gemm);
// wgrad's into dW, or into fp32 main_grad.
kernels::GemmConfig gemm_config(const GroupedLinearOptions& options, kernels::GemmPhase phase,
                                bool into_main_grad = false);
// "fprop: ... | dgrad: ... | wgrad: ...", and "| wgrad into main_grad: ..." where that differs.
std::string describe_gemm_configs(const kernels::GemmConfig& fprop, const kernels::GemmConfig& dgrad,
                                  const kernels::GemmConfig& wgrad, const kernels::GemmConfig& wgrad_main_grad);

// wgrad's two plans, one per destination: the heuristic may pick different kernels (a tile's
// main_grad load waits on memory in its epilogue, a dW tile's stores do not), and a call's
// destination is known only when it is made.
struct WgradPlans {
  kernels::GemmPlan into_dweight, into_main_grad;
  const kernels::GemmPlan& for_call(const float* main_grad) const;
};
WgradPlans prepare_wgrad_plans(const kernels::GemmConfig& into_dweight, const kernels::GemmConfig& into_main_grad,
                                int sm_count);

// Per recipe, in its own file: "" when its kernels can run these options, else the reason.
std::string bf16_can_implement(const GroupedLinearOptions& options);
std::string mxfp8_can_implement(const GroupedLinearOptions& options);
std::string mxfp8_can_train(const GroupedLinearOptions& options);
std::unique_ptr<LinearBackend> make_bf16_backend(const GroupedLinearOptions& options);
std::unique_ptr<LinearBackend> make_mxfp8_backend(const GroupedLinearOptions& options);

}  // namespace moegraph::linear
