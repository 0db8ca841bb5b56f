// Set-up of a kernel with a large dynamic shared memory footprint, on the current device (before
// capture): raise its limit, then ask how many CTAs of it fit on one SM.
#pragma once

#include <cuda_runtime_api.h>

#include "moegraph/error.hpp"

namespace moegraph::kernels {

template <class Kernel>
int allow_smem_and_measure(Kernel kernel, int threads, int smem_bytes) {
  MG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  int blocks = 0;
  MG_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem_bytes));
  return blocks;
}

}  // namespace moegraph::kernels
