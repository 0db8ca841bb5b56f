// The legacy way, kept as a baseline and a differential-test oracle: copy the splits to the host
// (a synchronization), then one cuBLASLt GEMM per non-empty group. NOT capturable. GEMMs only:
// no bias epilogue.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "moegraph/types.hpp"
#include "src/core/lt_gemm.hpp"

namespace moegraph {

class LegacyExpertLoop {
 public:
  LegacyExpertLoop(int num_groups, int64_t n, int64_t k, int64_t capacity_rows, int row_align, DType dtype);

  // y_e = x_e W_e^T
  void fprop_not_capturable(const void* x, const int32_t* splits, const void* weight, void* y, cudaStream_t stream);
  // dx_e = dy_e W_e
  void dgrad_not_capturable(const void* dy, const int32_t* splits, const void* weight, void* dx, cudaStream_t stream);
  // dW_e = dy_e^T x_e written (empty group: zeros) or added into main_grad
  void wgrad_not_capturable(const void* dy, const void* x, const int32_t* splits, void* dweight, float* main_grad,
                            cudaStream_t stream);

 private:
  // Synchronizes `stream` to read the splits; returns the host offsets.
  const std::vector<int64_t>& read_splits(const int32_t* splits, cudaStream_t stream);
  int g_;
  int64_t n_, k_, capacity_;
  int row_align_;
  DType dtype_;
  std::vector<int32_t> host_splits_;
  std::vector<int64_t> host_offsets_;
  LtGemm lt_;
};

}  // namespace moegraph
