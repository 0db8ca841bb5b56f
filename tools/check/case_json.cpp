#include "tools/check/case_json.hpp"

#include <algorithm>

namespace moegraph::check {

std::string in_quotes(std::string_view s) {
  return Json(std::string(s)).dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::string choice(const Json& value, const std::string& path, std::initializer_list<std::string_view> allowed) {
  std::string s = config_detail::string(value, path);
  if (std::find(allowed.begin(), allowed.end(), s) != allowed.end()) return s;
  std::string options;
  for (std::string_view a : allowed) options += detail::concat(options.empty() ? "" : ", ", in_quotes(a));
  MG_CONFIG_FAIL(path, " must be one of ", options, ", got ", in_quotes(s));
}

uint64_t seed_from_name(std::string_view name) {
  uint64_t hash = 14695981039346656037ull;
  for (unsigned char c : name) hash = (hash ^ c) * 1099511628211ull;
  return hash;
}

}  // namespace moegraph::check
