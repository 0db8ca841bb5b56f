// Instantiates exactly the foundation kernels that are used: {bf16, fp16} x {fprop, dgrad, wgrad}.
#include <sstream>

#include "kernels/grouped_gemm/sm90_grouped_gemm_wmma.cuh"
#include "moegraph/error.hpp"

namespace moegraph::kernels {

using namespace wmma_gemm;

std::string GemmTileConfig::to_string() const {
  std::ostringstream os;
  os << "wmma_cp_async " << block_m << "x" << block_n << "x" << block_k << " stages=" << stages
     << " threads=" << threads;
  return os.str();
}

GemmTileConfig foundation_tile_config() { return {BM, BN, BK, STAGES, THREADS}; }

namespace {

template <class Kernel>
void allow_large_smem(Kernel kernel) {
  static_assert(kSmemBytes > 48 * 1024);
  MG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
}

template <class T>
void launch_ragged(RaggedGemmKind kind, const RaggedGemmParams& p, int grid, cudaStream_t stream) {
  if (kind == RaggedGemmKind::kFprop) {
    ragged_gemm_kernel<T, true><<<grid, THREADS, kSmemBytes, stream>>>(p);
  } else {
    ragged_gemm_kernel<T, false><<<grid, THREADS, kSmemBytes, stream>>>(p);
  }
  MG_LAUNCH_CHECK();
}

template <class T>
void launch_wgrad(const WgradParams& p, int grid, cudaStream_t stream) {
  grouped_wgrad_kernel<T><<<grid, THREADS, kSmemBytes, stream>>>(p);
  MG_LAUNCH_CHECK();
}

template <class T>
int prepare(){
  allow_large_smem(ragged_gemm_kernel<T, true>);
  allow_large_smem(ragged_gemm_kernel<T, false>);
  allow_large_smem(grouped_wgrad_kernel<T>);
  int blocks = 0;
  MG_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, ragged_gemm_kernel<T, true>,
                                                              THREADS, kSmemBytes));
  MG_CHECK(blocks > 0, "grouped GEMM kernel cannot be resident (", kSmemBytes, " bytes of shared memory)");
  return blocks;
}

}  // namespace

int prepare_grouped_gemm(DType dtype) {
  return dtype == DType::kFP16 ? prepare<__half>() : prepare<__nv_bfloat16>();
}

void launch_ragged_gemm(DType dtype, RaggedGemmKind kind, const RaggedGemmParams& p, int grid,
                        cudaStream_t stream) {
  MG_CHECK(p.num_groups >= 1 && p.num_groups <= kMaxGroups, "num_groups must be in [1, ", kMaxGroups,
           "], got ", p.num_groups);
  if (dtype == DType::kFP16) launch_ragged<__half>(kind, p, grid, stream);
  else launch_ragged<__nv_bfloat16>(kind, p, grid, stream);
}

void launch_grouped_wgrad(DType dtype, const WgradParams& p, int grid, cudaStream_t stream) {
  MG_CHECK((p.dweight == nullptr) != (p.main_grad == nullptr),
           "wgrad needs exactly one of dweight and main_grad");
  if (dtype == DType::kFP16) launch_wgrad<__half>(p, grid, stream);
  else launch_wgrad<__nv_bfloat16>(p, grid, stream);
}

}  // namespace moegraph::kernels
