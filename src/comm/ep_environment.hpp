// The environment variables of expert parallelism, read at set-up (docs/expert-parallel.md).
#pragma once

namespace moegraph::comm {

// The integer in `name`, refused by name unless in [lo, hi]; `fallback` when unset or empty (a
// fallback below lo means the variable is required: its absence is refused).
long long env_integer(const char* name, long long lo, long long hi, long long fallback);

// The device barrier timeout of every EpComm: MOEGRAPH_EP_TIMEOUT_MS (at most one hour) or 20 s.
long long barrier_timeout_ns_from_environment();

}  // namespace moegraph::comm
