// What the C ABI's host tests share: C structs as a C caller fills them, and the error message check.
#pragma once

#include <string>

#include "moegraph/moegraph.h"

namespace moegraph::c_abi_test {

// A C struct zeroed with its size set, as a C caller writes `T t = {0}; t.struct_size = sizeof t;`.
template <class T>
T sized() {
  T t{};
  t.struct_size = sizeof(T);
  return t;
}

inline bool last_error_has(const std::string& part) {
  return std::string(mg_last_error()).find(part) != std::string::npos;
}

inline mg_grouped_linear_options small_linear() {
  mg_grouped_linear_options o;
  mg_grouped_linear_options_init(&o);
  o.num_groups = 8, o.in_features = 256, o.out_features = 512, o.capacity_rows = 1024;
  return o;
}

inline mg_moe_layer_options small_moe() {
  mg_moe_layer_options o;
  mg_moe_layer_options_init(&o);
  o.experts = 8, o.hidden = 256, o.ffn = 256, o.top_k = 2, o.max_tokens = 64;
  return o;
}

}  // namespace moegraph::c_abi_test
