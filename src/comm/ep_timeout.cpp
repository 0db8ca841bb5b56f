#include "src/comm/ep_timeout.hpp"

#include <cstdlib>
#include <string>

#include "moegraph/error.hpp"

namespace moegraph::comm {

long long barrier_timeout_ns_from_environment() {
  constexpr long long kDefaultMs = 20000, kMaxMs = 3600LL * 1000;
  const char* text = std::getenv("MOEGRAPH_EP_TIMEOUT_MS");
  if (text == nullptr || *text == '\0') return kDefaultMs * 1000000;
  char* end = nullptr;
  const long long ms = std::strtoll(text, &end, 10);
  MG_CHECK(end != nullptr && *end == '\0' && ms >= 1 && ms <= kMaxMs,
           "MOEGRAPH_EP_TIMEOUT_MS must be an integer in [1, ", kMaxMs, "], got \"", text, "\"");
  return ms * 1000000;
}

}  // namespace moegraph::comm
