#include "src/core/lt_gemm.hpp"

#include <cublasLt.h>

#include "src/core/checks.hpp"

namespace moegraph {
namespace {

constexpr std::size_t kWorkspaceBytes = 32u << 20;

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::kBF16: return CUDA_R_16BF;
    case DType::kFP16: return CUDA_R_16F;
    case DType::kFP32: return CUDA_R_32F;
  }
  return CUDA_R_32F;
}

}  // namespace

struct LtGemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

LtGemm::LtGemm() : workspace_(kWorkspaceBytes) {
  cublasLtHandle_t h = nullptr;
  MG_CUBLAS_CHECK(cublasLtCreate(&h));
  handle_ = h;
}

LtGemm::~LtGemm() {
  plans_.clear();
  if (handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLASLt sees B first.
LtGemm::Plan& LtGemm::plan_for(const RowMajorGemm& g) {
  const Key key{g.trans_a, g.trans_b, g.m, g.n, g.k, g.lda, g.ldb, g.ldc,
                static_cast<int>(g.ab_type), static_cast<int>(g.c_type), g.beta != 0.0f};
  auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;

  auto plan = std::make_unique<Plan>();
  MG_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_a = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is our B
  const cublasOperation_t op_b = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  MG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  MG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  const cudaDataType_t ab = cuda_type(g.ab_type), ct = cuda_type(g.c_type);
  MG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, ab, g.trans_b ? g.k : g.n, g.trans_b ? g.n : g.k, g.ldb));
  MG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, ab, g.trans_a ? g.m : g.k, g.trans_a ? g.k : g.m, g.lda));
  MG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, ct, g.n, g.m, g.ldc));

  cublasLtMatmulPreference_t pref = nullptr;
  MG_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const std::size_t ws = workspace_.bytes();
  MG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(handle_), plan->desc,
                                                           plan->a, plan->b, plan->c, plan->c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  MG_CUBLAS_CHECK(st);
  MG_CHECK(found > 0, "cuBLASLt has no algorithm for m=", g.m, " n=", g.n, " k=", g.k);
  plan->algo = result.algo;
  return *plans_.emplace(key, std::move(plan)).first->second;
}

void LtGemm::prepare(const RowMajorGemm& g) {
  if (g.m != 0 && g.n != 0) plan_for(g);
}

void LtGemm::run(const RowMajorGemm& g, cudaStream_t stream) {
  if (g.m == 0 || g.n == 0) return;
  Plan& plan = plan_for(g);
  const float alpha = 1.0f;
  MG_CUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), plan.desc, &alpha, g.b, plan.a, g.a,
                                 plan.b, &g.beta, g.c, plan.c, g.c, plan.c, &plan.algo, workspace_.get(),
                                 workspace_.bytes(), stream));
}

}  // namespace moegraph
