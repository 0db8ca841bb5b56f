// What every C ABI entry point shares: the exception-to-status guard, the live-handle registry, and
// the reading and writing of size-prefixed structs (moegraph.h's conventions).
#pragma once

#include <array>
#include <cstddef>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "moegraph/error.hpp"
#include "moegraph/moegraph.h"
#include "moegraph/types.hpp"

namespace moegraph {
class EpComm;  // moegraph/expert_parallel.hpp
}

namespace moegraph::c_api {

// A null, destroyed or mistyped handle (MG_ERR_INVALID_HANDLE).
class InvalidHandle : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Runs `f`, turning every exception into a status and this thread's last error.
mg_status guarded_status(void (*f)(void*), void* context) noexcept;
template <class F>
mg_status guarded(F&& f) noexcept {
  return guarded_status([](void* c) { (*static_cast<F*>(c))(); }, &f);
}

// Handles are checked against a process-wide set of live ones, so a call on a destroyed handle is
// refused instead of touching freed memory (a mutex: create and destroy are rare, lookups short).
enum class HandleKind { kGroupedLinear, kMoeLayer, kConfig, kStepGraphs, kEpComm };
void register_handle(const void* handle, HandleKind kind);
// False when `handle` is not a live handle of that kind (then nothing is unregistered).
bool unregister_handle(const void* handle, HandleKind kind);
// Throws InvalidHandle naming `type` unless `handle` is live and of that kind.
void check_handle(const void* handle, HandleKind kind, const char* type);

// Where each release of a struct ends, oldest first, the current one (sizeof(T)) last: sizeof(T)
// alone while the struct has not grown. A struct that grew lists before it the offset of the first
// field each later release appended, where the earlier release's fields end; fields are only ever
// appended, so older callers keep working. A caller's struct_size selects the latest release it
// covers: read_struct takes that release's fields only, and the later ones keep their defaults even
// where they lie in the older struct's tail padding (an older caller's sizeof covers those bytes,
// but to it they are padding, not fields).
// A field appended inside the current sizeof's tail padding leaves sizeof unchanged, so a caller of
// the previous release could not be told apart and its padding bytes would be read as the field:
// such a field must be wide enough to begin past the padding (mg_grouped_linear_options'
// dequantized_weights and mg_config_shape's shard_ranks are 64-bit for this). mg_moe_layer_options
// ends with 4 bytes of padding today.
template <class T>
struct Releases {
  static constexpr std::array<std::size_t, 1> ends{sizeof(T)};
};
template <>
struct Releases<mg_grouped_linear_options> {
  static constexpr std::array ends{offsetof(mg_grouped_linear_options, prequantized_weights),
                                   offsetof(mg_grouped_linear_options, dequantized_weights),
                                   offsetof(mg_grouped_linear_options, forward_only),
                                   sizeof(mg_grouped_linear_options)};
};
template <>
struct Releases<mg_forward_args> {
  static constexpr std::array ends{offsetof(mg_forward_args, mxfp8_data), offsetof(mg_forward_args, mxfp8_dequantized),
                                   offsetof(mg_forward_args, mxfp8_scales_tiled), sizeof(mg_forward_args)};
};
template <>
struct Releases<mg_backward_args> {
  static constexpr std::array ends{offsetof(mg_backward_args, mxfp8_data),
                                   offsetof(mg_backward_args, mxfp8_dequantized),
                                   offsetof(mg_backward_args, mxfp8_scales_tiled), sizeof(mg_backward_args)};
};
template <>
struct Releases<mg_moe_layer_options> {
  static constexpr std::array ends{offsetof(mg_moe_layer_options, expert_parallel),
                                   offsetof(mg_moe_layer_options, prequantized_weights),
                                   offsetof(mg_moe_layer_options, ep_exchange),
                                   offsetof(mg_moe_layer_options, dequantized_weights), sizeof(mg_moe_layer_options)};
};
template <>
struct Releases<mg_moe_layer_weights> {
  static constexpr std::array ends{offsetof(mg_moe_layer_weights, w1_mxfp8_data),
                                   offsetof(mg_moe_layer_weights, w1_mxfp8_dequantized),
                                   offsetof(mg_moe_layer_weights, w1_mxfp8_scales_tiled), sizeof(mg_moe_layer_weights)};
};
template <>
struct Releases<mg_config_shape> {
  static constexpr std::array ends{offsetof(mg_config_shape, expert_parallel),
                                   offsetof(mg_config_shape, prequantized_weights),
                                   offsetof(mg_config_shape, dequantized_weights),
                                   offsetof(mg_config_shape, shard_ranks), sizeof(mg_config_shape)};
};
template <>
struct Releases<mg_step_weights> {
  static constexpr std::array ends{offsetof(mg_step_weights, w1_mxfp8_data),
                                   offsetof(mg_step_weights, w1_mxfp8_dequantized),
                                   offsetof(mg_step_weights, w1_mxfp8_scales_tiled), sizeof(mg_step_weights)};
};
template <>
struct Releases<mg_step_graphs_options> {
  static constexpr std::array ends{offsetof(mg_step_graphs_options, comm), offsetof(mg_step_graphs_options, shard_comm),
                                   sizeof(mg_step_graphs_options)};
};

// The smallest struct_size accepted: the first release's.
template <class T>
inline constexpr std::size_t kFirstSize = Releases<T>::ends[0];

// The bytes of T that a caller of this struct_size (at least kFirstSize<T>) knows as fields: the end
// of the latest release it covers (sizeof(T) for the current one and for newer ones).
template <class T>
constexpr std::size_t known_bytes(std::size_t struct_size) {
  std::size_t known = kFirstSize<T>;
  for (std::size_t end : Releases<T>::ends)
    if (end <= struct_size) known = end;
  return known;
}

// Reads a caller's struct into `value` (already holding the defaults): the fields of the caller's
// release are taken (all, or the first release's: see kFirstSize), later ones keep their defaults,
// and an unknown tail must be zero.
template <class T>
T read_struct(const T* in, const char* type, T value) {
  MG_CHECK(in != nullptr, "null ", type);
  const std::size_t size = in->struct_size;
  MG_CHECK(size >= kFirstSize<T>, type, ".struct_size must be sizeof(", type, ") = ", sizeof(T), ", got ", size,
           " (set it, or fill the struct with its _init function)");
  if (size > sizeof(T)) {
    const auto* tail = reinterpret_cast<const unsigned char*>(in) + sizeof(T);
    for (std::size_t i = 0; i < size - sizeof(T); ++i)
      MG_CHECK(tail[i] == 0, type, " of ", size, " bytes has fields this library (", sizeof(T),
               " bytes) does not know set at byte ", sizeof(T) + i, ": built against newer headers?");
  }
  std::memcpy(static_cast<void*>(&value), in, known_bytes<T>(size));
  value.struct_size = sizeof(T);
  return value;
}

// Writes `value` over a caller's struct of `size` bytes (its sizeof, as the caller's header has it;
// at least kFirstSize<T>): the fields of the release that size covers, struct_size = size, and zeros
// over a newer caller's unknown tail. Nothing past `size` is written (an older caller's struct is
// smaller than T).
template <class T>
void write_release(T* out, std::size_t size, const T& value) {
  std::memcpy(static_cast<void*>(out), &value, known_bytes<T>(size));
  out->struct_size = size;
  if (size > sizeof(T)) std::memset(reinterpret_cast<unsigned char*>(out) + sizeof(T), 0, size - sizeof(T));
}

// Fills a caller's struct of `size` bytes with the defaults in `value` (write_release). Refuses a
// size below the first release's, writing nothing.
template <class T>
void init_struct(T* out, std::size_t size, const char* type, const T& value) {
  MG_CHECK(out != nullptr, "null ", type);
  MG_CHECK(size >= kFirstSize<T>, type, " of ", size, " bytes is smaller than its first release (", kFirstSize<T>,
           " bytes)");
  write_release(out, size, value);
}

// Writes `value` into a caller's struct of its own struct_size (write_release).
template <class T>
void write_struct(T* out, const char* type, const T& value) {
  MG_CHECK(out != nullptr, "null ", type, " output");
  const std::size_t size = out->struct_size;
  MG_CHECK(size >= kFirstSize<T>, type, ".struct_size must be sizeof(", type, ") = ", sizeof(T), ", got ", size);
  write_release(out, size, value);
}

// The communicator behind a live mg_ep_comm handle (InvalidHandle otherwise); c_api_ep.cpp.
std::shared_ptr<EpComm> ep_comm_of(const mg_ep_comm* comm);

// The C enums span every int32: these refuse values other than the named ones.
moegraph::DType dtype_of(mg_dtype dtype);
moegraph::Recipe recipe_of(mg_recipe recipe);
mg_dtype c_dtype(moegraph::DType dtype);
mg_recipe c_recipe(moegraph::Recipe recipe);

}  // namespace moegraph::c_api
