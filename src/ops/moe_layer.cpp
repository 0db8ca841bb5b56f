#include "moegraph/moe_layer.hpp"

#include <algorithm>
#include <cmath>

#include "moegraph/config.hpp"
#include "moegraph/error.hpp"
#include "moegraph/expert_parallel.hpp"
#include "moegraph/grouped_linear.hpp"
#include "src/core/checked.hpp"
#include "src/core/layout.hpp"
#include "src/ops/moe/layer_program.hpp"
#include "src/ops/moe/op_spec.hpp"

namespace moegraph {

MoeLayerOptions moe_layer_options(const Config& c, int64_t max_tokens) {
  MoeLayerOptions o;
  o.experts = c.layer.experts;
  o.hidden = c.layer.hidden;
  o.ffn = c.layer.ffn;
  o.top_k = c.layer.top_k;
  o.bias = c.layer.bias;
  o.score = c.router.score;
  o.renormalize = c.router.renormalize;
  o.aux_loss_coef = c.router.aux_loss_coef;
  o.capacity_factor = c.router.capacity_factor;
  o.fuse_weights = c.router.fuse_weights;
  o.max_tokens = max_tokens;
  o.row_align = c.row_align;
  o.dtype = c.precision.dtype;
  o.recipe = c.precision.recipe;
  o.prequantized_weights = c.precision.prequantized_weights;
  o.dequantized_weights = c.precision.dequantized_weights;
  o.training = c.training.enabled;
  o.wgrad_slots = c.training.wgrad_slots;
  o.delay_wgrad = c.training.enabled && c.training.delay_wgrad;
  o.main_grad_fp32 = c.training.main_grad_fp32;
  o.expert_parallel = c.parallel.expert_parallel;
  o.ep_recv_rows = c.parallel.recv_rows;
  o.ep_exchange = c.parallel.exchange;
  o.ep_chunk_rows = c.parallel.chunk_rows;
  return o;
}

void validate(const MoeLayerOptions& o) {
  MG_CHECK(o.experts >= 1 && o.experts <= kMaxGroups, "experts must be in [1, ", kMaxGroups, "], got ", o.experts);
  MG_CHECK(o.hidden >= 16 && o.hidden % 16 == 0, "hidden must be a positive multiple of 16, got ", o.hidden);
  MG_CHECK(o.hidden <= kMaxLayerWidth, "hidden must be at most ", kMaxLayerWidth, ", got ", o.hidden);
  MG_CHECK(o.ffn >= 16 && o.ffn % 16 == 0, "ffn must be a positive multiple of 16, got ", o.ffn);
  MG_CHECK(o.ffn <= kMaxLayerWidth, "ffn must be at most ", kMaxLayerWidth, ", got ", o.ffn);
  MG_CHECK(o.top_k >= 1 && o.top_k <= 8 && o.top_k <= o.experts, "top_k must be in [1, min(8, experts = ", o.experts,
           ")], got ", o.top_k);
  MG_CHECK(o.score == RouterScore::kSoftmax || o.score == RouterScore::kSigmoid,
           "score: unknown value ", static_cast<int>(o.score), " (softmax or sigmoid)");
  MG_CHECK(std::isfinite(o.aux_loss_coef) && o.aux_loss_coef >= 0, "aux_loss_coef must be finite and >= 0, got ",
           o.aux_loss_coef);
  MG_CHECK(std::isfinite(o.capacity_factor) && o.capacity_factor >= 0,
           "capacity_factor must be 0 (dropless) or a finite positive factor, got ", o.capacity_factor);
  MG_CHECK(o.max_tokens >= 1 && o.max_tokens <= kMaxLayerTokens, "max_tokens must be in [1, 2^24], got ",
           o.max_tokens);
  MG_CHECK(o.row_align == 1 || o.row_align == 16 || o.row_align == 32 || o.row_align == 128,
           "row_align must be 1, 16, 32 or 128, got ", o.row_align);
  MG_CHECK(o.dtype == DType::kBF16 || o.dtype == DType::kFP16, "dtype must be bf16 or fp16, got ", dtype_name(o.dtype));
  MG_CHECK(o.wgrad_slots >= 1 && o.wgrad_slots <= 64, "wgrad_slots must be in [1, 64], got ", o.wgrad_slots);
  MG_CHECK(!o.delay_wgrad || o.training, "delay_wgrad needs training");
  MG_CHECK(!o.prequantized_weights || o.recipe == Recipe::kMXFP8,
           "prequantized_weights needs the mxfp8 recipe (the weights it reads are MXFP8), got recipe ",
           recipe_name(o.recipe));
  MG_CHECK(!o.dequantized_weights || (o.recipe == Recipe::kMXFP8 && o.dtype == DType::kBF16),
           "dequantized_weights needs the mxfp8 recipe with bf16 activations, got recipe ", recipe_name(o.recipe),
           " and dtype ", dtype_name(o.dtype));
  const int64_t rows = moe_layer_rows(o);
  MG_CHECK(rows <= kMaxCapacityRows, "max_tokens * top_k (plus alignment padding) = ", rows,
           " rows must stay below 2^31");
  MG_CHECK(o.expert_parallel >= 1 && o.expert_parallel <= kMaxExpertParallel, "expert_parallel must be in [1, ",
           kMaxExpertParallel, "], got ", o.expert_parallel);
  MG_CHECK(o.experts % o.expert_parallel == 0, "experts (", o.experts, ") must be divisible by expert_parallel (",
           o.expert_parallel, ")");
  MG_CHECK(o.ep_recv_rows >= 0, "ep_recv_rows must be 0 (the worst case) or a positive bound, got ", o.ep_recv_rows);
  if (o.expert_parallel > 1) {
    MG_CHECK(o.capacity_factor == 0.0, "capacity_factor is not supported with expert_parallel > 1 yet (got ",
             o.capacity_factor, "): bound the receive buffers with ep_recv_rows instead");
    MG_CHECK(!o.fuse_weights, "fuse_weights is not supported with expert_parallel > 1 yet");
    const int64_t worst = moe_ep_worst_case_rows(o);
    MG_CHECK(worst <= kMaxCapacityRows, "expert_parallel * max_tokens * top_k (plus alignment padding) = ", worst,
             " receive rows must stay below 2^31");
    // A bound at or above the worst case drops nothing and sizes nothing past it (moe_expert_rows):
    // one bound may serve buckets of every size.
    MG_CHECK(o.ep_recv_rows % o.row_align == 0, "ep_recv_rows must be a multiple of row_align (", o.row_align,
             "), got ", o.ep_recv_rows);
  } else {
    MG_CHECK(o.ep_recv_rows == 0, "ep_recv_rows needs expert_parallel > 1, got ", o.ep_recv_rows);
  }
  MG_CHECK(o.ep_exchange == EpExchange::kPeerStores || o.ep_exchange == EpExchange::kSendRecv,
           "ep_exchange: unknown value ", static_cast<int>(o.ep_exchange));
  MG_CHECK(o.ep_exchange == EpExchange::kPeerStores || o.expert_parallel > 1,
           "ep_exchange send_recv needs expert_parallel > 1");
  MG_CHECK(o.ep_chunk_rows == 0 || o.ep_exchange == EpExchange::kSendRecv,
           "ep_chunk_rows needs ep_exchange send_recv, got ", o.ep_chunk_rows);
  MG_CHECK(o.ep_chunk_rows >= 0, "ep_chunk_rows must be 0 (the worst case) or a positive bound, got ",
           o.ep_chunk_rows);
  // Each field is bounded above, so these products are exact; what they may not pass is one layout.
  // The widest row buffer is FC1's output (2 * ffn) or the rows of x (hidden), and FC1 has the
  // largest weights; every other buffer is smaller.
  const std::size_t es = dtype_size(o.dtype), max_bytes = LayoutWalker::kMaxBytes;
  const int64_t expert_rows = moe_expert_rows(o), widest = std::max<int64_t>(2 * o.ffn, o.hidden);
  const std::size_t row_buffer = checked_mul("the widest row buffer's bytes", expert_rows, widest, es);
  MG_CHECK(row_buffer <= max_bytes, "rows * max(2 * ffn, hidden) * ", es, " bytes (the widest row buffer) must be at "
           "most ", max_bytes, ", got ", expert_rows, " * ", widest, " * ", es, " = ", row_buffer);
  const std::size_t main_grad = checked_mul("fc1 main_grad bytes", o.experts, 2, o.ffn, o.hidden, 4);
  MG_CHECK(main_grad <= max_bytes, "experts * 2 * ffn * hidden * 4 bytes (fc1's fp32 main_grad) must be at most ",
           max_bytes, ", got ", o.experts, " * 2 * ", o.ffn, " * ", o.hidden, " * 4 = ", main_grad);
  // The recipe's shape rules, on the two grouped linears it will build.
  for (int layer : {1, 2}) {
    const std::string reason = layer::expert_recipe_refusal(o, layer, expert_rows);
    MG_CHECK(reason.empty(), "fc", layer, " (hidden ", o.hidden, ", ffn ", o.ffn, "): ", reason);
  }
}

int64_t moe_layer_rows(const MoeLayerOptions& o) {
  MG_CHECK(o.row_align >= 1, "row_align must be 1, 16, 32 or 128, got ", o.row_align);
  const int64_t align = o.row_align;
  // Checked: callers may ask before validate() has bounded max_tokens.
  const int64_t assigned = checked_mul("rows (max_tokens * top_k)", o.max_tokens, o.top_k);
  const int64_t padding = checked_mul("rows (alignment padding)", o.experts, align - 1);
  return checked_align_up("rows", checked_add("rows", assigned, padding), align);
}

int moe_local_experts(const MoeLayerOptions& o) {
  MG_CHECK(o.expert_parallel >= 1 && o.experts % o.expert_parallel == 0, "experts (", o.experts,
           ") must be divisible by expert_parallel (", o.expert_parallel, ")");
  return o.experts / o.expert_parallel;
}

int64_t moe_ep_chunk_rows(const MoeLayerOptions& o) {
  const int64_t local = checked_mul("chunk rows (max_tokens * top_k)", o.max_tokens, o.top_k);
  MG_CHECK(o.ep_chunk_rows >= 0, "ep_chunk_rows must be 0 (the worst case) or a positive bound, got ",
           o.ep_chunk_rows);
  return o.ep_chunk_rows > 0 ? std::min(o.ep_chunk_rows, local) : local;
}

int64_t moe_ep_worst_case_rows(const MoeLayerOptions& o) {
  const int64_t align = o.row_align;
  // What one source can send to one rank: all its rows, or one chunk of the send/recv exchange.
  const int64_t per_source = o.ep_exchange == EpExchange::kSendRecv ? moe_ep_chunk_rows(o)
                                                                     : checked_mul("receive rows (max_tokens * top_k)",
                                                                                   o.max_tokens, o.top_k);
  const int64_t assigned = checked_mul("receive rows (ranks * rows per source)", o.expert_parallel, per_source);
  const int64_t padding = checked_mul("receive rows (alignment padding)", moe_local_experts(o), align - 1);
  return checked_align_up("receive rows", checked_add("receive rows", assigned, padding), align);
}

int64_t moe_expert_rows(const MoeLayerOptions& o) {
  if (o.expert_parallel <= 1) return moe_layer_rows(o);
  const int64_t worst = moe_ep_worst_case_rows(o);
  return o.ep_recv_rows > 0 ? std::min(o.ep_recv_rows, worst) : worst;
}

MoeLayer::MoeLayer(const MoeLayerOptions& options, const MoeLayerWeights& weights, void* workspace,
                   std::shared_ptr<EpComm> comm)
    : options_(options),
      program_(std::make_unique<layer::LayerProgram>(options, weights, workspace, std::move(comm))) {}

MoeLayer::~MoeLayer() = default;

std::size_t MoeLayer::workspace_bytes(const MoeLayerOptions& options) {
  return layer::LayerProgram(options).workspace_bytes();
}

std::vector<MoeLayer::WorkspaceBuffer> MoeLayer::workspace_buffers(const MoeLayerOptions& options) {
  const layer::LayerProgram sizing(options);  // named: a range-for would not keep a temporary alive
  std::vector<WorkspaceBuffer> out;
  for (const auto& e : sizing.buffers()) out.push_back({e.name, e.offset, e.bytes});
  return out;
}

std::size_t MoeLayer::window_bytes(const MoeLayerOptions& options) {
  return layer::LayerProgram(options).window_bytes();
}

std::vector<MoeLayer::WorkspaceBuffer> MoeLayer::window_buffers(const MoeLayerOptions& options) {
  const layer::LayerProgram sizing(options);
  std::vector<WorkspaceBuffer> out;
  for (const auto& e : sizing.window_entries()) out.push_back({e.name, e.offset, e.bytes});
  return out;
}

std::string MoeLayer::describe() const { return program_->describe(); }
void MoeLayer::forward(const MoeLayerIO& io, cudaStream_t stream) { program_->forward(io, stream); }
void MoeLayer::forward_train(const MoeLayerIO& io, cudaStream_t stream) { program_->forward_train(io, stream); }
void MoeLayer::backward(const MoeLayerIO& io, cudaStream_t stream) { program_->backward(io, stream); }
void MoeLayer::backward_dw(cudaStream_t stream) { program_->backward_dw(stream); }
void MoeLayer::weights_changed(cudaStream_t stream) { program_->weights_changed(stream); }
void MoeLayer::set_weights(const MoeLayerWeights& weights) { program_->set_weights(weights); }
int MoeLayer::queued_wgrads() const { return program_->queued_wgrads(); }
int MoeLayer::pending_backwards() const { return program_->pending_backwards(); }
const int32_t* MoeLayer::splits() const { return program_->splits(); }
const int64_t* MoeLayer::offsets() const { return program_->offsets(); }
uint64_t MoeLayer::read_dropped(cudaStream_t stream) { return program_->read_dropped(stream); }
void MoeLayer::check_device_errors(cudaStream_t stream) { program_->check_device_errors(stream); }

}  // namespace moegraph
