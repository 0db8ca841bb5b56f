// Instantiates exactly the kernels that are used, for bf16 and fp16: fprop on wgmma (sm_90a),
// dgrad and wgrad on the foundation WMMA kernels.
#include <sstream>

#include "kernels/grouped_gemm/sm90_grouped_fprop_wgmma.cuh"
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
GemmTileConfig fprop_tile_config() {
  using namespace wgmma_fprop;
  return {"wgmma_cp_async_sw128", wgmma_fprop::BM, wgmma_fprop::BN, wgmma_fprop::BK, wgmma_fprop::STAGES,
          wgmma_fprop::THREADS};
}

namespace {

// Resident CTAs per SM of each kernel, found by prepare() before any capture; launches read them.
struct Occupancy {
  int fprop = 0, dgrad = 0, wgrad = 0;
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

template <class T>
void launch_ragged(RaggedGemmKind kind, const RaggedGemmParams& p, int sm_count, const Occupancy& occ,
                   cudaStream_t stream) {
  if (kind == RaggedGemmKind::kFprop) {
    wgmma_fprop::grouped_fprop_wgmma_kernel<T>
        <<<sm_count * occ.fprop, wgmma_fprop::THREADS, wgmma_fprop::kSmemBytes, stream>>>(p);
  } else {
    ragged_gemm_kernel<T, false><<<sm_count * occ.dgrad, THREADS, kSmemBytes, stream>>>(p);
  }
  MG_LAUNCH_CHECK();
}

template <class T>
void launch_wgrad(const WgradParams& p, int sm_count, const Occupancy& occ, cudaStream_t stream) {
  grouped_wgrad_kernel<T><<<sm_count * occ.wgrad, THREADS, kSmemBytes, stream>>>(p);
  MG_LAUNCH_CHECK();
}

template <class T>
void prepare(Occupancy& o) {
  o.fprop = allow_and_measure(wgmma_fprop::grouped_fprop_wgmma_kernel<T>, wgmma_fprop::kSmemBytes,
                              wgmma_fprop::THREADS);
  o.dgrad = allow_and_measure(ragged_gemm_kernel<T, false>, kSmemBytes, THREADS);
  o.wgrad = allow_and_measure(grouped_wgrad_kernel<T>, kSmemBytes, THREADS);
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
