#include "testing/legacy_loop.hpp"

#include "moegraph/error.hpp"
#include "src/ops/group_layout.hpp"

namespace moegraph {

LegacyExpertLoop::LegacyExpertLoop(int num_groups, int64_t n, int64_t k, int64_t capacity_rows, int row_align,
                                   DType dtype)
    : g_(num_groups), n_(n), k_(k), capacity_(capacity_rows), row_align_(row_align), dtype_(dtype),
      host_splits_(num_groups) {}

const std::vector<int64_t>& LegacyExpertLoop::read_splits(const int32_t* splits, cudaStream_t stream) {
  MG_CUDA_CHECK(cudaMemcpyAsync(host_splits_.data(), splits, g_ * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));
  HostOffsets h = host_group_offsets(host_splits_, row_align_, capacity_);
  MG_CHECK(h.error.code == 0, "invalid splits: ", describe_device_error(h.error, row_align_));
  host_offsets_ = std::move(h.offsets);
  return host_offsets_;
}

void LegacyExpertLoop::fprop_not_capturable(const void* x, const int32_t* splits, const void* weight, void* y,
                                            cudaStream_t stream) {
  const auto& off = read_splits(splits, stream);
  const std::size_t es = dtype_size(dtype_);
  for (int e = 0; e < g_; ++e) {
    RowMajorGemm g;
    g.trans_b = true;
    g.m = host_splits_[e], g.n = n_, g.k = k_;
    g.a = static_cast<const char*>(x) + off[e] * k_ * es, g.lda = k_;
    g.b = static_cast<const char*>(weight) + e * n_ * k_ * es, g.ldb = k_;
    g.c = static_cast<char*>(y) + off[e] * n_ * es, g.ldc = n_;
    g.ab_type = g.c_type = dtype_;
    lt_.run(g, stream);
  }
}

void LegacyExpertLoop::dgrad_not_capturable(const void* dy, const int32_t* splits, const void* weight, void* dx,
                                            cudaStream_t stream) {
  const auto& off = read_splits(splits, stream);
  const std::size_t es = dtype_size(dtype_);
  for (int e = 0; e < g_; ++e) {
    RowMajorGemm g;
    g.m = host_splits_[e], g.n = k_, g.k = n_;
    g.a = static_cast<const char*>(dy) + off[e] * n_ * es, g.lda = n_;
    g.b = static_cast<const char*>(weight) + e * n_ * k_ * es, g.ldb = k_;
    g.c = static_cast<char*>(dx) + off[e] * k_ * es, g.ldc = k_;
    g.ab_type = g.c_type = dtype_;
    lt_.run(g, stream);
  }
}

void LegacyExpertLoop::wgrad_not_capturable(const void* dy, const void* x, const int32_t* splits, void* dweight,
                                            float* main_grad, cudaStream_t stream) {
  MG_CHECK((dweight == nullptr) != (main_grad == nullptr), "wgrad needs exactly one of dweight and main_grad");
  const auto& off = read_splits(splits, stream);
  const std::size_t es = dtype_size(dtype_);
  for (int e = 0; e < g_; ++e) {
    const std::size_t out_es = main_grad != nullptr ? sizeof(float) : es;
    char* out = main_grad != nullptr ? reinterpret_cast<char*>(main_grad) : static_cast<char*>(dweight);
    out += e * n_ * k_ * out_es;
    if (host_splits_[e] == 0) {
      if (main_grad == nullptr) MG_CUDA_CHECK(cudaMemsetAsync(out, 0, n_ * k_ * es, stream));
      continue;
    }
    RowMajorGemm g;
    g.trans_a = true;
    g.m = n_, g.n = k_, g.k = host_splits_[e];
    g.a = static_cast<const char*>(dy) + off[e] * n_ * es, g.lda = n_;
    g.b = static_cast<const char*>(x) + off[e] * k_ * es, g.ldb = k_;
    g.c = out, g.ldc = k_;
    g.ab_type = dtype_;
    g.c_type = main_grad != nullptr ? DType::kFP32 : dtype_;
    g.beta = main_grad != nullptr ? 1.0f : 0.0f;
    lt_.run(g, stream);
  }
}

}  // namespace moegraph
