// The C ABI of the operators: mg_grouped_linear_* and mg_moe_layer_*, and the MXFP8 weights they
// read when the caller gives them (mg_mxfp8_weight_bytes, mg_quantize_mxfp8_weights).
#include <cstdint>
#include <memory>
#include <type_traits>

#include "moegraph/error.hpp"
#include "moegraph/expert_parallel.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/moe_layer.hpp"
#include "moegraph/moegraph.h"
#include "moegraph/mxfp8_weights.hpp"
#include "src/c_api/c_api_common.hpp"

struct mg_grouped_linear {
  std::unique_ptr<moegraph::GroupedLinear> op;
};

struct mg_moe_layer {
  std::shared_ptr<moegraph::EpComm> comm;  // expert parallelism: kept alive with the layer (declared first, freed last)
  std::unique_ptr<moegraph::MoeLayer> layer;
};

namespace {

using moegraph::c_api::check_handle;
using moegraph::c_api::dtype_of;
using moegraph::c_api::guarded;
using moegraph::c_api::init_struct;
using moegraph::c_api::HandleKind;
using moegraph::c_api::read_struct;
using moegraph::c_api::recipe_of;

moegraph::GroupedLinear& unwrap(mg_grouped_linear* op) {
  check_handle(op, HandleKind::kGroupedLinear, "mg_grouped_linear");
  return *op->op;
}

moegraph::MoeLayer& unwrap(mg_moe_layer* layer) {
  check_handle(layer, HandleKind::kMoeLayer, "mg_moe_layer");
  return *layer->layer;
}

// The conversions copy each numeric field into a C++ field of the same type, so validate() sees the
// caller's exact value: nothing is narrowed or wrapped before the range checks run.
#define MG_SAME_FIELD_TYPE(c_options, cpp_options, field)                                         \
  static_assert(std::is_same_v<decltype(c_options::field), decltype(moegraph::cpp_options::field)>, \
                #c_options "::" #field " must have the type of its C++ field")
MG_SAME_FIELD_TYPE(mg_grouped_linear_options, GroupedLinearOptions, num_groups);
MG_SAME_FIELD_TYPE(mg_grouped_linear_options, GroupedLinearOptions, in_features);
MG_SAME_FIELD_TYPE(mg_grouped_linear_options, GroupedLinearOptions, out_features);
MG_SAME_FIELD_TYPE(mg_grouped_linear_options, GroupedLinearOptions, capacity_rows);
MG_SAME_FIELD_TYPE(mg_grouped_linear_options, GroupedLinearOptions, row_align);
MG_SAME_FIELD_TYPE(mg_grouped_linear_options, GroupedLinearOptions, wgrad_slots);
MG_SAME_FIELD_TYPE(mg_moe_layer_options, MoeLayerOptions, experts);
MG_SAME_FIELD_TYPE(mg_moe_layer_options, MoeLayerOptions, hidden);
MG_SAME_FIELD_TYPE(mg_moe_layer_options, MoeLayerOptions, ffn);
MG_SAME_FIELD_TYPE(mg_moe_layer_options, MoeLayerOptions, top_k);
MG_SAME_FIELD_TYPE(mg_moe_layer_options, MoeLayerOptions, aux_loss_coef);
MG_SAME_FIELD_TYPE(mg_moe_layer_options, MoeLayerOptions, capacity_factor);
MG_SAME_FIELD_TYPE(mg_moe_layer_options, MoeLayerOptions, max_tokens);
MG_SAME_FIELD_TYPE(mg_moe_layer_options, MoeLayerOptions, row_align);
MG_SAME_FIELD_TYPE(mg_moe_layer_options, MoeLayerOptions, wgrad_slots);
MG_SAME_FIELD_TYPE(mg_moe_layer_options, MoeLayerOptions, expert_parallel);
MG_SAME_FIELD_TYPE(mg_moe_layer_options, MoeLayerOptions, ep_recv_rows);
MG_SAME_FIELD_TYPE(mg_moe_layer_options, MoeLayerOptions, ep_chunk_rows);
#undef MG_SAME_FIELD_TYPE

mg_grouped_linear_options default_linear_options() {
  mg_grouped_linear_options o{};
  o.struct_size = sizeof(o);
  o.row_align = 1;
  o.dtype = MG_DTYPE_BF16;
  o.wgrad_slots = 1;
  o.prequantized_weights = 0;
  o.dequantized_weights = 0;
  return o;
}

mg_moe_layer_options default_moe_options() {
  mg_moe_layer_options o{};
  o.struct_size = sizeof(o);
  o.top_k = 1;
  o.score = MG_ROUTER_SOFTMAX;
  o.row_align = 1;
  o.dtype = MG_DTYPE_BF16;
  o.training = 1;
  o.wgrad_slots = 1;
  o.main_grad_fp32 = 1;
  o.expert_parallel = 1;
  o.ep_recv_rows = 0;
  o.prequantized_weights = 0;
  o.ep_exchange = MG_EP_PEER_STORES;
  o.ep_chunk_rows = 0;
  o.dequantized_weights = 0;
  return o;
}

// Converts and validates (before any CUDA call, so bad options fail the same with or without a GPU).
moegraph::GroupedLinearOptions linear_options_of(const mg_grouped_linear_options* in) {
  const mg_grouped_linear_options o = read_struct(in, "mg_grouped_linear_options", default_linear_options());
  moegraph::GroupedLinearOptions opts;
  opts.num_groups = o.num_groups;
  opts.in_features = o.in_features;
  opts.out_features = o.out_features;
  opts.capacity_rows = o.capacity_rows;
  opts.row_align = o.row_align;
  opts.dtype = dtype_of(o.dtype);
  opts.bias = o.bias != 0;
  opts.wgrad_slots = o.wgrad_slots;
  opts.delay_wgrad = o.delay_wgrad != 0;
  opts.recipe = recipe_of(o.recipe);
  opts.prequantized_weights = o.prequantized_weights != 0;
  opts.dequantized_weights = o.dequantized_weights != 0;
  opts.forward_only = o.forward_only != 0;
  moegraph::validate(opts);
  return opts;
}

// Converts and validates (before any CUDA call, so bad options fail the same with or without a GPU).
moegraph::MoeLayerOptions moe_options_of(const mg_moe_layer_options* in) {
  const mg_moe_layer_options o = read_struct(in, "mg_moe_layer_options", default_moe_options());
  moegraph::MoeLayerOptions opts;
  opts.experts = o.experts;
  opts.hidden = o.hidden;
  opts.ffn = o.ffn;
  opts.top_k = o.top_k;
  opts.bias = o.bias != 0;
  MG_CHECK(o.score == MG_ROUTER_SOFTMAX || o.score == MG_ROUTER_SIGMOID,
           "score must be MG_ROUTER_SOFTMAX or MG_ROUTER_SIGMOID, got ", static_cast<int>(o.score));
  opts.score = o.score == MG_ROUTER_SIGMOID ? moegraph::RouterScore::kSigmoid : moegraph::RouterScore::kSoftmax;
  opts.renormalize = o.renormalize != 0;
  opts.aux_loss_coef = o.aux_loss_coef;
  opts.capacity_factor = o.capacity_factor;
  opts.fuse_weights = o.fuse_weights != 0;
  opts.max_tokens = o.max_tokens;
  opts.row_align = o.row_align;
  opts.dtype = dtype_of(o.dtype);
  opts.training = o.training != 0;
  opts.wgrad_slots = o.wgrad_slots;
  opts.delay_wgrad = o.delay_wgrad != 0;
  opts.main_grad_fp32 = o.main_grad_fp32 != 0;
  opts.recipe = recipe_of(o.recipe);
  // 0 is the zeroed struct's value of the appended field: no expert parallelism, as 1.
  opts.expert_parallel = o.expert_parallel == 0 ? 1 : o.expert_parallel;
  opts.ep_recv_rows = o.ep_recv_rows;
  opts.prequantized_weights = o.prequantized_weights != 0;
  MG_CHECK(o.ep_exchange == MG_EP_PEER_STORES || o.ep_exchange == MG_EP_SEND_RECV,
           "ep_exchange must be MG_EP_PEER_STORES or MG_EP_SEND_RECV, got ", static_cast<int>(o.ep_exchange));
  opts.ep_exchange = o.ep_exchange == MG_EP_SEND_RECV ? moegraph::EpExchange::kSendRecv
                                                      : moegraph::EpExchange::kPeerStores;
  opts.ep_chunk_rows = o.ep_chunk_rows;
  opts.dequantized_weights = o.dequantized_weights != 0;
  moegraph::validate(opts);
  return opts;
}

// The C structs hold the arrays of moegraph::Mxfp8Weights as fields of their own (moegraph.h says
// why). The operators only read them: the C++ struct's pointers are not const because the
// quantizer writes through the same struct.
moegraph::Mxfp8Weights mxfp8_of(const uint8_t* data, const uint8_t* scales, const uint8_t* data_t,
                                const uint8_t* scales_t, const void* dequantized, const void* dequantized_t,
                                const uint8_t* scales_tiled, const uint8_t* scales_t_tiled) {
  return {const_cast<uint8_t*>(data),         const_cast<uint8_t*>(scales),        const_cast<uint8_t*>(data_t),
          const_cast<uint8_t*>(scales_t),     const_cast<void*>(dequantized),      const_cast<void*>(dequantized_t),
          const_cast<uint8_t*>(scales_tiled), const_cast<uint8_t*>(scales_t_tiled)};
}

moegraph::MoeLayerWeights layer_weights_of(const mg_moe_layer_weights* in) {
  const mg_moe_layer_weights w = read_struct(in, "mg_moe_layer_weights", mg_moe_layer_weights{});
  moegraph::MoeLayerWeights weights;
  weights.router = w.router;
  weights.w1 = w.w1;
  weights.b1 = w.b1;
  weights.w2 = w.w2;
  weights.b2 = w.b2;
  weights.main_grad_router = w.main_grad_router;
  weights.main_grad1 = w.main_grad1;
  weights.main_grad2 = w.main_grad2;
  weights.d_router = w.d_router;
  weights.dw1 = w.dw1;
  weights.dw2 = w.dw2;
  weights.db1 = w.db1;
  weights.db2 = w.db2;
  weights.w1_mxfp8 = mxfp8_of(w.w1_mxfp8_data, w.w1_mxfp8_scales, w.w1_mxfp8_data_t, w.w1_mxfp8_scales_t,
                              w.w1_mxfp8_dequantized, w.w1_mxfp8_dequantized_t, w.w1_mxfp8_scales_tiled,
                              w.w1_mxfp8_scales_t_tiled);
  weights.w2_mxfp8 = mxfp8_of(w.w2_mxfp8_data, w.w2_mxfp8_scales, w.w2_mxfp8_data_t, w.w2_mxfp8_scales_t,
                              w.w2_mxfp8_dequantized, w.w2_mxfp8_dequantized_t, w.w2_mxfp8_scales_tiled,
                              w.w2_mxfp8_scales_t_tiled);
  return weights;
}

// mg_moe_layer_create and mg_moe_layer_create_ep (`call` names the entry point in messages; `ep`:
// the caller may pass a communicator).
mg_status create_layer(const char* call, bool ep, const mg_moe_layer_options* o, const mg_moe_layer_weights* in,
                       void* workspace, mg_ep_comm* comm, mg_moe_layer** out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, call, " needs an output handle");
    *out = nullptr;
    // The options, the weights struct and the communicator are refused before the layer looks for a
    // device, so bad ones fail the same with or without a GPU.
    const moegraph::MoeLayerOptions opts = moe_options_of(o);
    // Sizing validates the options; doing it first makes a bad shape fail with the same message as
    // mg_moe_layer_workspace_bytes, whatever the communicator.
    (void)moegraph::MoeLayer::workspace_bytes(opts);
    const moegraph::MoeLayerWeights weights = layer_weights_of(in);
    const int ranks = opts.expert_parallel;
    MG_CHECK(ep || ranks == 1, call, ": expert_parallel = ", ranks,
             " needs this rank's communicator: create the layer with mg_moe_layer_create_ep");
    std::shared_ptr<moegraph::EpComm> shared;
    if (comm != nullptr) {
      shared = moegraph::c_api::ep_comm_of(comm);
      MG_CHECK(shared->ranks() == ranks, call, ": comm has ", shared->ranks(), " ranks but expert_parallel is ",
               ranks);
    }
    MG_CHECK(ranks == 1 || shared != nullptr, call, ": expert_parallel = ", ranks,
             " needs this rank's communicator, got comm NULL (mg_ep_comm_create_nccl, ...)");
    auto handle = std::make_unique<mg_moe_layer>();
    if (ranks > 1) handle->comm = shared;  // a group of one has nothing to exchange: the layer runs alone
    handle->layer = std::make_unique<moegraph::MoeLayer>(opts, weights, workspace, handle->comm);
    moegraph::c_api::register_handle(handle.get(), HandleKind::kMoeLayer);
    *out = handle.release();
  });
}

moegraph::MoeLayerIO io_of(const mg_moe_layer_io* in) {
  const mg_moe_layer_io io = read_struct(in, "mg_moe_layer_io", mg_moe_layer_io{});
  return moegraph::MoeLayerIO{io.x, io.num_tokens, io.y, io.aux_loss, io.dy, io.dx};
}

}  // namespace

extern "C" {

// The name in parentheses: moegraph.h also defines it as a macro that calls the sized form.
void(mg_grouped_linear_options_init)(mg_grouped_linear_options* o) {
  if (o != nullptr) *o = default_linear_options();
}

mg_status mg_grouped_linear_options_init_sized(mg_grouped_linear_options* o, size_t struct_size) {
  return guarded([&] { init_struct(o, struct_size, "mg_grouped_linear_options", default_linear_options()); });
}

mg_status mg_grouped_linear_workspace_bytes(const mg_grouped_linear_options* o, size_t* out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_grouped_linear_workspace_bytes needs an output");
    *out = 0;
    *out = moegraph::GroupedLinear::workspace_bytes(linear_options_of(o));
  });
}

mg_status mg_grouped_linear_create(const mg_grouped_linear_options* o, void* workspace, mg_grouped_linear** out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_grouped_linear_create needs an output handle");
    *out = nullptr;
    const moegraph::GroupedLinearOptions opts = linear_options_of(o);
    auto handle = std::make_unique<mg_grouped_linear>();
    // Sizes its workspace (refusing one past the layout maximum) before it looks for a device.
    handle->op = workspace != nullptr ? std::make_unique<moegraph::GroupedLinear>(opts, workspace)
                                      : std::make_unique<moegraph::GroupedLinear>(opts);
    moegraph::c_api::register_handle(handle.get(), HandleKind::kGroupedLinear);
    *out = handle.release();
  });
}

void mg_grouped_linear_destroy(mg_grouped_linear* op) {
  if (moegraph::c_api::unregister_handle(op, HandleKind::kGroupedLinear)) delete op;
}

mg_status mg_grouped_linear_forward(mg_grouped_linear* op, const mg_forward_args* in, int train, cudaStream_t stream) {
  return guarded([&] {
    moegraph::GroupedLinear& l = unwrap(op);
    const mg_forward_args a = read_struct(in, "mg_forward_args", mg_forward_args{});
    const moegraph::Mxfp8Weights mxfp8 =
        mxfp8_of(a.mxfp8_data, a.mxfp8_scales, a.mxfp8_data_t, a.mxfp8_scales_t, a.mxfp8_dequantized,
                 a.mxfp8_dequantized_t, a.mxfp8_scales_tiled, a.mxfp8_scales_t_tiled);
    moegraph::ForwardArgs args{a.x, a.splits, a.weight, a.bias, a.bias_scale, a.y, a.offsets, mxfp8};
    if (train) l.forward_train(args, stream);
    else l.forward(args, stream);
  });
}

mg_status mg_grouped_linear_backward(mg_grouped_linear* op, const mg_backward_args* in, int delay_wgrad,
                                     cudaStream_t stream) {
  return guarded([&] {
    moegraph::GroupedLinear& l = unwrap(op);
    const mg_backward_args a = read_struct(in, "mg_backward_args", mg_backward_args{});
    const moegraph::Mxfp8Weights mxfp8 =
        mxfp8_of(a.mxfp8_data, a.mxfp8_scales, a.mxfp8_data_t, a.mxfp8_scales_t, a.mxfp8_dequantized,
                 a.mxfp8_dequantized_t, a.mxfp8_scales_tiled, a.mxfp8_scales_t_tiled);
    moegraph::BackwardArgs args{a.dy, a.weight, a.bias, a.dx, a.dbias, a.dbias_scale, a.dweight, a.main_grad, mxfp8};
    l.backward(args, delay_wgrad ? moegraph::WgradMode::kDelayed : moegraph::WgradMode::kImmediate, stream);
  });
}

mg_status mg_grouped_linear_backward_dw(mg_grouped_linear* op, cudaStream_t stream) {
  return guarded([&] { unwrap(op).backward_dw(stream); });
}

mg_status mg_grouped_linear_weights_changed(mg_grouped_linear* op, const void* weight, cudaStream_t stream) {
  return guarded([&] { unwrap(op).weights_changed(weight, stream); });
}

mg_status mg_grouped_linear_check_device_errors(mg_grouped_linear* op, cudaStream_t stream) {
  return guarded([&] { unwrap(op).check_device_errors(stream); });
}

void(mg_moe_layer_options_init)(mg_moe_layer_options* o) {
  if (o != nullptr) *o = default_moe_options();
}

mg_status mg_moe_layer_options_init_sized(mg_moe_layer_options* o, size_t struct_size) {
  return guarded([&] { init_struct(o, struct_size, "mg_moe_layer_options", default_moe_options()); });
}

mg_status mg_moe_layer_create(const mg_moe_layer_options* o, const mg_moe_layer_weights* in, void* workspace,
                              mg_moe_layer** out) {
  return create_layer("mg_moe_layer_create", /*ep=*/false, o, in, workspace, nullptr, out);
}

mg_status mg_moe_layer_create_ep(const mg_moe_layer_options* o, const mg_moe_layer_weights* in, void* workspace,
                                 mg_ep_comm* comm, mg_moe_layer** out) {
  return create_layer("mg_moe_layer_create_ep", /*ep=*/true, o, in, workspace, comm, out);
}

mg_status mg_moe_layer_workspace_bytes(const mg_moe_layer_options* o, size_t* out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_moe_layer_workspace_bytes needs an output");
    *out = 0;
    *out = moegraph::MoeLayer::workspace_bytes(moe_options_of(o));
  });
}

mg_status mg_moe_layer_window_bytes(const mg_moe_layer_options* o, size_t* out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_moe_layer_window_bytes needs an output");
    *out = 0;
    *out = moegraph::MoeLayer::window_bytes(moe_options_of(o));
  });
}

void mg_moe_layer_destroy(mg_moe_layer* layer) {
  if (moegraph::c_api::unregister_handle(layer, HandleKind::kMoeLayer)) delete layer;
}

mg_status mg_moe_layer_forward(mg_moe_layer* layer, const mg_moe_layer_io* io, int train, cudaStream_t stream) {
  return guarded([&] {
    moegraph::MoeLayer& l = unwrap(layer);
    const moegraph::MoeLayerIO args = io_of(io);
    if (train) l.forward_train(args, stream);
    else l.forward(args, stream);
  });
}

mg_status mg_moe_layer_backward(mg_moe_layer* layer, const mg_moe_layer_io* io, cudaStream_t stream) {
  return guarded([&] {
    moegraph::MoeLayer& l = unwrap(layer);
    l.backward(io_of(io), stream);
  });
}

mg_status mg_moe_layer_weights_changed(mg_moe_layer* layer, cudaStream_t stream) {
  return guarded([&] { unwrap(layer).weights_changed(stream); });
}

mg_status mg_moe_layer_set_weights(mg_moe_layer* layer, const mg_moe_layer_weights* weights) {
  return guarded([&] {
    moegraph::MoeLayer& l = unwrap(layer);
    MG_CHECK(weights != nullptr, "mg_moe_layer_set_weights: weights is null");
    l.set_weights(layer_weights_of(weights));
  });
}

mg_status mg_moe_layer_backward_dw(mg_moe_layer* layer, cudaStream_t stream) {
  return guarded([&] { unwrap(layer).backward_dw(stream); });
}

mg_status mg_moe_layer_read_dropped(mg_moe_layer* layer, cudaStream_t stream, uint64_t* out) {
  return guarded([&] {
    MG_CHECK(out != nullptr, "mg_moe_layer_read_dropped needs an output");
    *out = 0;
    *out = unwrap(layer).read_dropped(stream);
  });
}

mg_status mg_moe_layer_check_device_errors(mg_moe_layer* layer, cudaStream_t stream) {
  return guarded([&] { unwrap(layer).check_device_errors(stream); });
}

mg_status mg_mxfp8_weight_bytes(int groups, int64_t n, int64_t k, size_t* data_bytes, size_t* scale_bytes) {
  return guarded([&] {
    // Both are 0 on any failure, the missing-output one included (the header's contract).
    if (data_bytes != nullptr) *data_bytes = 0;
    if (scale_bytes != nullptr) *scale_bytes = 0;
    MG_CHECK(data_bytes != nullptr && scale_bytes != nullptr,
             "mg_mxfp8_weight_bytes needs both outputs (data_bytes and scale_bytes)");
    const std::size_t data = moegraph::mxfp8_weight_data_bytes(groups, n, k);
    *scale_bytes = moegraph::mxfp8_weight_scale_bytes(groups, n, k);
    *data_bytes = data;
  });
}

mg_status mg_quantize_mxfp8_weights(mg_dtype dtype, const void* w, int groups, int64_t n, int64_t k, uint8_t* data,
                                    uint8_t* scales, uint8_t* data_t, uint8_t* scales_t, cudaStream_t stream) {
  // The C++ quantizer checks every argument before it launches; only the enum is the ABI's own.
  return guarded([&] {
    moegraph::quantize_mxfp8_weights(dtype_of(dtype), w, groups, n, k, {data, scales, data_t, scales_t}, stream);
  });
}

mg_status mg_dequantize_mxfp8_weights(int groups, int64_t n, int64_t k, const uint8_t* data, const uint8_t* scales,
                                      const uint8_t* data_t, const uint8_t* scales_t, void* values, void* values_t,
                                      cudaStream_t stream) {
  return guarded([&] {
    moegraph::dequantize_mxfp8_weights(
        groups, n, k, mxfp8_of(data, scales, data_t, scales_t, values, values_t, nullptr, nullptr), stream);
  });
}

mg_status mg_mxfp8_tiled_scale_bytes(int groups, int64_t n, int64_t k, size_t* bytes) {
  return guarded([&] {
    if (bytes != nullptr) *bytes = 0;  // 0 on any failure (the header's contract)
    MG_CHECK(bytes != nullptr, "mg_mxfp8_tiled_scale_bytes needs its output (bytes)");
    *bytes = moegraph::mxfp8_tiled_scale_bytes(groups, n, k);
  });
}

mg_status mg_tile_mxfp8_weight_scales(int groups, int64_t n, int64_t k, const uint8_t* data, const uint8_t* scales,
                                      const uint8_t* data_t, const uint8_t* scales_t, uint8_t* tiled,
                                      uint8_t* tiled_t, cudaStream_t stream) {
  return guarded([&] {
    moegraph::tile_mxfp8_weight_scales(
        groups, n, k, mxfp8_of(data, scales, data_t, scales_t, nullptr, nullptr, tiled, tiled_t), stream);
  });
}

}  // extern "C"
