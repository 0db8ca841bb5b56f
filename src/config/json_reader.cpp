#include "src/config/json_reader.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <cctype>
#include <cmath>
#include <limits>
#include <unordered_set>
#include <utility>

namespace moegraph::config_detail {

void fail(const char* file, int line, const std::string& message) {
  throw ConfigError(file, line, message, ErrorKind::kInvalidArgument);
}

namespace {

// The most bytes of a user's string quoted in a message (quoted_excerpt, and the parser's own
// quote of the token it last read).
constexpr std::size_t kQuotedBytes = 64;

std::string join(const std::string& parent, std::string_view key) {
  return parent.empty() ? std::string(key) : detail::concat(parent, ".", key);
}

// Checks what Json::parse does not: it remembers where a syntax error happened (the byte position
// nlohmann reports) and refuses duplicate keys, naming the key's path. Builds no DOM.
class StrictSax final : public nlohmann::json_sax<Json> {
 public:
  std::size_t error_position = 0;
  std::string error_reason;
  std::string duplicate_key;  // path of the repeated key
  std::string too_deep;       // path of the first container past kMaxJsonDepth

  bool null() override { return value_done(); }
  bool boolean(bool) override { return value_done(); }
  bool number_integer(number_integer_t) override { return value_done(); }
  bool number_unsigned(number_unsigned_t) override { return value_done(); }
  bool number_float(number_float_t, const string_t&) override { return value_done(); }
  bool string(string_t&) override { return value_done(); }
  bool binary(binary_t&) override { return value_done(); }

  bool start_object(std::size_t) override { return open(true); }
  bool start_array(std::size_t) override { return open(false); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }

  bool key(string_t& key) override {
    Frame& object = frames_.back();
    object.current_key = key;
    if (!object.keys.insert(key).second) {
      duplicate_key = current_path();
      return false;
    }
    return true;
  }

  bool parse_error(std::size_t position, const std::string&, const nlohmann::json::exception& ex) override {
    error_position = position;
    error_reason = ex.what();
    return false;
  }

 private:
  struct Frame {
    bool is_object;
    std::string current_key;     // objects: the key whose value comes next
    std::size_t next_index = 0;  // arrays: the index of the next element
    std::unordered_set<std::string> keys;
  };

  // Built only for a message: keeping a path per frame would cost O(depth^2) on deep documents.
  std::string current_path() const {
    std::string path;
    for (const Frame& f : frames_)
      path = f.is_object ? join(path, f.current_key) : detail::concat(path, "[", f.next_index, "]");
    return path;
  }
  bool value_done() {
    if (!frames_.empty() && !frames_.back().is_object) ++frames_.back().next_index;
    return true;
  }
  bool open(bool is_object) {
    if (frames_.size() >= kMaxJsonDepth) {
      too_deep = current_path();
      return false;
    }
    frames_.push_back(Frame{is_object, {}, 0, {}});
    return true;
  }
  bool close() {
    frames_.pop_back();
    return value_done();  // the closed container was one element of its parent
  }

  std::vector<Frame> frames_;
};

// nlohmann quotes the raw bytes it last read, which may be the ill-formed UTF-8 it complains about;
// messages must stay printable, so each byte that does not belong to a well-formed sequence becomes '?'.
std::string replace_ill_formed_utf8(const std::string& text) {
  std::string out;
  for (std::size_t i = 0; i < text.size();) {
    const auto lead = static_cast<unsigned char>(text[i]);
    const std::size_t length = lead < 0x80           ? 1
                               : (lead >> 5) == 0x6  ? 2
                               : (lead >> 4) == 0xE  ? 3
                               : (lead >> 3) == 0x1E ? 4
                                                     : 0;
    bool well_formed = length != 0 && i + length <= text.size();
    for (std::size_t k = 1; well_formed && k < length; ++k)
      well_formed = (static_cast<unsigned char>(text[i + k]) & 0xC0) == 0x80;
    if (well_formed) {
      out.append(text, i, length);
      i += length;
    } else {
      out += '?';
      ++i;
    }
  }
  return out;
}

// nlohmann's what() starts with "[json.exception.parse_error.101] parse error at line 1, column 5: ";
// the position is ours (from the byte offset), so keep only the reason after it.
std::string reason_of(std::string what) {
  if (what.rfind("[json.exception.", 0) == 0) {
    const std::size_t end = what.find("] ");
    if (end != std::string::npos) what.erase(0, end + 2);
  }
  if (what.rfind("parse error", 0) == 0) {
    const std::size_t colon = what.find(": ");
    if (colon != std::string::npos) what.erase(0, colon + 2);
  }
  // It quotes the whole token it last read, which may be a string of megabytes: cut it as we cut
  // strings everywhere else (a UTF-8 sequence cut in half becomes '?' below).
  constexpr std::string_view kLastRead = "last read: '", kExpected = "'; expected";
  if (const std::size_t at = what.find(kLastRead); at != std::string::npos) {
    const std::size_t start = at + kLastRead.size();
    // The token ends at its closing quote: before "; expected ..." when nlohmann adds that, else last.
    std::size_t end = what.find(kExpected, start);
    if (end == std::string::npos) end = what.rfind('\'');
    if (end != std::string::npos && end >= start && end - start > kQuotedBytes) {
      std::size_t cut = start + kQuotedBytes;
      // Not inside one of its "<U+XXXX>" escapes of a control character.
      if (const std::size_t open = what.rfind('<', cut - 1); open != std::string::npos && open >= start &&
                                                               what.find('>', open) >= cut)
        cut = open;
      what = what.substr(0, cut) + "..." + what.substr(end);
    }
  }
  return replace_ill_formed_utf8(what);
}

// 1-based line and column (in bytes) of the character at 1-based byte `position`; a position past
// the end (unexpected end of input) points just after the last character.
std::pair<std::size_t, std::size_t> line_column(const std::string& text, std::size_t position) {
  const std::size_t index = std::min(position == 0 ? 0 : position - 1, text.size());
  std::size_t line = 1;
  std::size_t line_start = 0;
  for (std::size_t i = 0; i < index; ++i) {
    if (text[i] == '\n') {
      ++line;
      line_start = i + 1;
    }
  }
  return {line, index - line_start + 1};
}

constexpr double kTwoTo63 = 9223372036854775808.0;

}  // namespace

std::string read_document_file(const std::string& path, const char* what) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    fail(__FILE__, __LINE__, detail::concat("cannot read ", what, " \"", path, "\": it is a directory"));
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(__FILE__, __LINE__, detail::concat("cannot open ", what, " \"", path, "\": ", std::strerror(errno)));
  // Read in chunks up to the limit, so a device or a pipe that never ends (/dev/zero) is refused
  // instead of exhausting memory.
  std::string text;
  char chunk[1 << 16];
  while (in.read(chunk, sizeof(chunk)) || in.gcount() > 0) {
    text.append(chunk, static_cast<std::size_t>(in.gcount()));
    if (text.size() > kMaxDocumentBytes)
      fail(__FILE__, __LINE__, detail::concat("cannot read ", what, " \"", path, "\": it is larger than ",
                                              kMaxDocumentBytes >> 20, " MiB"));
  }
  if (in.bad())
    fail(__FILE__, __LINE__, detail::concat("cannot read ", what, " \"", path, "\": ", std::strerror(errno)));
  return text;
}

Json parse_document(const std::string& text) {
  StrictSax sax;
  bool ok = false;
  try {
    ok = Json::sax_parse(text, &sax);
  } catch (const nlohmann::json::exception& e) {
    MG_CONFIG_FAIL("invalid JSON: ", reason_of(e.what()));
  }
  if (!ok) {
    MG_CONFIG_CHECK(sax.duplicate_key.empty(), "duplicate key ", quoted_excerpt(sax.duplicate_key),
                    " (each key may appear only once per object)");
    // The DOM copies nested values recursively (ordered keys in a vector): a deep enough document
    // would exhaust the stack there, so none is built past this depth.
    MG_CONFIG_CHECK(sax.too_deep.empty(), "objects and arrays nested deeper than ", kMaxJsonDepth, " levels (at ",
                    quoted_excerpt(sax.too_deep), ")");
    const auto [line, column] = line_column(text, sax.error_position);
    MG_CONFIG_FAIL("invalid JSON at line ", line, ", column ", column, ": ", reason_of(sax.error_reason));
  }
  return Json::parse(text);  // cannot fail: the same parser just accepted the text
}

std::string quoted_excerpt(std::string_view s) {
  std::string shown(s.substr(0, kQuotedBytes));
  if (s.size() > kQuotedBytes) {
    // Do not cut a UTF-8 sequence in half: drop continuation bytes (10xxxxxx) and their lead byte.
    while (!shown.empty() && (static_cast<unsigned char>(shown.back()) & 0xC0) == 0x80) shown.pop_back();
    if (!shown.empty() && (static_cast<unsigned char>(shown.back()) & 0x80) != 0) shown.pop_back();
    shown += "...";
  }
  return Json(shown).dump(-1, ' ', false, Json::error_handler_t::replace);
}

std::string describe(const Json& value) {
  if (value.is_string()) return detail::concat("string ", quoted_excerpt(value.get_ref<const std::string&>()));
  if (value.is_null()) return "null";
  if (value.is_array()) return "array";
  if (value.is_object()) return "object";
  return detail::concat(value.type_name(), " ", value.dump());  // number or boolean
}

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> previous(b.size() + 1);
  std::vector<std::size_t> current(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) previous[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    current[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t substitute = previous[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      current[j] = std::min({previous[j] + 1, current[j - 1] + 1, substitute});
    }
    std::swap(previous, current);
  }
  return previous[b.size()];
}

int64_t integer_in(const Json& value, const std::string& path, int64_t lo, int64_t hi, std::string_view rule) {
  const std::string rule_text = rule.empty() ? detail::concat("in [", lo, ", ", hi, "]") : std::string(rule);
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    MG_CONFIG_CHECK(hi >= 0 && u <= static_cast<uint64_t>(hi), path, " must be ", rule_text, ", got ", u);
  } else if (!value.is_number_integer()) {
    // Integer literals beyond 64 bits arrive as floats; they are out of range, not of the wrong type.
    const bool huge = value.is_number_float() && std::fabs(value.get<double>()) >= kTwoTo63;
    MG_CONFIG_CHECK(!huge, path, " must be ", rule_text, ", got ", value.get<double>(), " (out of range)");
    MG_CONFIG_FAIL(path, " must be an integer, got ", describe(value));
  }
  const int64_t v = value.get<int64_t>();
  MG_CONFIG_CHECK(v >= lo && v <= hi, path, " must be ", rule_text, ", got ", v);
  return v;
}

uint64_t non_negative_integer(const Json& value, const std::string& path) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer()) {  // signed: "-0" from text, or a value built in code
    MG_CONFIG_CHECK(value.get<int64_t>() >= 0, path, " must be a non-negative integer, got ", value.dump());
    return static_cast<uint64_t>(value.get<int64_t>());
  }
  const bool huge = value.is_number_float() && std::fabs(value.get<double>()) >= 2 * kTwoTo63;
  MG_CONFIG_CHECK(!huge, path, " must be a non-negative integer below 2^64, got ", value.get<double>(),
                  " (out of range)");
  MG_CONFIG_FAIL(path, " must be a non-negative integer, got ", describe(value));
}

double number(const Json& value, const std::string& path) {
  MG_CONFIG_CHECK(value.is_number(), path, " must be a number, got ", describe(value));
  return value.get<double>();
}

bool boolean(const Json& value, const std::string& path) {
  MG_CONFIG_CHECK(value.is_boolean(), path, " must be a boolean (true or false), got ", describe(value));
  return value.get<bool>();
}

std::string string(const Json& value, const std::string& path) {
  MG_CONFIG_CHECK(value.is_string(), path, " must be a string, got ", describe(value));
  return value.get<std::string>();
}

const std::vector<Json>& array(const Json& value, const std::string& path) {
  MG_CONFIG_CHECK(value.is_array(), path, " must be an array, got ", describe(value));
  return value.get_ref<const Json::array_t&>();
}

namespace {

std::string lowercase(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// The valid key closest to `key`, or "" when none is close enough to be a plausible typo.
std::string_view closest_key(std::string_view key, std::initializer_list<std::string_view> keys) {
  constexpr std::size_t kLongestPlausibleTypo = 64;  // bounds the work on absurd keys
  if (key.size() > kLongestPlausibleTypo) return {};
  std::string_view best;
  std::size_t best_distance = std::numeric_limits<std::size_t>::max();
  for (std::string_view candidate : keys) {
    const std::size_t d = edit_distance(lowercase(key), lowercase(candidate));
    if (d < best_distance) {
      best_distance = d;
      best = candidate;
    }
  }
  // Up to 3 edits, and at most half the length, so "x" does not suggest "ffn".
  const std::size_t allowed = std::min<std::size_t>(3, std::max<std::size_t>(1, std::max(key.size(), best.size()) / 2));
  return best_distance <= allowed ? best : std::string_view{};
}

}  // namespace

std::string missing_key_message(const Json& object, const std::string& path, std::string_view key) {
  std::string message = "missing required key " + quoted_excerpt(path);
  if (object.is_object())
    for (const auto& item : object.items())
      if (closest_key(item.key(), {key}) == key) return message + "; is " + quoted_excerpt(item.key()) + " a typo of it?";
  return message;
}

JsonObject::JsonObject(const Json& value, std::string path, std::initializer_list<std::string_view> keys)
    : value_(value), path_(std::move(path)) {
  if (!value_.is_object()) {
    MG_CONFIG_CHECK(!path_.empty(), "the config must be a JSON object, got ", describe(value_));
    MG_CONFIG_FAIL(path_, " must be an object, got ", describe(value_));
  }
  for (const auto& item : value_.items()) {
    const std::string& key = item.key();
    if (std::find(keys.begin(), keys.end(), key) != keys.end()) continue;
    const std::string_view suggestion = closest_key(key, keys);
    if (!suggestion.empty())
      MG_CONFIG_FAIL("unknown key ", quoted_excerpt(join(path_, key)), "; did you mean ",
                     quoted_excerpt(join(path_, suggestion)), "?");
    std::string valid;
    for (std::string_view k : keys) valid += detail::concat(valid.empty() ? "" : ", ", k);
    MG_CONFIG_FAIL("unknown key ", quoted_excerpt(join(path_, key)), "; valid keys ",
                   path_.empty() ? std::string("at the top level") : detail::concat("in ", quoted_excerpt(path_)), ": ",
                   valid);
  }
}

const Json* JsonObject::find(std::string_view key) const {
  const auto it = value_.find(std::string(key));
  return it == value_.end() ? nullptr : &*it;
}

const Json& JsonObject::required(std::string_view key) const {
  const Json* v = find(key);
  MG_CONFIG_CHECK(v != nullptr, "missing required key ", quoted_excerpt(path(key)));
  return *v;
}

std::string JsonObject::path(std::string_view key) const { return join(path_, key); }

}  // namespace moegraph::config_detail
