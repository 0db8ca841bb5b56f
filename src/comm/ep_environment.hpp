// The environment variables of expert parallelism, read at set-up (docs/expert-parallel.md).
#pragma once

#include <string>

namespace moegraph::comm {

// The integer in `name`, refused by name unless in [lo, hi]; `fallback` when unset or empty (a
// fallback below lo means the variable is required: its absence is refused).
long long env_integer(const char* name, long long lo, long long hi, long long fallback);

// The device barrier timeout of every EpComm: MOEGRAPH_EP_TIMEOUT_MS (at most one hour) or 20 s.
long long barrier_timeout_ns_from_environment();

// Why NVLink multicast might be on, or "" when NCCL_NVLS_ENABLE is "0" both now (`now`, null when
// unset) and in the environment the process started with (`initial`: its NUL-separated NAME=value
// block). NCCL reads the variable once, when it first starts in a process, and keeps the value: one
// set later may not reach a communicator made before it (a caller's, say torch.distributed's), nor
// one made after it in a process whose NCCL had already started.
std::string nvls_refusal(const char* now, const std::string& initial);
// Why NCCL might not read NCCL_NVLS_ENABLE from the environment, or "": NCCL 2.28 and later take
// every variable from an environment plugin when NCCL_ENV_PLUGIN names one (anything but "none" in
// any case, or empty), now
// (`now`, null when unset) or in the environment the process started with (`initial`, null: not
// checked). Unset, NCCL still loads a libnccl-env.so found on the library path: scripts/launch sets
// NCCL_ENV_PLUGIN=none, and docs/expert-parallel.md asks the same of other launchers.
std::string env_plugin_refusal(const char* now, const std::string* initial);
// Refuses (moegraph::Error) unless nvls_refusal and env_plugin_refusal of this process (getenv,
// /proc/self/environ) are "".
void require_nvls_off();

// The environment block the process started with (/proc/self/environ, NUL-separated NAME=value),
// read once per process (first by require_nvls_off, at set-up); null when it cannot be read.
const std::string* start_environment();
// Why `name` is not "0" both now (`now`, null when unset) and in `initial` (null: unreadable), or "".
// `needed_for` says what needs it. NCCL keeps the value it first read; it also takes values from
// nccl.conf files, which set the variable after the start: exporting it is the way that counts here.
std::string zero_since_start_refusal(const char* name, const char* now, const std::string* initial,
                                     const std::string& needed_for);

}  // namespace moegraph::comm
