// Private to src/config: strict, typed reading of a JSON document for the config parser.
// Every helper throws ConfigError naming the key path (e.g. "layer.top_k"); parse_config adds the
// source name in front, so these helpers never need to know where the text came from.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "moegraph/config.hpp"

namespace moegraph::config_detail {

// Keys keep their document order, so the first unknown key reported is the first one written.
using Json = nlohmann::ordered_json;

[[noreturn]] void fail(const char* file, int line, const std::string& message);

}  // namespace moegraph::config_detail

#define MG_CONFIG_CHECK(cond, ...)                                                                             \
  do {                                                                                                         \
    if (!(cond)) ::moegraph::config_detail::fail(__FILE__, __LINE__, ::moegraph::detail::concat(__VA_ARGS__)); \
  } while (0)

#define MG_CONFIG_FAIL(...) ::moegraph::config_detail::fail(__FILE__, __LINE__, ::moegraph::detail::concat(__VA_ARGS__))

namespace moegraph::config_detail {

// Parses `text` as one JSON value. Syntax errors report "line L, column C" of the last character
// the parser read; duplicate keys are refused because silently keeping one of them hides typos.
Json parse_document(const std::string& text);
// The text of a JSON document file (`what`: "config file", "case file"): a directory, an unreadable
// file (with the OS reason) or one over kMaxDocumentBytes (e.g. /dev/zero) is a ConfigError.
inline constexpr std::size_t kMaxDocumentBytes = std::size_t{16} << 20;
// Objects and arrays nest at most this deep in a config or case file (they need four levels).
inline constexpr std::size_t kMaxJsonDepth = 64;
std::string read_document_file(const std::string& path, const char* what);

// For messages: a JSON-quoted string, cut short so a huge input cannot flood the message.
std::string quoted_excerpt(std::string_view s);
// For messages: the type and, for scalars, the value: `string "4096"`, `number 4096.0`, `array`.
std::string describe(const Json& value);
std::size_t edit_distance(std::string_view a, std::string_view b);
// The message for a required key missing from `object` (named `path` in messages), read before the
// object's other keys are known: a key of `object` close enough to be its typo is named.
std::string missing_key_message(const Json& object, const std::string& path, std::string_view key);

// Typed values. `path` names the value in messages. Integers must be JSON integers (4096.0 and
// "4096" are refused); `rule` replaces the default "in [lo, hi]" in the range message.
int64_t integer_in(const Json& value, const std::string& path, int64_t lo, int64_t hi, std::string_view rule = {});
uint64_t non_negative_integer(const Json& value, const std::string& path);
double number(const Json& value, const std::string& path);
bool boolean(const Json& value, const std::string& path);
std::string string(const Json& value, const std::string& path);
const std::vector<Json>& array(const Json& value, const std::string& path);

// One JSON object of the schema. Construction checks that it is an object and that every key is
// one of `keys` (an unknown key names the closest valid one), before any value is read, so a typo
// is reported as a typo rather than as the required key it was meant to be.
class JsonObject {
 public:
  JsonObject(const Json& value, std::string path, std::initializer_list<std::string_view> keys);

  const Json* find(std::string_view key) const;      // nullptr when absent
  const Json& required(std::string_view key) const;  // absent: "missing required key"
  std::string path(std::string_view key) const;      // "layer" + "top_k" -> "layer.top_k"

 private:
  const Json& value_;
  std::string path_;
};

}  // namespace moegraph::config_detail
