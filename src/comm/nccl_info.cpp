// NCCL is linked for expert-parallel communication; this reports the version the library runs with.
#include <string>

#include "src/core/checks.hpp"
#include "moegraph/moegraph.h"

extern "C" int mg_nccl_version(void) {
  int version = 0;
  return ncclGetVersion(&version) == ncclSuccess ? version : -1;
}
