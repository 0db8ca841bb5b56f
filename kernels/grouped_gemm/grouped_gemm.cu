// Instantiates exactly the kernels that are used, for bf16 and fp16: fprop, dgrad and wgrad on
// wgmma (sm_90a), and the same three on the foundation WMMA kernels (the reference path).
#include <cstdlib>
#include <sstream>
#include <type_traits>

#include "kernels/grouped_gemm/grouped_gemm_tma.hpp"
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
const char* pipeline_name(GemmPipeline p) { return p == GemmPipeline::kTma ? "tma" : "cp_async"; }

GemmTileConfig wgmma_tile_config(int tile_n, GemmPipeline pipeline) {
  namespace w = wgmma_gemm;
  if (pipeline == GemmPipeline::kTma) return tma_tile_config(tile_n);
  return tile_n == 256 ? GemmTileConfig{"wgmma_cp_async_sw128", w::BM, 256, w::BK, w::Tile256::STAGES, w::THREADS}
                       : GemmTileConfig{"wgmma_cp_async_sw128", w::BM, 128, w::BK, w::Tile128::STAGES, w::THREADS};
}

GemmPipeline choose_pipeline(GemmPhase phase, int tile_n) {
  if (const char* env = std::getenv("MOEGRAPH_GEMM_PIPELINE")) {
    const std::string v = env;
    MG_CHECK(v == "tma" || v == "cp_async", "MOEGRAPH_GEMM_PIPELINE must be tma or cp_async, got '", v, "'");
    return v == "tma" ? GemmPipeline::kTma : GemmPipeline::kCpAsync;
  }
  // Measured (docs/PERF.md, v5): TMA wins or ties everywhere except wgrad on the narrow tiles (small
  // experts, e.g. decode: 1.49 against 0.93 ms), whose many short tiles are epilogue-bound; the
  // cp.async kernel runs two CTAs per SM there, so one CTA's epilogue hides under the other's loads.
  return phase == GemmPhase::kWgrad && tile_n == 128 ? GemmPipeline::kCpAsync : GemmPipeline::kTma;
}

int choose_tile_n(GemmPhase phase, int groups, int64_t capacity_rows, int64_t n, int64_t k) {
  if (const char* env = std::getenv("MOEGRAPH_TILE_N")) {
    const int forced = std::atoi(env);
    MG_CHECK(forced == 128 || forced == 256, "MOEGRAPH_TILE_N must be 128 or 256, got '", env, "'");
    return forced;
  }
  // The wide tile pays off when every expert holds many rows (full tiles along M, long wgrad
  // reductions) and the output is wide; small or memory-bound problems want two CTAs per SM.
  // (v5, docs/PERF.md: the FC1 kernel bench alone preferred wide TMA tiles for Qwen3's 256 rows per
  // expert too, but the whole Qwen3 step got slower with them, 4.52 -> 5.22 ms: kept as is.)
  const int64_t rows_per_group = capacity_rows / groups;
  const int64_t out_cols = phase == GemmPhase::kFprop ? n : k;
  return rows_per_group >= 512 && out_cols >= 2048 ? 256 : 128;
}

namespace {

// Resident CTAs per SM of each kernel, found by prepare() before any capture; launches read them.
struct Occupancy {
  int fprop = 0, dgrad = 0, wgrad = 0;              // wgmma, 128-wide tiles
  int fprop256 = 0, dgrad256 = 0, wgrad256 = 0;     // wgmma, 256-wide tiles
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
constexpr DType dtype_of() { return std::is_same_v<T, __half> ? DType::kFP16 : DType::kBF16; }

template <class T, class Shape>
void launch_ragged_wgmma(bool fprop, const RaggedGemmParams& p, int grid, cudaStream_t stream) {
  if (fprop) w::ragged_gemm_kernel<T, Shape, false><<<grid, w::THREADS, Shape::kSmemBytes, stream>>>(p);
  else w::ragged_gemm_kernel<T, Shape, true><<<grid, w::THREADS, Shape::kSmemBytes, stream>>>(p);
}

template <class T>
void launch_ragged(RaggedGemmKind kind, const RaggedGemmParams& p, int sm_count, const Occupancy& occ,
                   cudaStream_t stream) {
  MG_CHECK(p.reference || p.tile_n == 128 || p.tile_n == 256, "tile_n must be 128 or 256, got ", p.tile_n);
  const bool fprop = kind == RaggedGemmKind::kFprop;
  if (p.reference && fprop) ragged_gemm_kernel<T, true><<<sm_count * occ.ref_fprop, THREADS, kSmemBytes, stream>>>(p);
  else if (p.reference) ragged_gemm_kernel<T, false><<<sm_count * occ.ref_dgrad, THREADS, kSmemBytes, stream>>>(p);
  else if (p.pipeline == GemmPipeline::kTma) launch_ragged_gemm_tma(dtype_of<T>(), kind, p, sm_count, stream);
  else if (p.tile_n == 256) launch_ragged_wgmma<T, w::Tile256>(fprop, p, sm_count * (fprop ? occ.fprop256 : occ.dgrad256), stream);
  else launch_ragged_wgmma<T, w::Tile128>(fprop, p, sm_count * (fprop ? occ.fprop : occ.dgrad), stream);
  MG_LAUNCH_CHECK();
}

template <class T>
void launch_wgrad(const WgradParams& p, int sm_count, const Occupancy& occ, cudaStream_t stream) {
  MG_CHECK(p.reference || p.tile_n == 128 || p.tile_n == 256, "tile_n must be 128 or 256, got ", p.tile_n);
  if (p.reference) {
    grouped_wgrad_kernel<T><<<sm_count * occ.ref_wgrad, THREADS, kSmemBytes, stream>>>(p);
  } else if (p.pipeline == GemmPipeline::kTma) {
    launch_grouped_wgrad_tma(dtype_of<T>(), p, sm_count, stream);
  } else if (p.tile_n == 256) {
    w::grouped_wgrad_kernel<T, w::Tile256><<<sm_count * occ.wgrad256, w::THREADS, w::Tile256::kSmemBytes, stream>>>(p);
  } else {
    w::grouped_wgrad_kernel<T, w::Tile128><<<sm_count * occ.wgrad, w::THREADS, w::Tile128::kSmemBytes, stream>>>(p);
  }
  MG_LAUNCH_CHECK();
}

template <class T>
void prepare(Occupancy& o) {
  using S1 = w::Tile128;
  using S2 = w::Tile256;
  o.fprop = allow_and_measure(w::ragged_gemm_kernel<T, S1, false>, S1::kSmemBytes, w::THREADS);
  o.dgrad = allow_and_measure(w::ragged_gemm_kernel<T, S1, true>, S1::kSmemBytes, w::THREADS);
  o.wgrad = allow_and_measure(w::grouped_wgrad_kernel<T, S1>, S1::kSmemBytes, w::THREADS);
  o.fprop256 = allow_and_measure(w::ragged_gemm_kernel<T, S2, false>, S2::kSmemBytes, w::THREADS);
  o.dgrad256 = allow_and_measure(w::ragged_gemm_kernel<T, S2, true>, S2::kSmemBytes, w::THREADS);
  o.wgrad256 = allow_and_measure(w::grouped_wgrad_kernel<T, S2>, S2::kSmemBytes, w::THREADS);
  o.ref_fprop = allow_and_measure(ragged_gemm_kernel<T, true>, kSmemBytes, THREADS);
  o.ref_dgrad = allow_and_measure(ragged_gemm_kernel<T, false>, kSmemBytes, THREADS);
  o.ref_wgrad = allow_and_measure(grouped_wgrad_kernel<T>, kSmemBytes, THREADS);
}

}  // namespace

void prepare_grouped_gemm(DType dtype) {
  Occupancy& o = g_occupancy[dtype_index(dtype)];
  if (dtype == DType::kFP16) prepare<__half>(o);
  else prepare<__nv_bfloat16>(o);
  prepare_tma_gemm(dtype);
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
