// Byte counts as a person reads them (KiB, MiB, GiB: powers of 1024, as nvidia-smi and the CUDA
// docs count device memory), for --plan and other printed sizes. Exact counts go into JSON.
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>

namespace moegraph {

inline std::string human_bytes(std::size_t bytes) {
  constexpr std::size_t kKiB = 1024, kMiB = kKiB << 10, kGiB = kMiB << 10;
  char text[32];
  // Two decimals of GiB: 0.01 GiB is the step where a device's memory starts to matter.
  if (bytes >= kGiB) std::snprintf(text, sizeof text, "%.2f GiB", bytes / double(kGiB));
  else if (bytes >= kMiB) std::snprintf(text, sizeof text, "%.1f MiB", bytes / double(kMiB));
  else if (bytes >= kKiB) std::snprintf(text, sizeof text, "%.1f KiB", bytes / double(kKiB));
  else std::snprintf(text, sizeof text, "%zu B", bytes);
  return text;
}

}  // namespace moegraph
