#include "moegraph/moegraph.h"

#include <exception>
#include <memory>
#include <string>

#include "moegraph/error.hpp"
#include "moegraph/grouped_linear.hpp"

struct mg_grouped_linear {
  std::unique_ptr<moegraph::GroupedLinear> op;
};

namespace {

thread_local std::string g_last_error;

mg_status status_of(moegraph::ErrorKind kind) {
  switch (kind) {
    case moegraph::ErrorKind::kInvalidArgument: return MG_ERR_INVALID_ARGUMENT;
    case moegraph::ErrorKind::kCuda: return MG_ERR_CUDA;
    case moegraph::ErrorKind::kLibrary: return MG_ERR_LIBRARY;
    case moegraph::ErrorKind::kDeviceSplits: return MG_ERR_DEVICE_SPLITS;
  }
  return MG_ERR_INTERNAL;
}

template <class F>
mg_status guarded(F&& f) noexcept {
  try {
    f();
    g_last_error.clear();
    return MG_OK;
  } catch (const moegraph::Error& e) {
    g_last_error = e.what();
    return status_of(e.kind());
  } catch (const std::exception& e) {
    g_last_error = e.what();
    return MG_ERR_INTERNAL;
  } catch (...) {
    g_last_error = "unknown exception";
    return MG_ERR_INTERNAL;
  }
}

moegraph::GroupedLinear& unwrap(mg_grouped_linear* op) {
  MG_CHECK(op != nullptr && op->op != nullptr, "null mg_grouped_linear handle");
  return *op->op;
}

}  // namespace

extern "C" {

void mg_grouped_linear_options_init(mg_grouped_linear_options* o) {
  if (o == nullptr) return;
  *o = mg_grouped_linear_options{};
  o->row_align = 1;
  o->dtype = MG_DTYPE_BF16;
  o->wgrad_slots = 1;
}

mg_status mg_grouped_linear_create(const mg_grouped_linear_options* o, mg_grouped_linear** out) {
  return guarded([&] {
    MG_CHECK(o != nullptr && out != nullptr, "mg_grouped_linear_create needs options and an output handle");
    *out = nullptr;
    moegraph::GroupedLinearOptions opts;
    opts.num_groups = o->num_groups;
    opts.in_features = o->in_features;
    opts.out_features = o->out_features;
    opts.capacity_rows = o->capacity_rows;
    opts.row_align = o->row_align;
    MG_CHECK(o->dtype == MG_DTYPE_BF16 || o->dtype == MG_DTYPE_FP16, "dtype must be MG_DTYPE_BF16 or MG_DTYPE_FP16, got ",
             static_cast<int>(o->dtype));
    opts.dtype = o->dtype == MG_DTYPE_FP16 ? moegraph::DType::kFP16 : moegraph::DType::kBF16;
    opts.bias = o->bias != 0;
    opts.wgrad_slots = o->wgrad_slots;
    opts.delay_wgrad = o->delay_wgrad != 0;
    moegraph::validate(opts);  // before any CUDA call, so bad options fail the same with or without a GPU
    auto handle = std::make_unique<mg_grouped_linear>();
    handle->op = std::make_unique<moegraph::GroupedLinear>(opts);
    *out = handle.release();
  });
}

void mg_grouped_linear_destroy(mg_grouped_linear* op) { delete op; }

mg_status mg_grouped_linear_forward(mg_grouped_linear* op, const mg_forward_args* a, int train, cudaStream_t stream) {
  return guarded([&] {
    MG_CHECK(a != nullptr, "null forward args");
    moegraph::ForwardArgs args{a->x, a->splits, a->weight, a->bias, a->bias_scale, a->y};
    if (train) unwrap(op).forward_train(args, stream);
    else unwrap(op).forward(args, stream);
  });
}

mg_status mg_grouped_linear_backward(mg_grouped_linear* op, const mg_backward_args* a, int delay_wgrad,
                                     cudaStream_t stream) {
  return guarded([&] {
    MG_CHECK(a != nullptr, "null backward args");
    moegraph::BackwardArgs args{a->dy, a->weight, a->bias, a->dx, a->dbias, a->dbias_scale, a->dweight, a->main_grad};
    unwrap(op).backward(args, moegraph::Recipe::kBF16,
                        delay_wgrad ? moegraph::WgradMode::kDelayed : moegraph::WgradMode::kImmediate, stream);
  });
}

mg_status mg_grouped_linear_backward_dw(mg_grouped_linear* op, cudaStream_t stream) {
  return guarded([&] { unwrap(op).backward_dw(stream); });
}

mg_status mg_grouped_linear_check_device_errors(mg_grouped_linear* op, cudaStream_t stream) {
  return guarded([&] { unwrap(op).check_device_errors(stream); });
}

const char* mg_last_error(void) { return g_last_error.c_str(); }

}  // extern "C"
