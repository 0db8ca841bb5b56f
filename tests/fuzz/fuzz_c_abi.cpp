// libFuzzer target: the C ABI's option handling, on every path that never reaches a GPU.
// Input: one selector byte, then raw bytes laid over an option struct filled with its defaults
// (mg_*_options_init) after its struct_size, so short inputs change only the first fields.
//   selector bit 0 clear: mg_moe_layer_workspace_bytes. MG_OK must give the C++ API's size, and the
//     workspace's named buffers must be 256-byte aligned, in order, disjoint and inside that size
//     (a wrapped size computation shows up here), and so must the expert-parallel window's
//     (mg_moe_layer_window_bytes); otherwise MG_ERR_INVALID_ARGUMENT with a message, and
//     mg_moe_layer_create, mg_moe_layer_create_ep and mg_moe_layer_window_bytes must refuse the same
//     options with the same message.
//   selector bit 0 set: mg_grouped_linear_create has no size query and allocates on the GPU for valid
//     options, so the options are first converted as the ABI documents and checked with the C++ API
//     (validate, then the workspace size, which refuses layouts too large). Refused ones go through
//     mg_grouped_linear_create, which must refuse them with the same message before touching a GPU;
//     accepted ones only get the no-GPU queries (workspace buffers, the kernel choice).
//   selector bit 2 (instead of the options): the MXFP8 weight calls on sizes, a dtype and pointers
//     from the input. mg_mxfp8_weight_bytes must give the C++ sizes or refuse with the C++ message;
//     mg_quantize_mxfp8_weights is never given a usable w (NULL or odd), so it must refuse every
//     input before any GPU use, with the C++ quantizer's message (the ABI's own for a dtype outside
//     mg_dtype).
//   selector bit 1: also the null-pointer calls, which must be refused, not crash.
// The enum fields take any int32: moegraph.h's enums span every int32, so any value a C caller
// stores is defined and must be refused by name (UBSan's enum check holds the ABI to that).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "moegraph/error.hpp"
#include "moegraph/grouped_linear.hpp"
#include "moegraph/moe_layer.hpp"
#include "moegraph/moegraph.h"
#include "moegraph/mxfp8_weights.hpp"
#include "tests/fuzz/fuzz_common.hpp"

namespace {

using moegraph::fuzz::finding;

// Handles a refusing create must overwrite: never dereferenced, only compared with null.
mg_grouped_linear* const kNotNullOp = reinterpret_cast<mg_grouped_linear*>(alignof(std::max_align_t));
mg_moe_layer* const kNotNullLayer = reinterpret_cast<mg_moe_layer*>(alignof(std::max_align_t));

template <class Options>
Options overlay(const uint8_t* data, size_t size, void (*init)(Options*)) {
  static_assert(std::is_trivially_copyable_v<Options>);
  Options o;
  init(&o);
  // The bytes go over the fields after struct_size: a wrong size is refused before any field is
  // read, so fuzzing it would only hide the fields (the size checks have host tests of their own).
  constexpr std::size_t skip = sizeof(o.struct_size);
  const std::size_t n = size < sizeof(o) - skip ? size : sizeof(o) - skip;
  std::memcpy(reinterpret_cast<unsigned char*>(&o) + skip, data, n);
  return o;
}

template <class Buffer>
void check_layout(const char* what, const std::vector<Buffer>& buffers, std::size_t total) {
  std::size_t end = 0;
  for (const Buffer& b : buffers) {
    const bool ok = b.offset % 256 == 0 && b.offset >= end && b.offset <= total && b.bytes <= total - b.offset;
    if (!ok)
      finding(std::string(what) + ": buffer \"" + b.name + "\" at " + std::to_string(b.offset) + " of " +
              std::to_string(b.bytes) + " bytes does not fit the workspace of " + std::to_string(total) +
              " bytes after the previous buffer's end " + std::to_string(end));
    end = b.offset + b.bytes;
  }
}

void expect_refused(mg_status status, const char* call, mg_status expected = MG_ERR_INVALID_ARGUMENT) {
  if (status != expected)
    finding(std::string(call) + " returned " + std::to_string(status) + " instead of " + mg_status_string(expected));
  if (mg_last_error()[0] == '\0') finding(std::string(call) + " refused without a message");
}

moegraph::MoeLayerOptions cpp_options(const mg_moe_layer_options& o) {
  moegraph::MoeLayerOptions c;
  c.experts = o.experts;
  c.hidden = o.hidden;
  c.ffn = o.ffn;
  c.top_k = o.top_k;
  c.bias = o.bias != 0;
  c.score = o.score == MG_ROUTER_SIGMOID ? moegraph::RouterScore::kSigmoid : moegraph::RouterScore::kSoftmax;
  c.renormalize = o.renormalize != 0;
  c.aux_loss_coef = o.aux_loss_coef;
  c.capacity_factor = o.capacity_factor;
  c.fuse_weights = o.fuse_weights != 0;
  c.max_tokens = o.max_tokens;
  c.row_align = o.row_align;
  c.dtype = o.dtype == MG_DTYPE_FP16 ? moegraph::DType::kFP16 : moegraph::DType::kBF16;
  c.training = o.training != 0;
  c.wgrad_slots = o.wgrad_slots;
  c.delay_wgrad = o.delay_wgrad != 0;
  c.main_grad_fp32 = o.main_grad_fp32 != 0;
  c.recipe = o.recipe == MG_RECIPE_MXFP8 ? moegraph::Recipe::kMXFP8 : moegraph::Recipe::kBF16;
  c.expert_parallel = o.expert_parallel == 0 ? 1 : o.expert_parallel;  // 0: the zeroed field's default
  c.ep_recv_rows = o.ep_recv_rows;
  c.prequantized_weights = o.prequantized_weights != 0;
  c.ep_exchange = o.ep_exchange == MG_EP_SEND_RECV ? moegraph::EpExchange::kSendRecv
                                                   : moegraph::EpExchange::kPeerStores;
  c.ep_chunk_rows = o.ep_chunk_rows;
  c.dequantized_weights = o.dequantized_weights != 0;
  return c;
}

void fuzz_moe_layer(const uint8_t* data, size_t size) {
  mg_moe_layer_options o = overlay(data, size, mg_moe_layer_options_init);
  std::size_t bytes = 1;
  const mg_status status = mg_moe_layer_workspace_bytes(&o, &bytes);
  if (status != MG_OK) {
    expect_refused(status, "mg_moe_layer_workspace_bytes");
    if (bytes != 0) finding("mg_moe_layer_workspace_bytes refused but left a size");
    // mg_moe_layer_create validates and sizes the same way before it looks for a device.
    const std::string expected = mg_last_error();
    mg_moe_layer_weights weights{};
  weights.struct_size = sizeof(weights);
    mg_moe_layer* layer = kNotNullLayer;  // a refusal must overwrite it with null
    const mg_status created = mg_moe_layer_create(&o, &weights, nullptr, &layer);
    if (created == MG_OK) mg_moe_layer_destroy(layer);
    expect_refused(created, "mg_moe_layer_create");
    if (layer != nullptr) finding("mg_moe_layer_create refused but left a handle");
    if (expected != mg_last_error())
      finding("mg_moe_layer_create and mg_moe_layer_workspace_bytes disagree: " + expected + " vs " + mg_last_error());
    layer = kNotNullLayer;
    const mg_status created_ep = mg_moe_layer_create_ep(&o, &weights, nullptr, nullptr, &layer);
    if (created_ep == MG_OK) mg_moe_layer_destroy(layer);
    expect_refused(created_ep, "mg_moe_layer_create_ep");
    if (layer != nullptr) finding("mg_moe_layer_create_ep refused but left a handle");
    if (expected != mg_last_error())
      finding("mg_moe_layer_create_ep and mg_moe_layer_workspace_bytes disagree: " + expected + " vs " +
              mg_last_error());
    std::size_t window = 1;
    expect_refused(mg_moe_layer_window_bytes(&o, &window), "mg_moe_layer_window_bytes");
    if (window != 0) finding("mg_moe_layer_window_bytes refused but left a size");
    if (expected != mg_last_error())
      finding("mg_moe_layer_window_bytes and mg_moe_layer_workspace_bytes disagree: " + expected + " vs " +
              mg_last_error());
    return;
  }
  if (mg_last_error()[0] != '\0') finding("mg_moe_layer_workspace_bytes succeeded but left an error message");
  const moegraph::MoeLayerOptions c = cpp_options(o);
  if (moegraph::MoeLayer::workspace_bytes(c) != bytes) finding("C ABI and C++ workspace sizes differ");
  check_layout("moe layer", moegraph::MoeLayer::workspace_buffers(c), bytes);
  std::size_t window = 1;
  if (mg_moe_layer_window_bytes(&o, &window) != MG_OK)
    finding(std::string("mg_moe_layer_window_bytes refused options the workspace query took: ") + mg_last_error());
  if (moegraph::MoeLayer::window_bytes(c) != window) finding("C ABI and C++ window sizes differ");
  if ((c.expert_parallel > 1) != (window > 0)) finding("a window exactly with expert parallelism");
  check_layout("moe layer window", moegraph::MoeLayer::window_buffers(c), window);
  if (c.expert_parallel > 1) {
    // Valid options, no communicator: refused before any device is looked for.
    mg_moe_layer_weights weights{};
    weights.struct_size = sizeof(weights);
    mg_moe_layer* layer = kNotNullLayer;
    const mg_status created = mg_moe_layer_create_ep(&o, &weights, nullptr, nullptr, &layer);
    if (created == MG_OK) mg_moe_layer_destroy(layer);
    expect_refused(created, "mg_moe_layer_create_ep(expert_parallel > 1, comm NULL)");
    if (layer != nullptr) finding("mg_moe_layer_create_ep refused but left a handle");
  }
}

void fuzz_grouped_linear(const uint8_t* data, size_t size) {
  mg_grouped_linear_options o = overlay(data, size, mg_grouped_linear_options_init);
  // An enum value outside its enumerators has no C++ counterpart: the ABI must refuse it by name
  // while converting, before validating anything else or touching a GPU.
  const bool bad_dtype = o.dtype != MG_DTYPE_BF16 && o.dtype != MG_DTYPE_FP16;
  const bool bad_recipe = o.recipe != MG_RECIPE_BF16 && o.recipe != MG_RECIPE_MXFP8;
  if (bad_dtype || bad_recipe) {
    mg_grouped_linear* op = kNotNullOp;
    const mg_status status = mg_grouped_linear_create(&o, nullptr, &op);
    if (status == MG_OK) mg_grouped_linear_destroy(op);
    expect_refused(status, "mg_grouped_linear_create(enum out of range)");
    const std::string message = mg_last_error();
    if (message.find(bad_dtype ? "dtype must be MG_DTYPE_BF16 or MG_DTYPE_FP16" : "recipe must be MG_RECIPE_BF16") ==
        std::string::npos)
      finding("an out-of-range enum was refused for another reason: " + message);
    return;
  }
  moegraph::GroupedLinearOptions c;
  c.num_groups = o.num_groups;
  c.in_features = o.in_features;
  c.out_features = o.out_features;
  c.capacity_rows = o.capacity_rows;
  c.row_align = o.row_align;
  c.dtype = o.dtype == MG_DTYPE_FP16 ? moegraph::DType::kFP16 : moegraph::DType::kBF16;
  c.bias = o.bias != 0;
  c.wgrad_slots = o.wgrad_slots;
  c.delay_wgrad = o.delay_wgrad != 0;
  c.recipe = o.recipe == MG_RECIPE_MXFP8 ? moegraph::Recipe::kMXFP8 : moegraph::Recipe::kBF16;
  c.prequantized_weights = o.prequantized_weights != 0;
  c.dequantized_weights = o.dequantized_weights != 0;
  c.forward_only = o.forward_only != 0;
  // The C++ API refuses bad options in validate() and layouts too large to size in workspace_bytes().
  std::size_t bytes = 0;
  try {
    moegraph::validate(c);
    bytes = moegraph::GroupedLinear::workspace_bytes(c);
  } catch (const moegraph::Error& e) {
    if (e.kind() != moegraph::ErrorKind::kInvalidArgument) finding(std::string("refused, not as invalid: ") + e.what());
    // The ABI sizes before it looks for a device, so these are refused without touching a GPU.
    const std::string expected = e.what();
    mg_grouped_linear* op = kNotNullOp;  // a refusal must overwrite it with null
    const mg_status status = mg_grouped_linear_create(&o, nullptr, &op);
    if (status == MG_OK) mg_grouped_linear_destroy(op);
    expect_refused(status, "mg_grouped_linear_create");
    if (op != nullptr) finding("mg_grouped_linear_create refused but left a handle");
    if (expected != mg_last_error())
      finding("mg_grouped_linear_create and the C++ API disagree: " + expected + " vs " + mg_last_error());
    return;
  }
  check_layout("grouped linear", moegraph::GroupedLinear::workspace_buffers(c), bytes);
  if (moegraph::GroupedLinear::describe_kernels(c).empty()) finding("describe_kernels gave nothing");
}

// The message a C++ call throws, or "" when it returns.
template <class F>
std::string cpp_error(F&& f) {
  try {
    f();
  } catch (const moegraph::Error& e) {
    return e.what();
  }
  return "";
}

void fuzz_mxfp8_weights(const uint8_t* data, size_t size) {
  struct Args {
    int32_t dtype = MG_DTYPE_BF16;
    int32_t groups = 1;
    int64_t n = 32, k = 32;
    uint64_t w = 0;        // 0: NULL, else made odd: never a usable device pointer
    uint32_t outputs = 0;  // bits 0-3: data, scales, data_t, scales_t given; bits 4-7: that one off by a byte
  } a;
  static_assert(std::is_trivially_copyable_v<Args>);
  std::memcpy(static_cast<void*>(&a), data, std::min(size, sizeof a));

  std::size_t data_bytes = 1, scale_bytes = 1, cpp_data = 0, cpp_scales = 0;
  const mg_status status = mg_mxfp8_weight_bytes(a.groups, a.n, a.k, &data_bytes, &scale_bytes);
  const std::string sizes_refused = cpp_error([&] {
    cpp_data = moegraph::mxfp8_weight_data_bytes(a.groups, a.n, a.k);
    cpp_scales = moegraph::mxfp8_weight_scale_bytes(a.groups, a.n, a.k);
  });
  if (sizes_refused.empty()) {
    if (status != MG_OK)
      finding(std::string("mg_mxfp8_weight_bytes refused sizes the C++ API takes: ") + mg_last_error());
    if (data_bytes != cpp_data || scale_bytes != cpp_scales) finding("C ABI and C++ MXFP8 weight sizes differ");
    if (scale_bytes * 32 != data_bytes) finding("MXFP8 weights: not one scale byte per 32 data bytes");
  } else {
    expect_refused(status, "mg_mxfp8_weight_bytes");
    if (data_bytes != 0 || scale_bytes != 0) finding("mg_mxfp8_weight_bytes refused but left a size");
    if (sizes_refused != mg_last_error())
      finding("mg_mxfp8_weight_bytes and the C++ API disagree: " + sizes_refused + " vs " + mg_last_error());
  }
  // The tiled scales' size: the same shapes taken and refused, with the C++ words.
  std::size_t tiled_bytes = 1, cpp_tiled = 0;
  const mg_status tiled_status = mg_mxfp8_tiled_scale_bytes(a.groups, a.n, a.k, &tiled_bytes);
  const std::string tiled_refused = cpp_error([&] { cpp_tiled = moegraph::mxfp8_tiled_scale_bytes(a.groups, a.n, a.k); });
  if (tiled_refused.empty() != sizes_refused.empty()) finding("the tiled scales' sizes refuse other shapes");
  if (tiled_refused.empty()) {
    if (tiled_status != MG_OK || tiled_bytes != cpp_tiled) finding("C ABI and C++ tiled scale sizes differ");
  } else {
    expect_refused(tiled_status, "mg_mxfp8_tiled_scale_bytes");
    if (tiled_bytes != 0) finding("mg_mxfp8_tiled_scale_bytes refused but left a size");
    if (tiled_refused != mg_last_error())
      finding("mg_mxfp8_tiled_scale_bytes and the C++ API disagree: " + tiled_refused + " vs " + mg_last_error());
  }

  alignas(16) static uint8_t fake[4][32];  // never read: every call below is refused before a launch
  uint8_t* out[4] = {};
  for (int i = 0; i < 4; ++i)
    if (a.outputs >> i & 1) out[i] = fake[i] + (a.outputs >> (4 + i) & 1);
  const void* w = a.w == 0 ? nullptr : reinterpret_cast<const void*>(static_cast<std::uintptr_t>(a.w | 1));
  const auto dtype = static_cast<mg_dtype>(a.dtype);
  const mg_status quantized =
      mg_quantize_mxfp8_weights(dtype, w, a.groups, a.n, a.k, out[0], out[1], out[2], out[3], nullptr);
  expect_refused(quantized, "mg_quantize_mxfp8_weights(no usable w)");
  if (dtype != MG_DTYPE_BF16 && dtype != MG_DTYPE_FP16) {
    if (std::string(mg_last_error()).find("dtype must be MG_DTYPE_BF16 or MG_DTYPE_FP16") == std::string::npos)
      finding(std::string("an out-of-range dtype was refused for another reason: ") + mg_last_error());
    return;
  }
  const moegraph::DType cpp_dtype = dtype == MG_DTYPE_FP16 ? moegraph::DType::kFP16 : moegraph::DType::kBF16;
  const std::string expected = cpp_error([&] {
    moegraph::quantize_mxfp8_weights(cpp_dtype, w, a.groups, a.n, a.k, {out[0], out[1], out[2], out[3]}, nullptr);
  });
  if (expected.empty()) finding("quantize_mxfp8_weights took a w that is no device pointer");
  if (expected != mg_last_error())
    finding("mg_quantize_mxfp8_weights and the C++ API disagree: " + expected + " vs " + mg_last_error());
}

void null_arguments() {
  (mg_moe_layer_options_init)(nullptr);
  (mg_grouped_linear_options_init)(nullptr);
  expect_refused(mg_moe_layer_options_init_sized(nullptr, sizeof(mg_moe_layer_options)), "mg_moe_layer_options_init_sized(null)");
  expect_refused(mg_grouped_linear_options_init_sized(nullptr, sizeof(mg_grouped_linear_options)),
                 "mg_grouped_linear_options_init_sized(null)");
  mg_moe_layer_options mo;
  mg_moe_layer_options_init(&mo);
  std::size_t bytes = 0;
  expect_refused(mg_moe_layer_workspace_bytes(nullptr, &bytes), "mg_moe_layer_workspace_bytes(null options)");
  expect_refused(mg_moe_layer_workspace_bytes(&mo, nullptr), "mg_moe_layer_workspace_bytes(null output)");
  mg_grouped_linear* op = nullptr;
  expect_refused(mg_grouped_linear_create(nullptr, nullptr, &op), "mg_grouped_linear_create(null options)");
  mg_moe_layer* layer = nullptr;
  expect_refused(mg_moe_layer_create(nullptr, nullptr, nullptr, &layer), "mg_moe_layer_create(null options)");
  expect_refused(mg_moe_layer_forward(nullptr, nullptr, 1, nullptr), "mg_moe_layer_forward(null layer)",
                 MG_ERR_INVALID_HANDLE);
  expect_refused(mg_grouped_linear_backward_dw(nullptr, nullptr), "mg_grouped_linear_backward_dw(null op)",
                 MG_ERR_INVALID_HANDLE);
  expect_refused(mg_moe_layer_window_bytes(nullptr, &bytes), "mg_moe_layer_window_bytes(null options)");
  expect_refused(mg_moe_layer_window_bytes(&mo, nullptr), "mg_moe_layer_window_bytes(null output)");
  expect_refused(mg_moe_layer_create_ep(nullptr, nullptr, nullptr, nullptr, &layer),
                 "mg_moe_layer_create_ep(null options)");
  expect_refused(mg_nccl_unique_id(nullptr, 0), "mg_nccl_unique_id(null output)");
  mg_ep_comm* comm = nullptr;
  expect_refused(mg_ep_comm_create_nccl(0, 0, nullptr, &comm), "mg_ep_comm_create_nccl(no ranks)");
  expect_refused(mg_ep_comm_wrap_nccl(nullptr, &comm), "mg_ep_comm_wrap_nccl(null communicator)");
  expect_refused(mg_ep_emulated_group_create(1, nullptr), "mg_ep_emulated_group_create(null array)");
  int rank = 0;
  expect_refused(mg_ep_comm_rank(nullptr, &rank), "mg_ep_comm_rank(null comm)", MG_ERR_INVALID_HANDLE);
  expect_refused(mg_ep_comm_wait(nullptr, nullptr, 0, &rank), "mg_ep_comm_wait(null comm)", MG_ERR_INVALID_HANDLE);
  expect_refused(mg_ep_comm_abort(nullptr), "mg_ep_comm_abort(null comm)", MG_ERR_INVALID_HANDLE);
  mg_ep_comm_destroy(nullptr);
  std::size_t scales = 0;
  expect_refused(mg_mxfp8_weight_bytes(1, 32, 32, nullptr, nullptr), "mg_mxfp8_weight_bytes(null outputs)");
  expect_refused(mg_mxfp8_weight_bytes(1, 32, 32, &bytes, nullptr), "mg_mxfp8_weight_bytes(null scale output)");
  expect_refused(mg_mxfp8_weight_bytes(1, 32, 32, nullptr, &scales), "mg_mxfp8_weight_bytes(null data output)");
  expect_refused(mg_quantize_mxfp8_weights(MG_DTYPE_BF16, nullptr, 1, 32, 32, nullptr, nullptr, nullptr, nullptr,
                                           nullptr),
                 "mg_quantize_mxfp8_weights(null everything)");
  expect_refused(mg_mxfp8_tiled_scale_bytes(1, 32, 32, nullptr), "mg_mxfp8_tiled_scale_bytes(null output)");
  expect_refused(mg_tile_mxfp8_weight_scales(1, 32, 32, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr),
                 "mg_tile_mxfp8_weight_scales(null everything)");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t selector = data[0];
  moegraph::fuzz::expect_only<moegraph::fuzz::NothingExpected>("C ABI", [&] {
    if (selector & 2) null_arguments();
    if (selector & 4) fuzz_mxfp8_weights(data + 1, size - 1);
    else if (selector & 1) fuzz_grouped_linear(data + 1, size - 1);
    else fuzz_moe_layer(data + 1, size - 1);
  });
  return 0;
}
