#include "src/comm/ep_environment.hpp"

#include <cstdlib>
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

}  // namespace moegraph::comm
