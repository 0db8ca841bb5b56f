// The GoogleTest adapter of the verification library (src/verify): its names in moegraph::test,
// and its comparison results as assertions.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "src/verify/data.hpp"
#include "src/verify/problem.hpp"

namespace moegraph::test {

using namespace ::moegraph::verify;

inline ::testing::AssertionResult passed(const CompareResult& result) {
  if (result.ok) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << result.message;
}

// Every output of `set` against the fp64 reference, each its own expectation.
inline void expect_matches_reference(const Problem& p, OutputSet set, const std::string& where) {
  for (const CompareResult& result : p.check(set, where)) EXPECT_TRUE(passed(result));
}

}  // namespace moegraph::test
