// Instantiates exactly the kernels that are used, for bf16 and fp16: fprop, dgrad and wgrad on
// wgmma (sm_90a), and the same three on the foundation WMMA kernels (the reference path).
#include <sstream>

#include "kernels/grouped_gemm/sm90_grouped_gemm_wgmma.cuh"
#include "kernels/grouped_gemm/sm90_grouped_gemm_wmma.cuh"
#include "moegraph/error.hpp"

namespace moegraph::kernels {

using namespace wmma_gemm;

std::string GemmTileConfig::to_string() const {
  std::ostringstream os;
  os << name << " " << block_m << "x" << block_n << "x" << block_k << " stages=" << stages << " threads=" << threads;
  return os.str();
}

GemmTileConfig foundation_tile_config() { return {"wmma_cp_async", BM, BN, BK, STAGES, THREADS}; }
GemmTileConfig wgmma_tile_config() {
  namespace w = wgmma_gemm;
  return {"wgmma_cp_async_sw128", w::BM, w::BN, w::BK, w::STAGES, w::THREADS};
}

namespace {

// Resident CTAs per SM of each kernel, found by prepare() before any capture; launches read them.
struct Occupancy {
  int fprop = 0, dgrad = 0, wgrad = 0;           // wgmma kernels
  int ref_fprop = 0, ref_dgrad = 0, ref_wgrad = 0;  // WMMA reference kernels
};
Occupancy g_occupancy[2];  // [bf16, fp16]
int dtype_index(DType dtype) { return dtype == DType::kFP16 ? 1 : 0; }

template <class Kernel>
int allow_and_measure(Kernel kernel, int smem_bytes, int threads) {
  MG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  int blocks = 0;
  MG_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem_bytes));
  MG_CHECK(blocks > 0, "a grouped GEMM kernel cannot be resident (", smem_bytes, " bytes of shared memory)");
  return blocks;
}

const Occupancy& occupancy(DType dtype) {
  const Occupancy& o = g_occupancy[dtype_index(dtype)];
  MG_CHECK(o.fprop > 0, "prepare_grouped_gemm(", dtype_name(dtype), ") must run before the launches (at set-up)");
  return o;
}

namespace w = wgmma_gemm;

template <class T>
void launch_ragged(RaggedGemmKind kind, const RaggedGemmParams& p, int sm_count, const Occupancy& occ,
                   cudaStream_t stream) {
  const bool fprop = kind == RaggedGemmKind::kFprop;
  if (p.reference && fprop) ragged_gemm_kernel<T, true><<<sm_count * occ.ref_fprop, THREADS, kSmemBytes, stream>>>(p);
  else if (p.reference) ragged_gemm_kernel<T, false><<<sm_count * occ.ref_dgrad, THREADS, kSmemBytes, stream>>>(p);
  else if (fprop) w::ragged_gemm_kernel<T, false><<<sm_count * occ.fprop, w::THREADS, w::kSmemBytes, stream>>>(p);
  else w::ragged_gemm_kernel<T, true><<<sm_count * occ.dgrad, w::THREADS, w::kSmemBytes, stream>>>(p);
  MG_LAUNCH_CHECK();
}

template <class T>
void launch_wgrad(const WgradParams& p, int sm_count, const Occupancy& occ, cudaStream_t stream) {
  if (p.reference) grouped_wgrad_kernel<T><<<sm_count * occ.ref_wgrad, THREADS, kSmemBytes, stream>>>(p);
  else w::grouped_wgrad_kernel<T><<<sm_count * occ.wgrad, w::THREADS, w::kSmemBytes, stream>>>(p);
  MG_LAUNCH_CHECK();
}

template <class T>
void prepare(Occupancy& o) {
  o.fprop = allow_and_measure(w::ragged_gemm_kernel<T, false>, w::kSmemBytes, w::THREADS);
  o.dgrad = allow_and_measure(w::ragged_gemm_kernel<T, true>, w::kSmemBytes, w::THREADS);
  o.wgrad = allow_and_measure(w::grouped_wgrad_kernel<T>, w::kSmemBytes, w::THREADS);
  o.ref_fprop = allow_and_measure(ragged_gemm_kernel<T, true>, kSmemBytes, THREADS);
  o.ref_dgrad = allow_and_measure(ragged_gemm_kernel<T, false>, kSmemBytes, THREADS);
  o.ref_wgrad = allow_and_measure(grouped_wgrad_kernel<T>, kSmemBytes, THREADS);
}

}  // namespace

void prepare_grouped_gemm(DType dtype) {
  Occupancy& o = g_occupancy[dtype_index(dtype)];
  if (dtype == DType::kFP16) prepare<__half>(o);
  else prepare<__nv_bfloat16>(o);
}

void launch_ragged_gemm(DType dtype, RaggedGemmKind kind, const RaggedGemmParams& p, int sm_count,
                        cudaStream_t stream) {
  MG_CHECK(p.num_groups >= 1 && p.num_groups <= kMaxGroups, "num_groups must be in [1, ", kMaxGroups,
           "], got ", p.num_groups);
  const Occupancy& occ = occupancy(dtype);
  if (dtype == DType::kFP16) launch_ragged<__half>(kind, p, sm_count, occ, stream);
  else launch_ragged<__nv_bfloat16>(kind, p, sm_count, occ, stream);
}

void launch_grouped_wgrad(DType dtype, const WgradParams& p, int sm_count, cudaStream_t stream) {
  MG_CHECK((p.dweight == nullptr) != (p.main_grad == nullptr),
           "wgrad needs exactly one of dweight and main_grad");
  const Occupancy& occ = occupancy(dtype);
  if (dtype == DType::kFP16) launch_wgrad<__half>(p, sm_count, occ, stream);
  else launch_wgrad<__nv_bfloat16>(p, sm_count, occ, stream);
}

}  // namespace moegraph::kernels
