// The device barrier timeout of every EpComm: MOEGRAPH_EP_TIMEOUT_MS (a positive integer, at most one
// hour) or 20 s. Read at set-up, once per communicator.
#pragma once

namespace moegraph::comm {

long long barrier_timeout_ns_from_environment();

}  // namespace moegraph::comm
