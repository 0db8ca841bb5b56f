// Per-device facts the launchers need, each queried once per device and cached per device (so one
// process can drive several GPUs). Attribute and occupancy queries never synchronize; the warm-up
// run makes the first query of each happen before capture.
#pragma once

namespace moegraph::kernels {

// Multiprocessors of the current device.
int current_sm_count();
// CTAs of `kernel` (a __global__ function's address) at `threads` threads and no dynamic shared
// memory that fit on one SM of the current device; at least 1.
int resident_blocks_per_sm(const void* kernel, int threads);

}  // namespace moegraph::kernels
