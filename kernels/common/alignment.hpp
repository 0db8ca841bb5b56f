// Host-side pointer checks shared by the launchers and the operators that call them: the kernels
// move 16-byte vectors (uint4 loads and stores, TMA boxes), so their buffers must be 16-byte aligned.
#pragma once

#include <cstdint>

namespace moegraph::kernels {

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

}  // namespace moegraph::kernels
