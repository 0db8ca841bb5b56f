// Expert-parallel dispatch and combine: the layer's dispatch and combine when its experts are spread
// over R ranks (moegraph/expert_parallel.hpp). Every exchange pushes: a rank stores rows into its
// peers' windows, then a device barrier publishes them.
//
//   forward   dispatch: local counting sort by expert (row_align 1) -> counts to every rank ->
//                       barrier -> receive plan -> own rows to their owners' receive buffers
//                       (grouped by local expert: FC1 reads them as its group layout) -> barrier
//             experts (FC1, SwiGLU, FC2 on this rank's El experts)
//             combine:  the experts' rows back to their sources' windows (local row order) ->
//                       barrier -> the weighted sum per token, locally
//   backward  combine:  local combine backward -> row gradients to the owners -> barrier
//             experts backward (wgrad stays local, at once or delayed)
//             dispatch: the input-row gradients back to their sources -> barrier -> un-permute
//                       sum into dx
//
// Why no barrier before a push: every phase ends with one, and a rank reads each window buffer
// only before the barrier that ends the phase in which it was filled; the next store into it
// comes from a rank that has passed a later barrier, so the reader is done.
#include <memory>

#include "kernels/comm/ep_exchange.hpp"
#include "kernels/routing/moe_routing.hpp"
#include "moegraph/error.hpp"
#include "moegraph/expert_parallel.hpp"
#include "src/core/checked.hpp"
#include "src/core/device_buffer.hpp"
#include "src/ops/group_layout.hpp"
#include "src/ops/moe/dispatch_common.hpp"
#include "src/ops/moe/op_spec.hpp"

namespace moegraph::layer {
namespace {

// Tensors the two operators share (declared by the dispatch).
namespace ep {
constexpr const char* kLocalSplits = "ep.local_splits";      // saved [E] i32: this rank's rows per expert
constexpr const char* kLocalOffsets = "ep.local_offsets";    // saved [E + 1] i64 (row_align 1)
constexpr const char* kMatrix = "ep.matrix";                 // window, saved [R][E + 1] i32
constexpr const char* kFlags = "ep.flags";                   // window [R] u32: barrier flags
constexpr const char* kEpoch = "ep.epoch";                   // window (local use) u32: barrier epoch
constexpr const char* kToOwner = "ep.to_owner";              // saved [E] EpSegment
constexpr const char* kToOwnerPrefix = "ep.to_owner_prefix";  // saved [E + 1] i64
constexpr const char* kToSource = "ep.to_source";            // saved [E] EpSegment
constexpr const char* kToSourcePrefix = "ep.to_source_prefix";
constexpr const char* kRecvGaps = "ep.recv_gaps";            // saved [L][2] i64
constexpr const char* kDroppedRows = "ep.dropped_rows";      // saved [E][2] i64
constexpr const char* kSend = "ep.send";                     // [local rows, H]: rows leaving this rank
constexpr const char* kReturned = "ep.returned";             // window [local rows, H]: dx rows come back here
constexpr const char* kCombineIn = "ep.combine_in";          // window, saved [local rows, H]: expert rows back
}  // namespace ep

// The rank's place in the group and its barrier.
struct EpLink {
  int rank = 0, ranks = 1;
  long long timeout_ns = 0;

  void barrier(const TensorTable& t, DeviceErrorRecord* error, cudaStream_t stream) const {
    kernels::EpBarrierParams b;
    b.flags = t.peers(ep::kFlags);
    b.epoch = t.get<uint32_t>(ep::kEpoch);
    b.rank = rank, b.ranks = ranks;
    b.timeout_ns = timeout_ns;
    b.error = error;
    kernels::launch_ep_barrier(b, stream);
  }
};

// `comm` is null when sizing only (LayerProgram checked it against the options otherwise).
EpLink link_of(const MoeLayerOptions& o, const EpComm* comm) {
  EpLink l;
  l.ranks = o.expert_parallel;
  if (comm != nullptr) {
    l.rank = comm->rank();
    l.timeout_ns = comm->barrier_timeout_ns();
  }
  return l;
}

// Rows of `src` to the peers' copies of `dst` along a saved segment table, zeroing `zero` ranges
// of this rank's own copy.
void push_rows(const TensorTable& t, int slot, const void* src, std::size_t row_bytes, const std::string& dst,
               int dst_slot, const char* table, const char* prefix, int count, const char* zero, int zero_count,
               int64_t max_rows, cudaStream_t stream) {
  kernels::EpExchangeParams x;
  x.src = src;
  x.row_bytes = row_bytes;
  x.dst = t.peers(dst, dst_slot);
  x.segments = t.get<kernels::EpSegment>(table, slot);
  x.prefix = t.get<int64_t>(prefix, slot);
  x.count = count;
  x.zero_ranges = t.get<int64_t>(zero, slot);
  x.zero_count = zero_count;
  x.local_dst = t.get(dst, dst_slot);
  x.max_rows = max_rows;
  kernels::launch_ep_exchange(x, stream);
}

class EpDispatchOp final : public LayerOp {
 public:
  EpDispatchOp(const MoeLayerOptions& o, std::shared_ptr<EpComm> comm)
      : o_(o),
        comm_(std::move(comm)),
        link_(link_of(o, comm_.get())),
        local_experts_(moe_local_experts(o)),
        local_rows_(checked_mul("local rows", o.max_tokens, o.top_k)),
        recv_rows_(moe_expert_rows(o)) {}

  std::string name() const override { return "dispatch"; }
  std::string kernels() const override {
    return detail::concat("dispatch over ", o_.expert_parallel, " ranks (",
                          comm_ ? comm_->transport() : std::string("transport chosen at set-up"),
                          "): local counting sort by expert, counts to every rank, device barrier, receive plan, "
                          "exact rows stored into the owners' windows (", recv_rows_,
                          " receive rows per rank); backward: rows back to their sources, un-permute sum into dx");
  }

  void declare(TensorTable& t, bool training) override {
    const int64_t e = o_.experts, l = local_experts_, r = o_.expert_parallel, tk = o_.max_tokens, k = o_.top_k;
    const std::size_t row = checked_mul("row bytes", o_.hidden, dtype_size(o_.dtype));
    const auto saved = Lifetime::kSaved, step = Lifetime::kStep;
    const auto window = Placement::kWindow;
    t.declare(tensor::kCounts, checked_mul(tensor::kCounts, e, sizeof(int32_t)), saved);
    t.declare(ep::kLocalSplits, checked_mul(ep::kLocalSplits, e, sizeof(int32_t)), saved);
    t.declare(ep::kLocalOffsets, checked_mul(ep::kLocalOffsets, e + 1, sizeof(int64_t)), saved);
    t.declare(tensor::kRowOf, checked_mul(tensor::kRowOf, tk, k, sizeof(int32_t)), saved);
    t.declare(tensor::kTokenOfRow, checked_mul(tensor::kTokenOfRow, local_rows_, sizeof(int32_t)), saved);
    t.declare(tensor::kRowWeight, checked_mul(tensor::kRowWeight, local_rows_, sizeof(float)), saved);
    t.declare(tensor::kSplits, checked_mul(tensor::kSplits, l, sizeof(int32_t)), saved);
    t.declare(tensor::kOffsets, checked_mul(tensor::kOffsets, l + 1, sizeof(int64_t)), saved);
    t.declare(ep::kToOwner, checked_mul(ep::kToOwner, e, sizeof(kernels::EpSegment)), saved);
    t.declare(ep::kToOwnerPrefix, checked_mul(ep::kToOwnerPrefix, e + 1, sizeof(int64_t)), saved);
    t.declare(ep::kToSource, checked_mul(ep::kToSource, e, sizeof(kernels::EpSegment)), saved);
    t.declare(ep::kToSourcePrefix, checked_mul(ep::kToSourcePrefix, e + 1, sizeof(int64_t)), saved);
    t.declare(ep::kRecvGaps, checked_mul(ep::kRecvGaps, l, 2, sizeof(int64_t)), saved);
    t.declare(ep::kDroppedRows, checked_mul(ep::kDroppedRows, e, 2, sizeof(int64_t)), saved);
    t.declare("dispatch.workspace", kernels::dispatch_workspace_bytes(tk, o_.experts, o_.top_k), step);
    t.declare("ep.plan_scratch", kernels::ep_plan_scratch_bytes(o_.expert_parallel, o_.experts), step);
    t.declare(ep::kSend, checked_mul(ep::kSend, local_rows_, row), step);
    t.declare(ep::kMatrix, checked_mul(ep::kMatrix, r, e + 1, sizeof(int32_t)), saved, window);
    t.declare(ep::kFlags, checked_mul(ep::kFlags, r, sizeof(uint32_t)), step, window);
    t.declare(ep::kEpoch, sizeof(uint32_t), step, window);
    // The receive buffer: FC1's input in forward, FC2's output gradient in backward (the combine
    // names it so); the two uses never overlap (a phase's barrier lies between them).
    t.declare(tensor::kPermutedX, checked_mul(tensor::kPermutedX, recv_rows_, row), step, window);
    if (!training) return;
    t.declare(tensor::kDTopkWeights, checked_mul(tensor::kDTopkWeights, tk, k, sizeof(float)), step);
    t.declare(ep::kReturned, checked_mul(ep::kReturned, local_rows_, row), step, window);
  }

  void bind(TensorTable&) override { records_.bind(); }

  void forward(const Phase& p, cudaStream_t stream) override {
    const TensorTable& t = *p.tensors;
    const int s = p.slot;
    const int32_t* tokens = t.get<int32_t>(tensor::kTokens, s);
    // This rank's rows in expert order: row_align 1 (no GEMM reads them), never dropped here.
    const kernels::DispatchParams d = dispatch_params(t, s, o_, ep::kLocalSplits, ep::kLocalOffsets, 1, local_rows_,
                                                      0.0, records_);
    kernels::launch_dispatch(d, stream);
    kernels::launch_permute_rows(o_.dtype, p.io->x, d.token_of_row, d.splits, d.offsets, o_.experts, o_.hidden,
                                 t.get(ep::kSend), stream);

    kernels::launch_ep_share_counts(d.counts, tokens, o_.experts, link_.rank, link_.ranks, t.peers(ep::kMatrix, s),
                                    stream);
    link_.barrier(t, records_.error(), stream);
    kernels::EpPlanParams plan;
    plan.matrix = t.get<int32_t>(ep::kMatrix, s);
    plan.rank = link_.rank, plan.ranks = link_.ranks, plan.experts = o_.experts, plan.row_align = o_.row_align;
    plan.max_tokens = o_.max_tokens;
    plan.local_rows = local_rows_;
    plan.recv_rows = recv_rows_;
    plan.splits = t.get<int32_t>(tensor::kSplits, s);
    plan.offsets = t.get<int64_t>(tensor::kOffsets, s);
    plan.to_owner = t.get<kernels::EpSegment>(ep::kToOwner, s);
    plan.to_owner_prefix = t.get<int64_t>(ep::kToOwnerPrefix, s);
    plan.to_source = t.get<kernels::EpSegment>(ep::kToSource, s);
    plan.to_source_prefix = t.get<int64_t>(ep::kToSourcePrefix, s);
    plan.recv_gaps = t.get<int64_t>(ep::kRecvGaps, s);
    plan.dropped_rows = t.get<int64_t>(ep::kDroppedRows, s);
    plan.scratch = t.get<int32_t>("ep.plan_scratch");
    plan.dropped = records_.dropped();
    plan.error = records_.error();
    kernels::launch_ep_plan(plan, stream);
    push_rows(t, s, t.get(ep::kSend), row_bytes(), tensor::kPermutedX, 0, ep::kToOwner, ep::kToOwnerPrefix,
              o_.experts, ep::kRecvGaps, local_experts_, local_rows_, stream);
    link_.barrier(t, records_.error(), stream);
  }

  void backward(const Phase& p, cudaStream_t stream) override {
    const TensorTable& t = *p.tensors;
    MG_CHECK(p.io->dx != nullptr && p.io->dy != nullptr, "backward needs MoeLayerIO::dy and dx");
    const int s = p.slot;
    push_rows(t, s, t.get(tensor::grad(tensor::kPermutedX)), row_bytes(), ep::kReturned, 0, ep::kToSource,
              ep::kToSourcePrefix, o_.experts, ep::kDroppedRows, o_.experts, recv_rows_, stream);
    link_.barrier(t, records_.error(), stream);
    const int32_t* tokens = t.get<int32_t>(tensor::kTokens, s);
    const int32_t* row_of = t.get<int32_t>(tensor::kRowOf, s);
    kernels::launch_gather_row_values(t.get<float>(tensor::kDRowWeight), row_of, tokens, o_.max_tokens, o_.top_k,
                                      t.get<float>(tensor::kDTopkWeights), stream);
    kernels::launch_unpermute(o_.dtype, t.get(ep::kReturned), row_of, tokens, o_.max_tokens, o_.top_k, o_.hidden,
                              p.io->dx, stream);
  }

  DeviceErrorRecord take_device_error() override { return records_.take_error(); }
  uint64_t take_dropped() override { return records_.take_dropped(); }

 private:
  std::size_t row_bytes() const { return static_cast<std::size_t>(o_.hidden) * dtype_size(o_.dtype); }

  MoeLayerOptions o_;
  std::shared_ptr<EpComm> comm_;
  EpLink link_;
  int local_experts_;
  int64_t local_rows_, recv_rows_;
  DispatchRecords records_;
};

class EpCombineOp final : public LayerOp {
 public:
  EpCombineOp(const OpSpec& spec, const MoeLayerOptions& o, std::shared_ptr<EpComm> comm)
      : spec_(spec),
        o_(o),
        link_(link_of(o, comm.get())),
        local_experts_(moe_local_experts(o)),
        local_rows_(checked_mul("local rows", o.max_tokens, o.top_k)),
        recv_rows_(moe_expert_rows(o)) {
    MG_CHECK(spec.weighted, "expert-parallel combine applies the routing weights itself (fuse_weights is not "
             "supported with expert_parallel > 1)");
  }
  std::string name() const override { return spec_.name; }
  std::string kernels() const override {
    return "combine over ranks: expert rows stored back into their sources' windows, device barrier, weighted sum "
           "of k rows per token (fp32); backward: scaled rows and row-weight gradients locally, rows to their "
           "owners";
  }

  void declare(TensorTable& t, bool training) override {
    const std::size_t row = checked_mul("row bytes", o_.hidden, dtype_size(o_.dtype));
    t.declare(ep::kCombineIn, checked_mul(ep::kCombineIn, local_rows_, row), Lifetime::kSaved, Placement::kWindow);
    if (!training) return;
    t.alias(tensor::grad(spec_.in), tensor::kPermutedX);
    t.declare(tensor::kDRowWeight, checked_mul(tensor::kDRowWeight, local_rows_, sizeof(float)), Lifetime::kStep);
  }

  void bind(TensorTable&) override {
    error_ = DeviceBuffer(sizeof(DeviceErrorRecord));
    MG_CUDA_CHECK(cudaMemset(error_.get(), 0, sizeof(DeviceErrorRecord)));
  }

  void forward(const Phase& p, cudaStream_t stream) override {
    const TensorTable& t = *p.tensors;
    MG_CHECK(p.io->y != nullptr, "MoeLayerIO needs y");
    const int s = p.slot;
    push_rows(t, s, t.get(spec_.in, s), row_bytes(), ep::kCombineIn, s, ep::kToSource, ep::kToSourcePrefix,
              o_.experts, ep::kDroppedRows, o_.experts, recv_rows_, stream);
    link_.barrier(t, error_.as<DeviceErrorRecord>(), stream);
    kernels::launch_combine(o_.dtype, t.get(ep::kCombineIn, s), t.get<int32_t>(tensor::kRowOf, s),
                            t.get<float>(tensor::kTopkWeights, s), t.get<int32_t>(tensor::kTokens, s), o_.max_tokens,
                            o_.top_k, o_.hidden, p.io->y, stream);
  }

  void backward(const Phase& p, cudaStream_t stream) override {
    const TensorTable& t = *p.tensors;
    MG_CHECK(p.io->dy != nullptr, "backward needs MoeLayerIO::dy");
    const int s = p.slot;
    kernels::launch_combine_backward(o_.dtype, p.io->dy, t.get<int32_t>(tensor::kTokenOfRow, s),
                                     t.get<float>(tensor::kRowWeight, s), t.get(ep::kCombineIn, s),
                                     t.get<int32_t>(ep::kLocalSplits, s), t.get<int64_t>(ep::kLocalOffsets, s),
                                     o_.experts, o_.hidden, t.get(ep::kSend), t.get<float>(tensor::kDRowWeight),
                                     stream);
    push_rows(t, s, t.get(ep::kSend), row_bytes(), tensor::grad(spec_.in), 0, ep::kToOwner, ep::kToOwnerPrefix,
              o_.experts, ep::kRecvGaps, local_experts_, local_rows_, stream);
    link_.barrier(t, error_.as<DeviceErrorRecord>(), stream);
  }

  DeviceErrorRecord take_device_error() override { return take_device_error_record(error_); }

 private:
  std::size_t row_bytes() const { return static_cast<std::size_t>(o_.hidden) * dtype_size(o_.dtype); }

  OpSpec spec_;
  MoeLayerOptions o_;
  EpLink link_;
  int local_experts_;
  int64_t local_rows_, recv_rows_;
  DeviceBuffer error_;  // its barriers' timeouts
};

}  // namespace

std::unique_ptr<LayerOp> make_ep_dispatch_op(const OpSpec&, const MoeLayerOptions& o, std::shared_ptr<EpComm> comm) {
  return std::make_unique<EpDispatchOp>(o, std::move(comm));
}
std::unique_ptr<LayerOp> make_ep_combine_op(const OpSpec& spec, const MoeLayerOptions& o,
                                            std::shared_ptr<EpComm> comm) {
  return std::make_unique<EpCombineOp>(spec, o, std::move(comm));
}

}  // namespace moegraph::layer
