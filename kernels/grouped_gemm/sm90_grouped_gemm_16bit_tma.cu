// The warp-specialized TMA kernels (sm_90a; bf16 and fp16; fprop, dgrad, wgrad; 128- and 256-wide
// tiles), and their tensor maps (sm90_tensor_maps.hpp: the encoder is kept in the plan).
#include <algorithm>
#include <type_traits>

#include "kernels/common/dtype_dispatch.cuh"
#include "kernels/common/kernel_setup.cuh"
#include "kernels/grouped_gemm/gemm_families.hpp"
#include "kernels/grouped_gemm/sm90_grouped_gemm_16bit_tma.cuh"
#include "kernels/grouped_gemm/sm90_tensor_maps.hpp"
#include "moegraph/error.hpp"

namespace moegraph::kernels {

namespace {

namespace t = tma_gemm;

// Rows [capacity, cols] of the plan's 16-bit type with a box of box_rows x 64 columns.
CUtensorMap rows_map(const GemmPlan& plan, const void* base, int64_t capacity, int64_t cols, uint32_t box_rows) {
  return encode_rows_map(plan.encode_tensor_map, tensor_map_type_16bit(plan.config.dtype), 2, base, capacity, cols,
                         64, box_rows);
}
// W [G][N][K] with a box of box_k K x box_n N x 1 (fp32 elements when f32).
CUtensorMap weight_map(const GemmPlan& plan, const void* w, int64_t groups, int64_t n, int64_t k, uint32_t box_n,
                       uint32_t box_k = 64, bool f32 = false) {
  return encode_grouped_map(plan.encode_tensor_map,
                            f32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : tensor_map_type_16bit(plan.config.dtype),
                            f32 ? 4 : 2, w, groups, n, k, box_k, box_n);
}

// Calls f(T{}, Tile{}) for the plan's 16-bit type and tile shape.
template <class F>
void with_kernel_types(const GemmConfig& config, F&& f) {
  with_16bit_type(config.dtype, "TMA grouped GEMM", [&](auto t) {
    if (config.ping_pong) f(t, t::TilePingPong{});
    else if (config.block_n == 256) f(t, t::Tile256{});
    else f(t, t::Tile128{});
  });
}

template <class Tile>
constexpr bool kPingPong = std::is_same_v<Tile, t::TilePingPong>;

template <class Tile>
GemmConfig config_of(GemmPhase phase, DType dtype, bool ping_pong = false) {
  GemmConfig c{phase, GemmFamily::kTma16, dtype, t::BM, Tile::BN, t::BK, Tile::STAGES, t::THREADS};
  c.ping_pong = ping_pong;
  return c;
}

}  // namespace

GemmConfig tma_gemm_config(GemmPhase phase, DType dtype, int tile_n, bool ping_pong, bool into_main_grad) {
  if (ping_pong) {
    MG_CHECK(phase == GemmPhase::kWgrad && tile_n == 128, "ping-pong consumers are a 128-wide wgrad kernel");
    GemmConfig c = into_main_grad ? config_of<t::TilePingPongMainGrad>(phase, dtype, true)
                                  : config_of<t::TilePingPong>(phase, dtype, true);
    c.into_main_grad = into_main_grad;
    return c;
  }
  return tile_n == 256 ? config_of<t::Tile256>(phase, dtype) : config_of<t::Tile128>(phase, dtype);
}

int prepare_tma_gemm(const GemmConfig& config, void** encode_tensor_map) {
  *encode_tensor_map = tensor_map_encoder();
  int blocks = 0;
  with_kernel_types(config, [&](auto e, auto tile) {
    using T = decltype(e);
    using Tile = decltype(tile);
    auto measure = [&](auto kernel) { blocks = allow_smem_and_measure(kernel, t::THREADS, Tile::kSmemBytes); };
    switch (config.phase) {
      case GemmPhase::kFprop:
        if constexpr (!kPingPong<Tile>) measure(t::ragged_gemm_ws_kernel<T, Tile, false>);
        break;
      case GemmPhase::kDgrad:
        if constexpr (!kPingPong<Tile>) measure(t::ragged_gemm_ws_kernel<T, Tile, true>);
        break;
      case GemmPhase::kWgrad:
        if constexpr (kPingPong<Tile>) {  // into dW and into main_grad: the same occupancy (one CTA per SM)
          measure(t::grouped_wgrad_pingpong_kernel<T>);
          blocks = std::min(blocks, allow_smem_and_measure(t::grouped_wgrad_pingpong_main_grad_kernel<T>, t::THREADS,
                                                           t::TilePingPongMainGrad::kSmemBytes));
        } else {
          measure(t::grouped_wgrad_ws_kernel<T, Tile>);
        }
        break;
    }
  });
  return blocks;
}

void launch_tma_gemm(const GemmPlan& plan, const RaggedGemmParams& p, cudaStream_t stream) {
  MG_CHECK(p.capacity_rows > 0, "the TMA grouped GEMM needs capacity_rows");
  const bool dgrad = plan.config.phase == GemmPhase::kDgrad;
  with_kernel_types(plan.config, [&](auto e, auto tile) {
    using T = decltype(e);
    using Tile = decltype(tile);
    t::RaggedTmaParams tp;
    tp.p = p;
    tp.a = rows_map(plan, p.a, p.capacity_rows, dgrad ? p.n : p.k, t::kBoxRows);
    tp.b = weight_map(plan, p.w, p.num_groups, p.n, p.k, dgrad ? 64u : static_cast<uint32_t>(Tile::BN));
    tp.c = rows_map(plan, p.c, p.capacity_rows, dgrad ? p.k : p.n, t::kBoxRows);
    if constexpr (kPingPong<Tile>) MG_FAIL("ping-pong consumers are a wgrad kernel");
    else if (dgrad) t::ragged_gemm_ws_kernel<T, Tile, true><<<plan.grid, t::THREADS, Tile::kSmemBytes, stream>>>(tp);
    else t::ragged_gemm_ws_kernel<T, Tile, false><<<plan.grid, t::THREADS, Tile::kSmemBytes, stream>>>(tp);
  });
  MG_LAUNCH_CHECK();
}

void launch_tma_wgrad(const GemmPlan& plan, const WgradParams& p, cudaStream_t stream) {
  MG_CHECK(p.capacity_rows > 0, "the TMA grouped GEMM needs capacity_rows");
  with_kernel_types(plan.config, [&](auto e, auto tile) {
    using T = decltype(e);
    using Tile = decltype(tile);
    t::WgradTmaParams tp;
    tp.p = p;
    tp.dy = rows_map(plan, p.dy, p.capacity_rows, p.n, 64);
    tp.x = rows_map(plan, p.x, p.capacity_rows, p.k, 64);
    // The result in boxes of 64 rows x 128 bytes (store_boxes, and the ping-pong main_grad ring).
    tp.out = p.main_grad != nullptr ? weight_map(plan, p.main_grad, p.num_groups, p.n, p.k, t::kBoxRows, 32, true)
                                    : weight_map(plan, p.dweight, p.num_groups, p.n, p.k, t::kBoxRows);
    if constexpr (kPingPong<Tile>) {
      if (p.main_grad != nullptr)
        t::grouped_wgrad_pingpong_main_grad_kernel<T>
            <<<plan.grid, t::THREADS, t::TilePingPongMainGrad::kSmemBytes, stream>>>(tp);
      else t::grouped_wgrad_pingpong_kernel<T><<<plan.grid, t::THREADS, Tile::kSmemBytes, stream>>>(tp);
    } else {
      t::grouped_wgrad_ws_kernel<T, Tile><<<plan.grid, t::THREADS, Tile::kSmemBytes, stream>>>(tp);
    }
  });
  MG_LAUNCH_CHECK();
}

}  // namespace moegraph::kernels
