// One operator of the MoE layer program: it declares its tensors for a bucket, then enqueues its
// forward, its backward and (optionally) a delayed weight gradient. Every enqueue method is a
// capture-safe path: no synchronization, allocation or device read on the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "moegraph/moe_layer.hpp"
#include "src/ops/moe/tensor_table.hpp"

namespace moegraph::layer {

// What one phase of one micro-batch sees.
struct Phase {
  const MoeLayerIO* io = nullptr;
  int slot = 0;          // the saved-tensor slot of this micro-batch (inference: 0)
  bool train = false;    // forward: save what backward needs
  WgradMode wgrad = WgradMode::kImmediate;
  TensorTable* tensors = nullptr;
};

class LayerOp {
 public:
  virtual ~LayerOp() = default;
  // "router", "dispatch", "fc1", ... and the kernels it runs (for describe() and --plan).
  virtual std::string name() const = 0;
  virtual std::string kernels() const = 0;
  // Declares the tensors this op produces and its workspaces. `training`: backward tensors too.
  virtual void declare(TensorTable& t, bool training) = 0;
  // After the table is laid out on real memory: bind sub-operators to their workspaces.
  virtual void bind(TensorTable& /*t*/) {}
  virtual void forward(const Phase& p, cudaStream_t stream) = 0;
  virtual void backward(const Phase& p, cudaStream_t stream) = 0;
  // The oldest weight gradient this op queued in a delayed backward (if it has weights).
  virtual void wgrad(cudaStream_t /*stream*/) {}
  // The weights were updated (MXFP8: re-quantize the copies the GEMMs read).
  virtual void weights_changed(cudaStream_t /*stream*/) {}
  // Throws unless the operator's forward can run with the weights as they stand (the mxfp8 linears
  // before weights_changed): checked for every operator before a forward enqueues the first.
  virtual void require_ready() const {}
  // The weights and gradient buffers moved (LayerProgram::set_weights has checked them): later
  // enqueues read and write the new addresses.
  virtual void set_weights(const MoeLayerWeights& /*w*/) {}
  // Synchronized by the caller already: read and clear the op's device error record (code
  // kDeviceErrorNone when nothing was raised).
  virtual DeviceErrorRecord take_device_error() { return {}; }
  // Synchronized by the caller already: (token, expert) assignments dropped since the last call.
  virtual uint64_t take_dropped() { return 0; }
};

}  // namespace moegraph::layer
