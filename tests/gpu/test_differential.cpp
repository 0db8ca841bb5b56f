// Differential tests: the grouped kernels against the per-expert cuBLASLt loop (the legacy way),
// and the error budget of DESIGN.md: on the same data, our error against fp64 stays within a small
// multiple of a plain cuBLASLt bf16 GEMM's error.
#include <gtest/gtest.h>

#include "testing/legacy_loop.hpp"
#include "tests/common/expect.hpp"

namespace moegraph::test {
namespace {

struct DiffCase {
  std::string name;
  Routing routing;
  bool main_grad;
};

class Differential : public ::testing::TestWithParam<DiffCase> {};

TEST_P(Differential, GroupedMatchesCublasLtLoop) {
  const DiffCase& c = GetParam();
  CaseSpec spec{c.name, 16, 512, 768, DType::kBF16, 1, {}, 4096, c.routing, 0, false, false, c.main_grad};
  Problem p(spec, test_seed(c.name));
  LegacyExpertLoop legacy(spec.groups, spec.n, spec.k, p.layout.capacity_rows, spec.row_align, spec.dtype);
  cudaStream_t stream = nullptr;
  const auto rows = data_rows(p.layout);

  // Ours.
  p.poison_outputs();
  p.op->forward_train(p.forward_args(), stream);
  p.op->backward(p.backward_args(), WgradMode::kImmediate, stream);
  p.op->check_device_errors(stream);
  const auto y = p.download(p.d_y), dx = p.download(p.d_dx);
  const auto dw = spec.main_grad ? to_doubles(p.d_main_grad.download()) : p.download(p.d_dw);

  // cuBLASLt loop, on the same inputs (main_grad restored to its initial value first).
  p.restore_main_grad();
  p.poison_outputs();
  legacy.fprop_not_capturable(p.d_x.get(), p.d_splits.get(), p.d_w.get(), p.d_y.get(), stream);
  legacy.dgrad_not_capturable(p.d_dy.get(), p.d_splits.get(), p.d_w.get(), p.d_dx.get(), stream);
  legacy.wgrad_not_capturable(p.d_dy.get(), p.d_x.get(), p.d_splits.get(),
                              spec.main_grad ? nullptr : p.d_dw.get(),
                              spec.main_grad ? p.d_main_grad.get() : nullptr, stream);
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto y_lt = p.download(p.d_y), dx_lt = p.download(p.d_dx);
  const auto dw_lt = spec.main_grad ? to_doubles(p.d_main_grad.download()) : p.download(p.d_dw);

  // Both against fp64.
  const auto y_ref = ref_fprop(p.layout, p.x, p.w, {}, {}, spec.n, spec.k);
  const auto dx_ref = ref_dgrad(p.layout, p.dy, p.w, spec.n, spec.k);
  auto dw_ref = ref_wgrad(p.layout, p.dy, p.x, spec.n, spec.k);
  if (spec.main_grad)
    for (std::size_t i = 0; i < dw_ref.size(); ++i) dw_ref[i] += p.main_grad_init[i];

  struct Row {
    const char* what;
    const std::vector<double>& ours;
    const std::vector<double>& lt;
    const std::vector<double>& ref;
    int64_t cols;
    std::vector<bool> mask;
  };
  const Row table[] = {{"fprop", y, y_lt, y_ref, spec.n, rows},
                       {"dgrad", dx, dx_lt, dx_ref, spec.k, rows},
                       {"wgrad", dw, dw_lt, dw_ref, spec.k, {}}};
  for (const Row& r : table) {
    const double ours = relative_error(r.ours, r.ref, r.cols, r.mask);
    const double lt = relative_error(r.lt, r.ref, r.cols, r.mask);
    std::printf("[ error    ] %-6s ours %.3e  cuBLASLt %.3e\n", r.what, ours, lt);
    EXPECT_LE(ours, 1.5 * lt + 1e-7) << r.what << ": grouped error exceeds 1.5x the cuBLASLt error";
    const Tolerance tol = tolerance_for(spec.main_grad && std::string(r.what) == "wgrad" ? DType::kFP32 : spec.dtype);
    EXPECT_TRUE(passed(all_close(std::string(r.what) + " vs cuBLASLt loop", r.ours, r.lt, r.cols, r.mask, tol)));
  }
}

INSTANTIATE_TEST_SUITE_P(Routings, Differential,
                         ::testing::Values(DiffCase{"uniform_bf16_out", Routing::kUniform, false},
                                           DiffCase{"skewed_bf16_out", Routing::kSkewed, false},
                                           DiffCase{"skewed_main_grad", Routing::kSkewed, true}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace moegraph::test
