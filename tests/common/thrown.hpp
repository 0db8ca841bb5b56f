// The error text a call throws, for tests that compare it with another API's report.
#pragma once

#include <string>

#include "moegraph/error.hpp"

namespace moegraph::test {

// what() of the moegraph::Error f() throws (the message with file and line, as mg_last_error gives
// it), or "(no error)" when it returns.
template <class F>
std::string thrown_what(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// The same, the message alone.
template <class F>
std::string thrown_message(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  return "(no error)";
}

}  // namespace moegraph::test
