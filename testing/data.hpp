// Verification data: seeded random values rounded to the device type, routings, layouts, and the
// comparison against the fp64 reference with the per-dtype tolerance table. Free of any test
// framework: the GoogleTest suites (through tests/common/expect.hpp) and moegraph-check share it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moegraph/types.hpp"
#include "testing/reference.hpp"

namespace moegraph::testing {

// Host conversions between fp64 values and device 16-bit patterns (round to nearest even).
uint16_t to_bits(double v, DType t);
double from_bits(uint16_t bits, DType t);
inline double round_to(double v, DType t) { return from_bits(to_bits(v, t), t); }

// The seed of a test: MOEGRAPH_TEST_SEED if set, else a fixed default; always printed.
uint64_t test_seed(const std::string& test_name);

// Uniform values in [-scale, scale], never all zero, rounded to `t` (fp32 for kFP32).
std::vector<double> random_values(std::mt19937_64& rng, std::size_t count, double scale, DType t);
std::vector<uint16_t> to_device_bits(const std::vector<double>& v, DType t);
// Per-row weights (e.g. routing weights) uniform in [0.05, 1) on the rows of `l` that hold data, NaN
// on every other row (alignment gaps, padding): a kernel that reads a row without data turns NaN.
std::vector<float> data_row_weights(std::mt19937_64& rng, const GroupLayout& l);
// Integers in [-range, range] times `step`, the first always `step`. x and a router weight on such
// grids make every product and fp32 partial sum of the logits exact: the device and the reference
// see identical logits and make identical top-k choices (ties to the lower id on both sides)
// instead of disagreeing on near-ties.
std::vector<double> grid_values(std::mt19937_64& rng, std::size_t count, int range, double step);

enum class Routing { kUniform, kSkewed };
// The Zipf exponent of Routing::kSkewed.
inline constexpr double kDefaultSkew = 1.2;
// Random splits summing to `rows` (some groups may be empty). Each row picks a group with weight
// 1 / (rank + 1)^zipf_exponent over a shuffled ranking of the groups; exponent 0 is uniform.
std::vector<int32_t> random_splits(std::mt19937_64& rng, int groups, int64_t rows, double zipf_exponent);
inline std::vector<int32_t> random_splits(std::mt19937_64& rng, int groups, int64_t rows, Routing routing) {
  return random_splits(rng, groups, rows, routing == Routing::kSkewed ? kDefaultSkew : 0.0);
}
// Layout of `splits` with `row_align`, in a buffer of `capacity_rows` rows (the splits must fit).
GroupLayout make_layout(const std::vector<int32_t>& splits, int row_align, int64_t capacity_rows);

// Maximum error allowed by output type: |got - ref| <= rtol * |ref| + atol * rms(ref), and the
// relative Frobenius error <= rel_fro. NaN never passes.
struct Tolerance {
  double rtol, atol, rel_fro;
};
Tolerance tolerance_for(DType output);
// Outputs of a chain of operators whose intermediates are stored in `storage` (e.g. FC1 -> SwiGLU
// -> FC2 in bf16): the reference rounds the same intermediates, but a one-ulp difference in one
// stored element moves every output it feeds, so single elements get a wider band while the
// relative Frobenius error keeps the single-GEMM limit.
Tolerance chain_tolerance_for(DType storage);
// bf16 outputs of an MXFP8 GEMM: the FP8 tensor cores sum each 32-wide block's products with fewer
// bits than fp32 (why the kernel promotes every block into fp32), so a single element whose terms
// cancel sees a larger error than a bf16 GEMM; the relative Frobenius error keeps the bf16 limit.
Tolerance mxfp8_gemm_tolerance();
// Outputs of a chain of MXFP8 GEMMs with 16-bit intermediates (the MoE layer, mxfp8 recipe: FC1 ->
// SwiGLU -> FC2 and back), against a reference that quantizes the same operands at the same points
// (ref_moe_layer). What is left is the device's accumulation (fp32, each 32-wide block summed with
// fewer bits on the FP8 tensor cores) and 16-bit rounding, as with bf16, with one amplifier: a
// stored intermediate one 16-bit ulp (2^-8) away from the reference's lands on the other side of
// an E4M3 rounding boundary about once in 16 when the next GEMM quantizes it, and then differs by
// one E4M3 step (3 mantissa bits: 2^-3 of its binade). Sparse, but an output that sums few such
// terms (the weight gradient of an expert with one or two rows) moves by up to a step of its
// largest term: rtol 2^-3, and atol 1 rms for sums whose terms cancel (rms over the whole tensor,
// the zeros of empty experts included). The relative Frobenius error is the bound that tells the
// recipes apart. In a host emulation of the device's accumulation (32-wide block sums truncated to
// 12..14 bits below the block's largest product, promoted into fp32) on layers of 1 to 256 tokens
// and 8 to 64 experts, it stayed below 9e-3 (4.3e-3 at 14 bits), and the worst element needed atol
// 0.41 (two rows of an expert whose terms cancelled: one term's step flipped the sign); a reference
// or a device that skips the quantization (every operand element up to 2^-4 off) differs by 3.0e-2
// to 7e-2 in y, dx, dw1 and dw2. rel_fro 1.5e-2 keeps a factor of about two from each.
Tolerance mxfp8_chain_tolerance();
// The tolerance of the MoE layer's outputs under a recipe: chain_tolerance_for(storage) for bf16,
// mxfp8_chain_tolerance() for mxfp8.
Tolerance layer_tolerance_for(DType storage, Recipe recipe);

// The outcome of one comparison; the caller decides how to report it (gtest, a CLI line).
struct CompareResult {
  bool ok = true;
  std::string message;               // empty when ok: what failed and where, the first bad element
  double rel_fro = 0.0;              // ||got - ref|| / ||ref|| over the compared rows
  std::size_t out_of_tolerance = 0;  // elements failing the element-wise bound
  std::size_t compared = 0;          // elements compared
};

// Compares `got` to `ref` on the rows (of width `cols`) where mask is true (empty mask: all).
CompareResult all_close(const std::string& what, const std::vector<double>& got, const std::vector<double>& ref,
                        int64_t cols, const std::vector<bool>& mask, Tolerance tol);
// ||got - ref|| / ||ref|| over the masked rows.
double relative_error(const std::vector<double>& got, const std::vector<double>& ref, int64_t cols,
                      const std::vector<bool>& mask);

}  // namespace moegraph::testing
