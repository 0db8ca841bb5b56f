// Expert-parallel dispatch and combine: the layer's dispatch and combine when its experts are spread
// over R ranks (moegraph/expert_parallel.hpp). Every exchange pushes: a rank stores rows into its
// peers' windows, then a device barrier publishes them.
//
//   forward   dispatch: local counting sort by expert (row_align 1) -> counts to every rank ->
//                       barrier -> receive plan -> own rows, read from x in place, to their
//                       owners' receive buffers (grouped by local expert: FC1 reads them as its
//                       group layout) -> barrier
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
//
// With EpExchange::kSendRecv the same plan and tables drive a different move: each exchange packs
// this rank's rows into one fixed chunk per peer, EpComm::all_to_all moves the chunks whole, and
// the receiver unpacks each source's chunk into place (the plan's tables give both sides the same
// order). The counts travel the same way. Received chunks alternate between two staging buffers
// (dispatch forward and combine backward use one, combine forward and dispatch backward the
// other): on emulated ranks a peer may push its next exchange as soon as it has passed this one's
// barrier, while this rank still unpacks; the staging it pushes into was last read two exchanges
// ago, before a barrier that peer has passed.
#include <memory>
#include <string>

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
constexpr const char* kEpoch = "ep.epoch";                   // window (local use) u32: the link word (epoch, stopped)
constexpr const char* kToOwner = "ep.to_owner";              // saved [E] EpSegment
constexpr const char* kToOwnerPrefix = "ep.to_owner_prefix";  // saved [E + 1] i64
constexpr const char* kToSource = "ep.to_source";            // saved [E] EpSegment
constexpr const char* kToSourcePrefix = "ep.to_source_prefix";
constexpr const char* kRecvGaps = "ep.recv_gaps";            // saved [L][2] i64
constexpr const char* kDroppedRows = "ep.dropped_rows";      // saved [E][2] i64
constexpr const char* kSend = "ep.send";                     // [local rows, H]: row gradients leaving (combine bwd)
constexpr const char* kReturned = "ep.returned";             // window [local rows, H]: dx rows come back here
constexpr const char* kCombineIn = "ep.combine_in";          // window, saved [local rows, H]: expert rows back
// send/recv only
constexpr const char* kCountChunks = "ep.count_chunks";      // [R][count stride] i32: this rank's row, R times
constexpr const char* kChunksOut = "ep.chunks_out";          // [R][chunk rows, H]: packed rows for each peer
constexpr const char* kChunksInA = "ep.chunks_in_a";         // window [R][chunk rows, H]: rows from each source
constexpr const char* kChunksInB = "ep.chunks_in_b";         // window, the other exchanges' staging
}  // namespace ep

// One exchange of rows: this rank's rows of `src` along the `out` table (segments to peers) into
// `dst`. Peer stores write the peers' copies of dst directly; send/recv unpacks on the receiver
// along the `in` table (the same rows seen from the receiving side), into `chunks_in`'s staging.
struct RowMove {
  const void* src = nullptr;
  const int32_t* src_rows = nullptr;  // set: a gather (EpExchangeParams::src_rows)
  std::string dst;
  int dst_slot = 0;
  const char *out = nullptr, *out_prefix = nullptr, *in = nullptr, *in_prefix = nullptr;
  const char* zero = nullptr;   // row ranges of dst zeroed after the move
  int zero_count = 0;
  int64_t out_rows = 0, in_rows = 0;  // bounds on the rows sent and received
  const char* chunks_in = nullptr;
};

// The rank's place in the group, its barrier and its exchanges.
struct EpLink {
  int rank = 0, ranks = 1, experts = 0;
  long long timeout_ns = 0;
  EpExchange exchange = EpExchange::kPeerStores;
  int64_t chunk_rows = 0;         // send/recv
  int64_t count_stride = 0;       // int32 elements per counts row
  EpComm* comm = nullptr;         // null when sizing only
  std::size_t row_bytes = 0;

  bool send_recv() const { return exchange == EpExchange::kSendRecv; }

  void barrier(const TensorTable& t, DeviceErrorRecord* error, cudaStream_t stream) const {
    kernels::EpBarrierParams b;
    b.flags = t.peers(ep::kFlags);
    b.epoch = t.get<uint32_t>(ep::kEpoch);
    b.rank = rank, b.ranks = ranks;
    b.timeout_ns = timeout_ns;
    b.error = error;
    kernels::launch_ep_barrier(b, stream);
  }

  // counts[0..E) and the token count to row `rank` of every rank's matrix (slot `slot`); when the
  // stream passes this, every rank's row has arrived.
  void share_counts(const TensorTable& t, int slot, const int32_t* counts, const int32_t* tokens,
                    DeviceErrorRecord* error, cudaStream_t stream) const {
    if (!send_recv()) {
      kernels::launch_ep_share_counts(counts, tokens, experts, rank, ranks, t.peers(ep::kMatrix, slot),
                                      t.get<uint32_t>(ep::kEpoch), stream);
      barrier(t, error, stream);
      return;
    }
    kernels::PeerBases chunks;
    int32_t* local = t.get<int32_t>(ep::kCountChunks);
    for (int d = 0; d < ranks; ++d) chunks.base[d] = reinterpret_cast<char*>(local + d * count_stride);
    kernels::launch_ep_share_counts(counts, tokens, experts, 0, ranks, chunks, nullptr, stream);  // local chunks
    comm->all_to_all(local, t.get(ep::kMatrix, slot), count_stride * sizeof(int32_t), error, stream);
  }

  // The move, complete on every rank when the stream passes it (a barrier, or the transport's own).
  void move(const TensorTable& t, int slot, const RowMove& m, DeviceErrorRecord* error, cudaStream_t stream) const {
    kernels::EpExchangeParams x;
    x.row_bytes = row_bytes;
    x.count = experts;
    x.segments_per_peer = experts / ranks;
    x.rank = rank;
    // The sending side, the same for both exchanges: this rank's rows along the `out` table.
    x.src = m.src;
    x.src_rows = m.src_rows;
    x.segments = t.get<kernels::EpSegment>(m.out, slot);
    x.prefix = t.get<int64_t>(m.out_prefix, slot);
    x.max_rows = m.out_rows;
    if (!send_recv()) {
      x.dst = t.peers(m.dst, m.dst_slot);
      x.zero_ranges = t.get<int64_t>(m.zero, slot);
      x.zero_count = m.zero_count;
      x.local_dst = t.get(m.dst, m.dst_slot);
      x.link = t.get<uint32_t>(ep::kEpoch);
      kernels::launch_ep_exchange(x, stream);
      barrier(t, error, stream);
      return;
    }
    x.chunk_rows = chunk_rows;
    x.mode = kernels::EpRowsMode::kPack;
    x.local_dst = t.get(ep::kChunksOut);
    kernels::launch_ep_exchange(x, stream);
    comm->all_to_all(t.get(ep::kChunksOut), t.get(m.chunks_in), static_cast<std::size_t>(chunk_rows) * row_bytes,
                     error, stream);
    // The receiving side: each source's chunk unpacked along the `in` table.
    x.mode = kernels::EpRowsMode::kUnpack;
    x.src = t.get(m.chunks_in);
    x.src_rows = nullptr;
    x.segments = t.get<kernels::EpSegment>(m.in, slot);
    x.prefix = t.get<int64_t>(m.in_prefix, slot);
    x.max_rows = m.in_rows;
    x.zero_ranges = t.get<int64_t>(m.zero, slot);
    x.zero_count = m.zero_count;
    x.local_dst = t.get(m.dst, m.dst_slot);
    kernels::launch_ep_exchange(x, stream);
  }

  // What both operators declare for the exchange: the staging of send/recv, or the barrier's flags.
  void declare(TensorTable& t) const {
    const auto step = Lifetime::kStep;
    const auto window = Placement::kWindow;
    if (!send_recv()) {
      t.declare(ep::kFlags, checked_mul(ep::kFlags, ranks, sizeof(uint32_t)), step, window);
      t.declare(ep::kEpoch, sizeof(uint32_t), step, window);
      return;
    }
    const std::size_t chunks = checked_mul("send/recv chunks", ranks, chunk_rows, row_bytes);
    t.declare(ep::kCountChunks, checked_mul(ep::kCountChunks, ranks, count_stride, sizeof(int32_t)), step);
    t.declare(ep::kChunksOut, chunks, step);
    t.declare(ep::kChunksInA, chunks, step, window);
    t.declare(ep::kChunksInB, chunks, step, window);
  }
};

// `comm` is null when sizing only (LayerProgram checked it against the options otherwise).
EpLink link_of(const MoeLayerOptions& o, EpComm* comm) {
  EpLink l;
  l.ranks = o.expert_parallel;
  l.experts = o.experts;
  l.exchange = o.ep_exchange;
  l.chunk_rows = o.ep_exchange == EpExchange::kSendRecv ? moe_ep_chunk_rows(o) : 0;
  // send/recv chunks are multiples of 16 bytes
  l.count_stride = o.ep_exchange == EpExchange::kSendRecv ? checked_align_up("counts row", o.experts + 1, 4)
                                                          : o.experts + 1;
  l.row_bytes = checked_mul("row bytes", o.hidden, dtype_size(o.dtype));
  l.comm = comm;
  if (comm != nullptr) {
    l.rank = comm->rank();
    l.timeout_ns = comm->barrier_timeout_ns();
  }
  return l;
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
    t.declare(ep::kMatrix, checked_mul(ep::kMatrix, r, link_.count_stride, sizeof(int32_t)), saved, window);
    link_.declare(t);
    // Buffers rows are moved into: peers store into them (windows), or this rank unpacks into them.
    const Placement moved = link_.send_recv() ? Placement::kWorkspace : window;
    // The receive buffer: FC1's input in forward, FC2's output gradient in backward (the combine
    // names it so); the two uses never overlap (a phase's barrier lies between them).
    t.declare(tensor::kPermutedX, checked_mul(tensor::kPermutedX, recv_rows_, row), step, moved);
    if (!training) return;
    t.declare(ep::kSend, checked_mul(ep::kSend, local_rows_, row), step);
    t.declare(tensor::kDTopkWeights, checked_mul(tensor::kDTopkWeights, tk, k, sizeof(float)), step);
    t.declare(ep::kReturned, checked_mul(ep::kReturned, local_rows_, row), step, moved);
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

    link_.share_counts(t, s, d.counts, tokens, records_.error(), stream);
    kernels::EpPlanParams plan;
    plan.matrix = t.get<int32_t>(ep::kMatrix, s);
    plan.rank = link_.rank, plan.ranks = link_.ranks, plan.experts = o_.experts, plan.row_align = o_.row_align;
    plan.max_tokens = o_.max_tokens;
    plan.local_rows = local_rows_;
    plan.recv_rows = recv_rows_;
    plan.chunk_rows = link_.chunk_rows;
    plan.matrix_stride = link_.count_stride;
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
    // The rows leave straight from x (gathered along token_of_row): no sorted copy in between.
    RowMove m;
    m.src = p.io->x;
    m.src_rows = d.token_of_row;
    m.dst = tensor::kPermutedX;
    m.out = ep::kToOwner, m.out_prefix = ep::kToOwnerPrefix, m.in = ep::kToSource, m.in_prefix = ep::kToSourcePrefix;
    m.zero = ep::kRecvGaps, m.zero_count = local_experts_;
    m.out_rows = local_rows_, m.in_rows = recv_rows_;
    m.chunks_in = ep::kChunksInA;
    link_.move(t, s, m, records_.error(), stream);
  }

  void backward(const Phase& p, cudaStream_t stream) override {
    const TensorTable& t = *p.tensors;
    MG_CHECK(p.io->dx != nullptr && p.io->dy != nullptr, "backward needs MoeLayerIO::dy and dx");
    const int s = p.slot;
    RowMove m;
    m.src = t.get(tensor::grad(tensor::kPermutedX));
    m.dst = ep::kReturned;
    m.out = ep::kToSource, m.out_prefix = ep::kToSourcePrefix, m.in = ep::kToOwner, m.in_prefix = ep::kToOwnerPrefix;
    m.zero = ep::kDroppedRows, m.zero_count = o_.experts;
    m.out_rows = recv_rows_, m.in_rows = local_rows_;
    m.chunks_in = ep::kChunksInB;
    link_.move(t, s, m, records_.error(), stream);
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
        comm_(std::move(comm)),
        link_(link_of(o, comm_.get())),
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
    t.declare(ep::kCombineIn, checked_mul(ep::kCombineIn, local_rows_, row), Lifetime::kSaved,
              link_.send_recv() ? Placement::kWorkspace : Placement::kWindow);
    if (!training) return;
    t.alias(tensor::grad(spec_.in), tensor::kPermutedX);
    t.declare(tensor::kDRowWeight, checked_mul(tensor::kDRowWeight, local_rows_, sizeof(float)), Lifetime::kStep);
  }

  void bind(TensorTable&) override {
    error_ = DeviceBuffer(sizeof(DeviceErrorRecord));
    zero_now(error_.get(), sizeof(DeviceErrorRecord));
  }

  void forward(const Phase& p, cudaStream_t stream) override {
    const TensorTable& t = *p.tensors;
    MG_CHECK(p.io->y != nullptr, "MoeLayerIO needs y");
    const int s = p.slot;
    RowMove m;
    m.src = t.get(spec_.in, s);
    m.dst = ep::kCombineIn, m.dst_slot = s;
    m.out = ep::kToSource, m.out_prefix = ep::kToSourcePrefix, m.in = ep::kToOwner, m.in_prefix = ep::kToOwnerPrefix;
    m.zero = ep::kDroppedRows, m.zero_count = o_.experts;
    m.out_rows = recv_rows_, m.in_rows = local_rows_;
    m.chunks_in = ep::kChunksInB;
    link_.move(t, s, m, error_.as<DeviceErrorRecord>(), stream);
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
    RowMove m;
    m.src = t.get(ep::kSend);
    m.dst = tensor::grad(spec_.in);
    m.out = ep::kToOwner, m.out_prefix = ep::kToOwnerPrefix, m.in = ep::kToSource, m.in_prefix = ep::kToSourcePrefix;
    m.zero = ep::kRecvGaps, m.zero_count = local_experts_;
    m.out_rows = local_rows_, m.in_rows = recv_rows_;
    m.chunks_in = ep::kChunksInA;
    link_.move(t, s, m, error_.as<DeviceErrorRecord>(), stream);
  }

  DeviceErrorRecord take_device_error() override { return take_device_error_record(error_); }

 private:
  OpSpec spec_;
  MoeLayerOptions o_;
  std::shared_ptr<EpComm> comm_;
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
