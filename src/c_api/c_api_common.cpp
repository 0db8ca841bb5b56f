#include "src/c_api/c_api_common.hpp"

#include <exception>
#include <initializer_list>
#include <iterator>
#include <mutex>
#include <unordered_map>

#include "moegraph/config.hpp"
#include "moegraph/version.h"

namespace moegraph::c_api {

// The earlier releases' layouts (on LP64): where each grown struct's appended fields begin. A field
// inserted before them, rather than appended, would move these and break older callers.
template <class T>
constexpr bool ends_are(std::initializer_list<std::size_t> earlier) {
  constexpr const auto& ends = Releases<T>::ends;
  if (std::size(ends) != earlier.size() + 1 || ends[earlier.size()] != sizeof(T)) return false;
  std::size_t i = 0;
  for (std::size_t e : earlier)
    if (sizeof(void*) == 8 && ends[i++] != e) return false;
  return true;
}
static_assert(ends_are<mg_grouped_linear_options>({64, 72, 80}), "mg_grouped_linear_options: fields may only be appended");
static_assert(ends_are<mg_forward_args>({64, 96, 112}), "mg_forward_args: fields may only be appended");
static_assert(ends_are<mg_backward_args>({72, 104, 120}), "mg_backward_args: fields may only be appended");
static_assert(ends_are<mg_moe_layer_options>({108, 120, 124, 136}),
              "mg_moe_layer_options: fields may only be appended");
static_assert(ends_are<mg_moe_layer_weights>({112, 176, 208}), "mg_moe_layer_weights: fields may only be appended");
static_assert(ends_are<mg_config_shape>({72, 76, 80, 88}), "mg_config_shape: fields may only be appended");
static_assert(ends_are<mg_step_weights>({112, 176, 208}), "mg_step_weights: fields may only be appended");
static_assert(ends_are<mg_step_graphs_options>({16, 24}), "mg_step_graphs_options: fields may only be appended");

namespace {

thread_local std::string g_last_error;

mg_status status_of(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument: return MG_ERR_INVALID_ARGUMENT;
    case ErrorKind::kCuda: return MG_ERR_CUDA;
    case ErrorKind::kLibrary: return MG_ERR_LIBRARY;
    case ErrorKind::kDeviceSplits: return MG_ERR_DEVICE_SPLITS;
    case ErrorKind::kNoDevice: return MG_ERR_NO_DEVICE;
    case ErrorKind::kUnsupportedDevice: return MG_ERR_UNSUPPORTED_DEVICE;
  }
  return MG_ERR_INTERNAL;
}

struct Registry {
  std::mutex mutex;
  std::unordered_map<const void*, HandleKind> live;
};
Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: handles may be destroyed during exit
  return *r;
}

}  // namespace

mg_status guarded_status(void (*f)(void*), void* context) noexcept {
  try {
    f(context);
    g_last_error.clear();
    return MG_OK;
  } catch (const ConfigError& e) {
    g_last_error = e.what();
    return MG_ERR_CONFIG;
  } catch (const Error& e) {
    g_last_error = e.what();
    return status_of(e.kind());
  } catch (const InvalidHandle& e) {
    g_last_error = e.what();
    return MG_ERR_INVALID_HANDLE;
  } catch (const std::exception& e) {
    g_last_error = e.what();
    return MG_ERR_INTERNAL;
  } catch (...) {
    g_last_error = "unknown exception";
    return MG_ERR_INTERNAL;
  }
}

void register_handle(const void* handle, HandleKind kind) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.live[handle] = kind;
}

bool unregister_handle(const void* handle, HandleKind kind) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.live.find(handle);
  if (it == r.live.end() || it->second != kind) return false;
  r.live.erase(it);
  return true;
}

void check_handle(const void* handle, HandleKind kind, const char* type) {
  if (handle == nullptr) throw InvalidHandle(std::string("null ") + type + " handle");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.live.find(handle);
  if (it == r.live.end() || it->second != kind)
    throw InvalidHandle(std::string(type) + " handle that is not live (destroyed, or never created)");
}

DType dtype_of(mg_dtype dtype) {
  MG_CHECK(dtype == MG_DTYPE_BF16 || dtype == MG_DTYPE_FP16, "dtype must be MG_DTYPE_BF16 or MG_DTYPE_FP16, got ",
           static_cast<int>(dtype));
  return dtype == MG_DTYPE_FP16 ? DType::kFP16 : DType::kBF16;
}

Recipe recipe_of(mg_recipe recipe) {
  MG_CHECK(recipe == MG_RECIPE_BF16 || recipe == MG_RECIPE_MXFP8,
           "recipe must be MG_RECIPE_BF16 or MG_RECIPE_MXFP8, got ", static_cast<int>(recipe));
  return recipe == MG_RECIPE_MXFP8 ? Recipe::kMXFP8 : Recipe::kBF16;
}

mg_dtype c_dtype(DType dtype) { return dtype == DType::kFP16 ? MG_DTYPE_FP16 : MG_DTYPE_BF16; }
mg_recipe c_recipe(Recipe recipe) { return recipe == Recipe::kMXFP8 ? MG_RECIPE_MXFP8 : MG_RECIPE_BF16; }

}  // namespace moegraph::c_api

extern "C" {

const char* mg_status_string(mg_status status) {
  switch (status) {
    case MG_OK: return "success";
    case MG_ERR_INVALID_ARGUMENT: return "invalid argument";
    case MG_ERR_CUDA: return "CUDA runtime error";
    case MG_ERR_LIBRARY: return "cuBLASLt or NCCL error";
    case MG_ERR_DEVICE_SPLITS: return "invalid device inputs (splits or token count)";
    case MG_ERR_INTERNAL: return "internal error";
    case MG_ERR_NO_DEVICE: return "no usable CUDA device";
    case MG_ERR_UNSUPPORTED_DEVICE: return "unsupported device (compute capability 9.0 needed)";
    case MG_ERR_CONFIG: return "config refused";
    case MG_ERR_INVALID_HANDLE: return "invalid handle (null or destroyed)";
  }
  return "unknown status";
}

const char* mg_last_error(void) { return moegraph::c_api::g_last_error.c_str(); }

int mg_version(void) { return MOEGRAPH_VERSION; }

}  // extern "C"
