// Deadlines for host waits whose limit the caller gives in milliseconds.
#pragma once

#include <algorithm>
#include <chrono>

namespace moegraph {

// The longest wait a deadline holds: a century. Why: a caller may pass the largest value for
// "wait forever" (INT64_MAX ms), and adding that to the steady clock as nanoseconds overflows and
// puts the deadline in the past, so the wait would end at once.
inline constexpr long long kMaxWaitMs = 100LL * 365 * 24 * 60 * 60 * 1000;

// `timeout_ms` (>= 0; larger than kMaxWaitMs waits kMaxWaitMs) after `now`.
inline std::chrono::steady_clock::time_point deadline_after(std::chrono::steady_clock::time_point now,
                                                            long long timeout_ms) {
  return now + std::chrono::milliseconds(std::clamp(timeout_ms, 0LL, kMaxWaitMs));
}

}  // namespace moegraph
