// Shared by the libFuzzer targets (built by scripts/fuzz, not by Meson). A finding must stop the
// run with a message, so libFuzzer keeps the input: abort() is what it watches for.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

namespace moegraph::fuzz {

[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "FUZZ FINDING: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// For targets where no exception at all is an acceptable answer.
struct NothingExpected {};

// Runs `parse`; `Expected` is the one exception type that means "bad input, cleanly refused".
// Any other exception escaping is a finding (a crash or a sanitizer report stops the run by itself).
template <class Expected, class F>
void expect_only(const char* target, F&& parse) {
  try {
    parse();
  } catch (const Expected&) {
  } catch (const std::exception& e) {
    finding(std::string(target) + ": unexpected exception escaped: " + e.what());
  } catch (...) {
    finding(std::string(target) + ": a non-std exception escaped");
  }
}

}  // namespace moegraph::fuzz
