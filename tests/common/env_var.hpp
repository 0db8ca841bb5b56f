// An environment variable set for a scope and restored after it (the GEMM overrides are read from
// the environment when a config is chosen, at an operator's construction).
#pragma once

#include <cstdlib>
#include <string>

namespace moegraph::test {

class EnvVar {
 public:
  EnvVar(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    setenv(name, value, 1);
  }
  ~EnvVar() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1);
    else unsetenv(name_.c_str());
  }
  EnvVar(const EnvVar&) = delete;
  EnvVar& operator=(const EnvVar&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

}  // namespace moegraph::test
