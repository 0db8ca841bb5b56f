// Test data: seeded random values rounded to the device type, routings, and the comparison
// against the fp64 reference with the per-dtype tolerance table.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "moegraph/types.hpp"
#include "tests/common/reference.hpp"

namespace moegraph::test {

// Host conversions between fp64 values and device 16-bit patterns (round to nearest even).
uint16_t to_bits(double v, DType t);
double from_bits(uint16_t bits, DType t);
inline double round_to(double v, DType t) { return from_bits(to_bits(v, t), t); }

// The seed of a test: MOEGRAPH_TEST_SEED if set, else a fixed default; always printed.
uint64_t test_seed(const std::string& test_name);

// Uniform values in [-scale, scale], never all zero, rounded to `t` (fp32 for kFP32).
std::vector<double> random_values(std::mt19937_64& rng, std::size_t count, double scale, DType t);
std::vector<uint16_t> to_device_bits(const std::vector<double>& v, DType t);

enum class Routing { kUniform, kSkewed };
// Random splits summing to `rows` (some groups may be empty; kSkewed follows a Zipf law).
std::vector<int32_t> random_splits(std::mt19937_64& rng, int groups, int64_t rows, Routing routing);
// Layout of `splits` with `row_align`, in a buffer of `capacity_rows` rows (the splits must fit).
GroupLayout make_layout(const std::vector<int32_t>& splits, int row_align, int64_t capacity_rows);

// Maximum error allowed by output type: |got - ref| <= rtol * |ref| + atol * rms(ref), and the
// relative Frobenius error <= rel_fro. NaN never passes.
struct Tolerance {
  double rtol, atol, rel_fro;
};
Tolerance tolerance_for(DType output);

// Compares `got` to `ref` on the rows (of width `cols`) where mask is true (empty mask: all).
::testing::AssertionResult all_close(const std::string& what, const std::vector<double>& got,
                                     const std::vector<double>& ref, int64_t cols, const std::vector<bool>& mask,
                                     Tolerance tol);
// ||got - ref|| / ||ref|| over the masked rows.
double relative_error(const std::vector<double>& got, const std::vector<double>& ref, int64_t cols,
                      const std::vector<bool>& mask);

}  // namespace moegraph::test
