// The GoogleTest adapter of the verification library (testing/): its names in moegraph::test,
// its comparison results as assertions, and the small host helpers the GPU suites share.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "testing/data.hpp"
#include "testing/device_array.hpp"
#include "testing/problem.hpp"

namespace moegraph::test {

using namespace ::moegraph::testing;

inline ::testing::AssertionResult passed(const CompareResult& result) {
  if (result.ok) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << result.message;
}

// Device 16-bit patterns of type `t` as values.
inline Mat from_bits16(const std::vector<uint16_t>& bits, DType t) {
  Mat out(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) out[i] = from_bits(bits[i], t);
  return out;
}

// A device array's values: 16-bit patterns of type `t`, or fp32.
inline Mat download_bits(const DeviceArray<uint16_t>& a, DType t) { return from_bits16(a.download(), t); }
inline Mat download_floats(const DeviceArray<float>& a) {
  const auto v = a.download();
  return Mat(v.begin(), v.end());
}

// Bit-for-bit equality: rows past the last group are never written and keep their NaN poison,
// which must compare equal to itself here.
inline bool same_bits(const Mat& a, const Mat& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) return false;
  return true;
}

// Every output of `set` against the fp64 reference, each its own expectation.
inline void expect_matches_reference(const Problem& p, OutputSet set, const std::string& where) {
  for (const CompareResult& result : p.check(set, where)) EXPECT_TRUE(passed(result));
}

}  // namespace moegraph::test
