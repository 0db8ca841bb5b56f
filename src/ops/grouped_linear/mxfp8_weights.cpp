// The public MXFP8 weight quantizer (moegraph/mxfp8_weights.hpp): checks the caller's sizes and
// pointers, then runs the recipe's own weight quantizer (kernels/quantize), so prequantized and
// self-quantized weights are the same bytes.
#include "moegraph/mxfp8_weights.hpp"

#include <cstdint>
#include <utility>

#include "kernels/common/alignment.hpp"
#include "kernels/quantize/mxfp8.hpp"
#include "moegraph/error.hpp"
#include "moegraph/grouped_linear.hpp"
#include "src/core/checked.hpp"

namespace moegraph {
namespace {

void check_sizes(int groups, int64_t n, int64_t k) {
  MG_CHECK(groups >= 1 && groups <= kMaxGroups, "MXFP8 weights: groups must be in [1, ", kMaxGroups, "], got ", groups);
  for (const auto& [name, v] : {std::pair{"n", n}, std::pair{"k", k}})
    MG_CHECK(v >= kernels::kMxBlock && v <= kMaxFeatures && v % kernels::kMxBlock == 0, "MXFP8 weights: ", name,
             " must be a multiple of 32 in [32, ", kMaxFeatures, "], got ", v);
}

// A pair of arrays is given whole or not at all.
bool pair_given(const char* data_name, const uint8_t* data, const uint8_t* scales) {
  MG_CHECK((data == nullptr) == (scales == nullptr), "MXFP8 weights: ", data_name, " and its scales come together");
  MG_CHECK(data == nullptr || (kernels::aligned16(data) && kernels::aligned16(scales)), "MXFP8 weights: ", data_name,
           " and its scales must be 16-byte aligned");
  return data != nullptr;
}

// The sizes, and each pair of weights that makes another copy: whole or absent, aligned.
void check_given_pairs(int groups, int64_t n, int64_t k, const Mxfp8Weights& w) {
  check_sizes(groups, n, k);
  pair_given("data", w.data, w.scales);
  pair_given("data_t", w.data_t, w.scales_t);
}

// A dequantized copy needs its pair (already checked whole) and 16-byte alignment.
void check_dequantized(const char* who, const Mxfp8Weights& w) {
  MG_CHECK(w.dequantized == nullptr || w.data != nullptr, who, ": dequantized needs data and scales");
  MG_CHECK(w.dequantized_t == nullptr || w.data_t != nullptr, who, ": dequantized_t needs data_t and scales_t");
  MG_CHECK(kernels::aligned16(w.dequantized) && kernels::aligned16(w.dequantized_t), who,
           ": the dequantized copies must be 16-byte aligned");
}

// A tiled copy of scales needs its pair and 16-byte alignment.
void check_tiled(const char* who, const Mxfp8Weights& w) {
  MG_CHECK(w.scales_tiled == nullptr || w.scales != nullptr, who, ": scales_tiled needs data and scales");
  MG_CHECK(w.scales_t_tiled == nullptr || w.scales_t != nullptr, who, ": scales_t_tiled needs data_t and scales_t");
  MG_CHECK(kernels::aligned16(w.scales_tiled) && kernels::aligned16(w.scales_t_tiled), who,
           ": the tiled scales must be 16-byte aligned");
}

// The tiled scales whose copy is set (scales: N rows along K; scales_t: K rows along N).
void write_tiled(int groups, int64_t n, int64_t k, const Mxfp8Weights& w, cudaStream_t stream) {
  if (w.scales_tiled != nullptr) kernels::launch_tile_mxfp8_scales(w.scales, w.scales_tiled, groups, n, k, stream);
  if (w.scales_t_tiled != nullptr) kernels::launch_tile_mxfp8_scales(w.scales_t, w.scales_t_tiled, groups, k, n, stream);
}

// The values of each pair whose copy is set, by the rule every mxfp8 route multiplies (the staged
// route's dequantizer; the quantizer writes the same values when it makes the codes).
void write_dequantized(int groups, int64_t n, int64_t k, const Mxfp8Weights& w, cudaStream_t stream) {
  if (w.dequantized != nullptr)
    kernels::launch_dequantize_mxfp8_weights(w.data, w.scales, w.dequantized, groups * n, k, stream);
  if (w.dequantized_t != nullptr)
    kernels::launch_dequantize_mxfp8_weights(w.data_t, w.scales_t, w.dequantized_t, groups * k, n, stream);
}

}  // namespace

std::size_t mxfp8_weight_data_bytes(int groups, int64_t n, int64_t k) {
  check_sizes(groups, n, k);
  return checked_mul("MXFP8 weight bytes", groups, n, k);
}

std::size_t mxfp8_weight_scale_bytes(int groups, int64_t n, int64_t k) {
  return mxfp8_weight_data_bytes(groups, n, k) / kernels::kMxBlock;
}

void quantize_mxfp8_weights(DType dtype, const void* w, int groups, int64_t n, int64_t k, const Mxfp8Weights& out,
                            cudaStream_t stream) {
  check_sizes(groups, n, k);
  MG_CHECK(dtype == DType::kBF16 || dtype == DType::kFP16, "quantize_mxfp8_weights: w must be bf16 or fp16, got ",
           dtype_name(dtype));
  MG_CHECK(w != nullptr && kernels::aligned16(w), "quantize_mxfp8_weights: w must be a 16-byte aligned device pointer");
  const bool rows = pair_given("data", out.data, out.scales);
  const bool cols = pair_given("data_t", out.data_t, out.scales_t);
  MG_CHECK(rows || cols, "quantize_mxfp8_weights: nothing to write (give data and scales, data_t and scales_t, or both)");
  check_dequantized("quantize_mxfp8_weights", out);
  check_tiled("quantize_mxfp8_weights", out);
  // The kept bf16 values (dequantized_weights) come from the codes in the same pass.
  const kernels::Mxfp8Rowwise row{out.data, out.scales, static_cast<uint16_t*>(out.dequantized)};
  const kernels::Mxfp8Colwise col{out.data_t, out.scales_t, static_cast<uint16_t*>(out.dequantized_t)};
  kernels::launch_quantize_mxfp8_weights(dtype, w, groups, n, k, rows ? &row : nullptr, cols ? &col : nullptr,
                                         stream);
  write_tiled(groups, n, k, out, stream);
}

void tile_mxfp8_weight_scales(int groups, int64_t n, int64_t k, const Mxfp8Weights& w, cudaStream_t stream) {
  check_given_pairs(groups, n, k, w);
  MG_CHECK(w.scales_tiled != nullptr || w.scales_t_tiled != nullptr,
           "tile_mxfp8_weight_scales: nothing to write (give scales_tiled, scales_t_tiled or both)");
  check_tiled("tile_mxfp8_weight_scales", w);
  write_tiled(groups, n, k, w, stream);
}

std::size_t mxfp8_tiled_scale_bytes(int groups, int64_t n, int64_t k) {
  check_sizes(groups, n, k);  // then the product is far below 2^63: 1024 * 2^14 * 2^14 * 512
  return static_cast<std::size_t>(kernels::mxfp8_tiled_scale_bytes(groups, n, k));
}

void dequantize_mxfp8_weights(int groups, int64_t n, int64_t k, const Mxfp8Weights& w, cudaStream_t stream) {
  check_given_pairs(groups, n, k, w);
  MG_CHECK(w.dequantized != nullptr || w.dequantized_t != nullptr,
           "dequantize_mxfp8_weights: nothing to write (give dequantized, dequantized_t or both)");
  check_dequantized("dequantize_mxfp8_weights", w);
  write_dequantized(groups, n, k, w, stream);
}

std::size_t mxfp8_dequantized_weight_bytes(int groups, int64_t n, int64_t k) {
  return checked_mul("MXFP8 dequantized weight bytes", mxfp8_weight_data_bytes(groups, n, k), 2);
}

}  // namespace moegraph
