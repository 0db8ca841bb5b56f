// A row-major GEMM front end over cuBLASLt: C[m, n] = op(A) · op(B) (+ beta · C), fp32 compute.
// Used for the baselines (dense GEMM, per-expert loop) and in differential tests.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "moegraph/types.hpp"
#include "src/core/device_buffer.hpp"

namespace moegraph {

struct RowMajorGemm {
  bool trans_a = false, trans_b = false;  // op(A) is [m, k], op(B) is [k, n]
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* c = nullptr;
  int64_t ldc = 0;
  DType ab_type = DType::kBF16;
  DType c_type = DType::kBF16;
  float beta = 0.0f;
};

class LtGemm {
 public:
  LtGemm();
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // The first run of a shape asks cuBLASLt's heuristic (not capturable); later runs of the same
  // shape reuse the cached plan and may be captured.
  void run(const RowMajorGemm& g, cudaStream_t stream);
  // Asks the heuristic for this shape now (set-up, before capture); pointers are not used.
  void prepare(const RowMajorGemm& g);

 private:
  struct Plan;
  using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, bool>;
  Plan& plan_for(const RowMajorGemm& g);
  void* handle_ = nullptr;
  DeviceBuffer workspace_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace moegraph
