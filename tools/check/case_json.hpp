// Reading helpers shared by the op parsers of moegraph-check, on top of the project's strict JSON
// reader (src/config/json_reader.hpp): every problem throws ConfigError naming the key path, and
// load_case_file puts the file and the case in front.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "src/config/json_reader.hpp"

namespace moegraph::check {

using config_detail::Json;
using config_detail::JsonObject;

// `object[key]` read by `read(value, path)`, or `fallback` when the key is absent.
template <class T, class Read>
T optional_value(const JsonObject& object, std::string_view key, T fallback, Read read) {
  const Json* value = object.find(key);
  return value != nullptr ? static_cast<T>(read(*value, object.path(key))) : fallback;
}

// For messages: `s` as a JSON string literal ("bf16").
std::string in_quotes(std::string_view s);

// A string that must be one of `allowed`.
std::string choice(const Json& value, const std::string& path, std::initializer_list<std::string_view> allowed);

// The default data seed of a case: a hash of its name (FNV-1a), stable across platforms and runs.
uint64_t seed_from_name(std::string_view name);

}  // namespace moegraph::check
