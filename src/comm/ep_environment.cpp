#include "src/comm/ep_environment.hpp"

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>

#include "moegraph/error.hpp"

namespace moegraph::comm {

long long env_integer(const char* name, long long lo, long long hi, long long fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') {
    MG_CHECK(fallback >= lo, name, " is not set (scripts/launch sets it)");
    return fallback;
  }
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  MG_CHECK(end != nullptr && *end == '\0' && v >= lo && v <= hi, name, " must be an integer in [", lo, ", ", hi,
           "], got \"", text, "\"");
  return v;
}

long long barrier_timeout_ns_from_environment() {
  constexpr long long kDefaultMs = 20000, kMaxMs = 3600LL * 1000;
  return env_integer("MOEGRAPH_EP_TIMEOUT_MS", 1, kMaxMs, kDefaultMs) * 1000000;
}

std::string nvls_refusal(const char* now, const std::string& initial) {
  const std::string refusal = zero_since_start_refusal("NCCL_NVLS_ENABLE", now, &initial, "expert parallelism over NCCL");
  return refusal.empty() ? refusal
                         : refusal + " (a communicator may already have NVLink multicast on): moegraph never uses "
                                     "NVLink multicast, and a communicator with it enabled may bind multicast memory "
                                     "to every window";
}

namespace {

// The value of `name` in a NUL-separated NAME=value block, or nullopt when it is not there.
std::optional<std::string> value_in_block(const std::string& block, const char* name) {
  const std::string key = std::string(name) + "=";
  for (std::size_t at = 0; at < block.size();) {
    std::size_t end = block.find('\0', at);
    if (end == std::string::npos) end = block.size();
    if (block.compare(at, key.size(), key) == 0 && end - at >= key.size())
      return block.substr(at + key.size(), end - at - key.size());
    at = end + 1;
  }
  return std::nullopt;
}

}  // namespace

std::string env_plugin_refusal(const char* now, const std::string* initial) {
  // As NCCL reads it: "none" in any case disables plugins; empty is as unset (NCCL's default library).
  auto plugin = [](const std::optional<std::string>& v) {
    if (!v.has_value() || v->empty()) return false;
    std::string lower = *v;
    for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return lower != "none";
  };
  const std::optional<std::string> current = now != nullptr ? std::optional<std::string>(now) : std::nullopt;
  const std::optional<std::string> at_start =
      initial != nullptr ? value_in_block(*initial, "NCCL_ENV_PLUGIN") : std::nullopt;
  if (!plugin(current) && !plugin(at_start)) return "";
  const std::string named = plugin(current) ? *current : *at_start;
  return "expert parallelism over NCCL refuses NCCL_ENV_PLUGIN=\"" + named + "\"" +
         (plugin(current) ? std::string() : std::string(" (set when the process started)")) +
         ": NCCL 2.28 and later read their variables through that plugin, so the NCCL_NVLS_ENABLE=0 checked "
         "here may not be the value NCCL uses (moegraph never uses NVLink multicast); unset it or set it to "
         "none from the start";
}

void require_nvls_off() {
  const char* now = std::getenv("NCCL_NVLS_ENABLE");
  const std::string* initial = nullptr;
  if (now != nullptr && std::string(now) == "0") {  // only then is the start's environment needed
    initial = start_environment();
    MG_CHECK(initial != nullptr, "cannot read /proc/self/environ to check that NCCL_NVLS_ENABLE=0 was set at the "
                                 "process's start (expert parallelism over NCCL needs it)");
  }
  const std::string refusal = nvls_refusal(now, initial != nullptr ? *initial : std::string());
  MG_CHECK(refusal.empty(), refusal);
  const std::string plugin = env_plugin_refusal(std::getenv("NCCL_ENV_PLUGIN"), initial);
  MG_CHECK(plugin.empty(), plugin);
}

const std::string* start_environment() {
  static const std::optional<std::string> block = []() -> std::optional<std::string> {
    std::ifstream in("/proc/self/environ", std::ios::binary);
    if (!in.good()) return std::nullopt;
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }();
  return block ? &*block : nullptr;
}

std::string zero_since_start_refusal(const char* name, const char* now, const std::string* initial,
                                     const std::string& needed_for) {
  const std::string wanted = std::string(name) + "=0";
  if (now == nullptr || std::string(now) != "0") {
    std::string got = "unset";
    if (now != nullptr) got = std::string("\"").append(now).append("\"");
    return needed_for + " needs " + wanted + " in the environment of every rank (got " + got + ")";
  }
  if (initial == nullptr)
    return needed_for + " needs " + wanted + " in the environment the process started with, and /proc/self/environ "
           "cannot be read to check it";
  if (value_in_block(*initial, name) == "0") return "";  // the first entry, as getenv reads it
  return needed_for + " needs " + wanted + " in the environment the process starts with (export it, or start the "
         "ranks with scripts/launch): it is set now but was not at start (set later in the process, or by an "
         "nccl.conf file), and NCCL keeps the value it first read";
}

}  // namespace moegraph::comm
