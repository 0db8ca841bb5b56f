// fp64 reference of the expert-MLP step: FC1 (N = 2 * ffn) -> SwiGLU -> FC2 and its backward.
// Intermediates the device stores (FC1 output, SwiGLU output, their gradients) are rounded to the
// device type here too, so the comparison measures the kernels, not the storage format.
#pragma once

#include "moegraph/types.hpp"
#include "testing/reference.hpp"

namespace moegraph::testing {

struct ExpertMlpInputs {
  const Mat* x;   // [rows, hidden]
  const Mat* w1;  // [G, 2 * ffn, hidden]
  const Mat* b1;  // [G, 2 * ffn] or empty
  const Mat* w2;  // [G, hidden, ffn]
  const Mat* b2;  // [G, hidden] or empty
  const Mat* dy;  // [rows, hidden] or null (forward only)
  int64_t hidden, ffn;
  DType dtype;
};

struct ExpertMlpReference {
  Mat y;                   // [rows, hidden]
  Mat dx;                  // [rows, hidden]
  Mat dw1, dw2, db1, db2;  // gradients of the parameters
};

ExpertMlpReference ref_expert_mlp(const GroupLayout& layout, const ExpertMlpInputs& in);

}  // namespace moegraph::testing
