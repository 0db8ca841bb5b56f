// Dispatch (tokens -> expert-contiguous rows, with the maps that undo it) and combine (each
// token's weighted sum of its k expert rows), with their backward.
#include <memory>
#include <string>

#include "kernels/routing/moe_routing.hpp"
#include "moegraph/error.hpp"
#include "src/core/device_buffer.hpp"
#include "src/core/checked.hpp"
#include "src/ops/group_layout.hpp"
#include "src/ops/moe/dispatch_common.hpp"
#include "src/ops/moe/op_spec.hpp"

namespace moegraph::layer {
namespace {

class DispatchOp final : public LayerOp {
 public:
  DispatchOp(const OpSpec& spec, const MoeLayerOptions& o) : spec_(spec), o_(o), rows_(moe_layer_rows(o)) {}
  std::string name() const override { return "dispatch"; }
  std::string kernels() const override {
    return describe_local_dispatch(!spec_.out.empty()) +
           "; backward: gather of the row-weight gradients, un-permute sum into dx";
  }

  void declare(TensorTable& t, bool training) override {
    const int64_t e = o_.experts, tk = o_.max_tokens, k = o_.top_k;
    t.declare(tensor::kCounts, checked_mul(tensor::kCounts, e, sizeof(int32_t)), Lifetime::kSaved);
    t.declare(tensor::kSplits, checked_mul(tensor::kSplits, e, sizeof(int32_t)), Lifetime::kSaved);
    t.declare(tensor::kOffsets, checked_mul(tensor::kOffsets, e + 1, sizeof(int64_t)), Lifetime::kSaved);
    t.declare(tensor::kRowOf, checked_mul(tensor::kRowOf, tk, k, sizeof(int32_t)), Lifetime::kSaved);
    t.declare(tensor::kTokenOfRow, checked_mul(tensor::kTokenOfRow, rows_, sizeof(int32_t)), Lifetime::kSaved);
    t.declare(tensor::kRowWeight, checked_mul(tensor::kRowWeight, rows_, sizeof(float)), Lifetime::kSaved);
    if (!spec_.out.empty())  // else FC1 gathers the tokens itself (OpSpec::gather)
      t.declare(spec_.out, checked_mul(spec_.out, rows_, o_.hidden, dtype_size(o_.dtype)),
                spec_.save_out ? Lifetime::kSaved : Lifetime::kStep);
    t.declare("dispatch.workspace", kernels::dispatch_workspace_bytes(tk, o_.experts, o_.top_k), Lifetime::kStep);
    if (training)
      t.declare(tensor::kDTopkWeights, checked_mul(tensor::kDTopkWeights, tk, k, sizeof(float)), Lifetime::kStep);
  }

  void bind(TensorTable&) override { records_.bind(); }

  void forward(const Phase& p, cudaStream_t stream) override {
    const TensorTable& t = *p.tensors;
    const kernels::DispatchParams d = dispatch_params(t, p.slot, o_, tensor::kSplits, tensor::kOffsets, o_.row_align,
                                                      rows_, o_.capacity_factor, records_);
    kernels::launch_dispatch(d, stream);
    if (!spec_.out.empty())
      kernels::launch_permute_rows(o_.dtype, p.io->x, d.token_of_row, d.splits, d.offsets, o_.experts, o_.hidden,
                                   t.get(spec_.out, p.slot), stream);
  }

  void backward(const Phase& p, cudaStream_t stream) override {
    const TensorTable& t = *p.tensors;
    MG_CHECK(p.io->dx != nullptr && p.io->dy != nullptr, "backward needs MoeLayerIO::dy and dx");
    const int32_t* tokens = t.get<int32_t>(tensor::kTokens, p.slot);
    const int32_t* row_of = t.get<int32_t>(tensor::kRowOf, p.slot);
    kernels::launch_gather_row_values(t.get<float>(tensor::kDRowWeight), row_of, tokens, o_.max_tokens, o_.top_k,
                                      t.get<float>(tensor::kDTopkWeights), stream);
    // Every row of dx, zeros past n: the router's dx GEMM then adds into all of them.
    kernels::launch_unpermute(o_.dtype, t.get(tensor::grad(tensor::kPermutedX)), row_of, tokens, o_.max_tokens,
                              o_.top_k, o_.hidden, p.io->dx, stream);
  }

  DeviceErrorRecord take_device_error() override { return records_.take_error(); }
  uint64_t take_dropped() override { return records_.take_dropped(); }

 private:
  OpSpec spec_;
  MoeLayerOptions o_;
  int64_t rows_;
  DispatchRecords records_;
};

class CombineOp final : public LayerOp {
 public:
  CombineOp(const OpSpec& spec, const MoeLayerOptions& o) : spec_(spec), o_(o), rows_(moe_layer_rows(o)) {}
  std::string name() const override { return spec_.name; }
  std::string kernels() const override {
    return spec_.weighted ? "combine: weighted sum of k rows per token (fp32); backward: scaled row scatter + "
                            "row-weight gradient dot products"
                          : "combine: sum of k rows per token (fp32; weights applied in the SwiGLU); backward: "
                            "row scatter";
  }

  void declare(TensorTable& t, bool training) override {
    if (!training) return;
    const std::string d_in = tensor::grad(spec_.in);
    t.declare(d_in, checked_mul(d_in, rows_, o_.hidden, dtype_size(o_.dtype)),
              spec_.save_d_in ? Lifetime::kSaved : Lifetime::kStep);
    if (spec_.weighted)
      t.declare(tensor::kDRowWeight, checked_mul(tensor::kDRowWeight, rows_, sizeof(float)), Lifetime::kStep);
  }

  void forward(const Phase& p, cudaStream_t stream) override {
    const TensorTable& t = *p.tensors;
    MG_CHECK(p.io->y != nullptr, "MoeLayerIO needs y");
    const int s = p.slot;
    kernels::launch_combine(o_.dtype, t.get(spec_.in, s), t.get<int32_t>(tensor::kRowOf, s),
                            spec_.weighted ? t.get<float>(tensor::kTopkWeights, s) : nullptr,
                            t.get<int32_t>(tensor::kTokens, s), o_.max_tokens, o_.top_k, o_.hidden, p.io->y, stream);
  }

  void backward(const Phase& p, cudaStream_t stream) override {
    const TensorTable& t = *p.tensors;
    MG_CHECK(p.io->dy != nullptr, "backward needs MoeLayerIO::dy");
    const int s = p.slot;
    kernels::launch_combine_backward(o_.dtype, p.io->dy, t.get<int32_t>(tensor::kTokenOfRow, s),
                                     spec_.weighted ? t.get<float>(tensor::kRowWeight, s) : nullptr,
                                     spec_.weighted ? t.get(spec_.in, s) : nullptr, t.get<int32_t>(tensor::kSplits, s),
                                     t.get<int64_t>(tensor::kOffsets, s), o_.experts, o_.hidden,
                                     t.get(tensor::grad(spec_.in), s),
                                     spec_.weighted ? t.get<float>(tensor::kDRowWeight) : nullptr, stream);
  }

 private:
  OpSpec spec_;
  MoeLayerOptions o_;
  int64_t rows_;
};

}  // namespace

void DispatchRecords::bind() {
  error_ = DeviceBuffer(sizeof(DeviceErrorRecord));
  zero_now(error_.get(), sizeof(DeviceErrorRecord));
  dropped_ = DeviceBuffer(sizeof(unsigned long long));
  zero_now(dropped_.get(), sizeof(unsigned long long));
}

DeviceErrorRecord DispatchRecords::take_error() { return take_device_error_record(error_); }

uint64_t DispatchRecords::take_dropped() {
  unsigned long long dropped = 0;
  MG_CUDA_CHECK(cudaMemcpy(&dropped, dropped_.get(), sizeof(dropped), cudaMemcpyDeviceToHost));
  zero_now(dropped_.get(), sizeof(dropped));
  return dropped;
}

kernels::DispatchParams dispatch_params(const TensorTable& t, int s, const MoeLayerOptions& o,
                                        const std::string& splits, const std::string& offsets, int row_align,
                                        int64_t capacity_rows, double capacity_factor, const DispatchRecords& records) {
  kernels::DispatchParams d;
  d.topk_ids = t.get<int32_t>(tensor::kTopkIds, s);
  d.topk_weights = t.get<float>(tensor::kTopkWeights, s);
  d.num_tokens = t.get<int32_t>(tensor::kTokens, s);
  d.max_tokens = o.max_tokens;
  d.experts = o.experts;
  d.top_k = o.top_k;
  d.row_align = row_align;
  d.capacity_rows = capacity_rows;
  d.capacity_factor = capacity_factor;
  d.counts = t.get<int32_t>(tensor::kCounts, s);
  d.splits = t.get<int32_t>(splits, s);
  d.offsets = t.get<int64_t>(offsets, s);
  d.row_of = t.get<int32_t>(tensor::kRowOf, s);
  d.token_of_row = t.get<int32_t>(tensor::kTokenOfRow, s);
  d.row_weight = t.get<float>(tensor::kRowWeight, s);
  d.dropped = records.dropped();
  d.workspace = t.get<int32_t>("dispatch.workspace");
  d.error = records.error();
  return d;
}

std::unique_ptr<LayerOp> make_dispatch_op(const OpSpec& spec, const MoeLayerOptions& o) {
  return std::make_unique<DispatchOp>(spec, o);
}
std::unique_ptr<LayerOp> make_combine_op(const OpSpec& spec, const MoeLayerOptions& o) {
  return std::make_unique<CombineOp>(spec, o);
}

}  // namespace moegraph::layer
