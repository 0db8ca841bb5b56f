#include "graphs/sharded_weights.hpp"

#include <algorithm>
#include <sstream>

#include "moegraph/error.hpp"
#include "src/core/checked.hpp"
#include "src/core/device_scope.hpp"
#include "src/ops/group_layout.hpp"

namespace moegraph {

namespace {

// The window: full weights, full gradients, the barrier and the descriptor table, in one walk.
struct WindowLayout {
  void* weights[kernels::kMaxShardTensors] = {};
  void* grads[kernels::kMaxShardTensors] = {};
  uint32_t* flags = nullptr;  // [ranks]
  uint32_t* epoch = nullptr;  // local use
  DeviceErrorRecord* error = nullptr;  // local use
  Shard* table = nullptr;     // [ranks][kMaxShardTensors]
};

DType grad_type(const StepGraphsOptions& o, bool bias) {
  return o.layer.main_grad_fp32 && !bias ? DType::kFP32 : o.layer.dtype;
}
bool is_bias(std::size_t t) { return t >= 2; }

WindowLayout lay_out_window(const StepGraphsOptions& o, LayoutWalker& walk) {
  WindowLayout w;
  const auto shapes = sharded_tensor_shapes(o);
  const std::size_t es = dtype_size(o.layer.dtype);
  for (std::size_t t = 0; t < shapes.size(); ++t)
    w.weights[t] = walk.take(shapes[t].name, shapes[t].global_rows, shapes[t].row_elements, es);
  if (o.layer.training)
    for (std::size_t t = 0; t < shapes.size(); ++t)
      w.grads[t] = walk.take(std::string("grad.") + shapes[t].name, shapes[t].global_rows, shapes[t].row_elements,
                             dtype_size(grad_type(o, is_bias(t))));
  const int ranks = o.sharding.ranks;
  w.flags = walk.take<uint32_t>("shard.flags", ranks, sizeof(uint32_t));
  w.epoch = walk.take<uint32_t>("shard.epoch", sizeof(uint32_t));
  w.error = walk.take<DeviceErrorRecord>("shard.error", sizeof(DeviceErrorRecord));
  w.table = walk.take<Shard>("shard.table", ranks, kernels::kMaxShardTensors, sizeof(Shard));
  return w;
}

}  // namespace

std::vector<ShardedTensorShape> sharded_tensor_shapes(const StepGraphsOptions& o) {
  const MoeLayerOptions& l = o.layer;
  const int64_t g = moe_local_experts(l), f2 = checked_mul("2 * ffn", 2, l.ffn), h = l.hidden, f = l.ffn;
  const bool rows = o.sharding.unit == ShardUnit::kRow;
  // [g, n, k]: g rows of n * k elements, or g * n rows of k.
  const auto shape = [&](const char* name, int64_t n, int64_t k) {
    return rows ? ShardedTensorShape{name, checked_mul(name, g, n), k} : ShardedTensorShape{name, g, checked_mul(name, n, k)};
  };
  std::vector<ShardedTensorShape> out{shape("w1", f2, h), shape("w2", h, f)};
  if (l.bias) out.push_back(shape("b1", f2, 1)), out.push_back(shape("b2", h, 1));
  return out;
}

std::vector<LayoutWalker::Entry> shard_window_layout(const StepGraphsOptions& o) {
  LayoutWalker walk;
  lay_out_window(o, walk);
  return walk.entries();
}

std::size_t shard_window_bytes(const StepGraphsOptions& o) {
  LayoutWalker walk;
  lay_out_window(o, walk);
  return walk.bytes();
}

std::size_t largest_shard_bytes(const StepGraphsOptions& o) {
  std::size_t total = 0;
  const auto shapes = sharded_tensor_shapes(o);
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    const int64_t rows = shard_for(o.sharding.policy, shapes[t].global_rows, o.sharding.ranks, 0).rows;
    const int64_t elements = checked_mul(shapes[t].name, rows, shapes[t].row_elements);
    std::size_t per = dtype_size(o.layer.dtype);
    if (o.layer.training) per += dtype_size(grad_type(o, is_bias(t)));
    total = checked_add("shard bytes", total, checked_mul(shapes[t].name, elements, per));
  }
  return total;
}

struct ShardedWeights::Tensor {
  ShardedTensorShape shape;
  const void* shard = nullptr;  // the caller's weight shard
  void* grad_shard = nullptr;   // the caller's gradient shard (training)
  DType grad_type = DType::kBF16;
  std::size_t weight_offset = 0, grad_offset = 0;  // in the window
  Shard own;
};

ShardedWeights::ShardedWeights(const StepGraphsOptions& options, const StepWeights& shards, std::shared_ptr<EpComm> comm)
    : options_(options), comm_(std::move(comm)), full_(shards) {
  const WeightSharding& s = options_.sharding;
  MG_CHECK(comm_ != nullptr && comm_->ranks() == s.ranks, "sharding.ranks = ", s.ranks,
           ": StepGraphs needs the data-parallel group's communicator of as many ranks (got ",
           comm_ ? comm_->ranks() : 0, ")");
  window_ = comm_->allocate_window(shard_window_bytes(options_));
  char* base = static_cast<char*>(window_->local());
  LayoutWalker walk(reinterpret_cast<std::byte*>(base));
  const WindowLayout w = lay_out_window(options_, walk);
  flags_ = w.flags, epoch_ = w.epoch, error_ = w.error, shared_table_ = w.table;

  const MoeLayerOptions& l = options_.layer;
  const auto shapes = sharded_tensor_shapes(options_);
  const Shard given[] = {shards.shards.w1, shards.shards.w2, shards.shards.b1, shards.shards.b2};
  const void* weight[] = {shards.w1, shards.w2, shards.b1, shards.b2};
  void* grad[] = {l.main_grad_fp32 ? static_cast<void*>(shards.main_grad1) : shards.dw1,
                  l.main_grad_fp32 ? static_cast<void*>(shards.main_grad2) : shards.dw2, shards.db1, shards.db2};
  const auto offset = [&](const void* p) { return static_cast<std::size_t>(static_cast<const char*>(p) - base); };
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    Tensor x;
    x.shape = shapes[t];
    x.shard = weight[t];
    x.grad_shard = l.training ? grad[t] : nullptr;
    x.grad_type = grad_type(options_, is_bias(t));
    x.weight_offset = offset(w.weights[t]);
    x.grad_offset = l.training ? offset(w.grads[t]) : 0;
    x.own = given[t].global_rows > 0 ? given[t] : shard_for(s.policy, x.shape.global_rows, s.ranks, comm_->rank());
    MG_CHECK(x.own.global_rows == x.shape.global_rows, "StepWeights::shards.", x.shape.name, " describes ",
             x.own.global_rows, " rows, but ", x.shape.name, " has ", x.shape.global_rows, " rows of ",
             x.shape.row_elements, " elements (shard unit \"", shard_unit_name(s.unit), "\")");
    MG_CHECK(x.own.rows == 0 || x.shard != nullptr, "StepWeights needs this rank's shard of ", x.shape.name);
    MG_CHECK(x.own.rows == 0 || !l.training || x.grad_shard != nullptr, "StepWeights needs this rank's shard of ",
             x.shape.name, "'s gradient");
    tensors_.push_back(x);
  }
  // The buckets work on the full tensors in the window.
  void** full_weight[] = {reinterpret_cast<void**>(&full_.w1), reinterpret_cast<void**>(&full_.w2), &full_.b1,
                          &full_.b2};
  for (std::size_t t = 0; t < shapes.size(); ++t) *full_weight[t] = w.weights[t];
  if (l.training) {
    if (l.main_grad_fp32) {
      full_.main_grad1 = static_cast<float*>(w.grads[0]), full_.main_grad2 = static_cast<float*>(w.grads[1]);
    } else {
      full_.dw1 = w.grads[0], full_.dw2 = w.grads[1];
    }
    if (l.bias) full_.db1 = w.grads[2], full_.db2 = w.grads[3];
  }
  // Every tensor's [rank][2] element ranges, then the descriptor table's own (exchange_shards): all
  // allocated here, before the set-up barrier. An allocation or free after it could wait for the
  // device while another emulated rank's barrier kernel waits for this rank: a deadlock.
  ranges_ = DeviceBuffer((kernels::kMaxShardTensors + 1) * s.ranks * 2 * sizeof(int64_t));
}

ShardedWeights::~ShardedWeights() = default;

void ShardedWeights::barrier(cudaStream_t stream) {
  kernels::EpBarrierParams b;
  for (int r = 0; r < comm_->ranks(); ++r)
    b.flags.base[r] = static_cast<char*>(window_->peer(r)) + (reinterpret_cast<char*>(flags_) - static_cast<char*>(window_->local()));
  b.epoch = epoch_;
  b.rank = comm_->rank(), b.ranks = comm_->ranks();
  b.timeout_ns = comm_->barrier_timeout_ns();
  b.error = error_;
  kernels::launch_ep_barrier(b, stream);
}

void ShardedWeights::exchange_shards(cudaStream_t stream) {
  const int ranks = comm_->ranks(), rank = comm_->rank();
  // This rank's descriptors into its row of its own table, then every other row from its owner.
  std::vector<Shard> row(kernels::kMaxShardTensors);
  for (std::size_t t = 0; t < tensors_.size(); ++t) row[t] = tensors_[t].own;
  const std::size_t row_bytes = row.size() * sizeof(Shard);
  MG_CUDA_CHECK(cudaMemcpyAsync(shared_table_ + rank * kernels::kMaxShardTensors, row.data(), row_bytes,
                                cudaMemcpyHostToDevice, stream));
  std::vector<int64_t> ranges;
  for (int r = 0; r < ranks; ++r) ranges.push_back(r * static_cast<int64_t>(row_bytes / 4)), ranges.push_back(row_bytes / 4);
  int64_t* table_ranges = ranges_.as<int64_t>() + kernels::kMaxShardTensors * ranks * 2;
  MG_CUDA_CHECK(cudaMemcpyAsync(table_ranges, ranges.data(), ranges.size() * sizeof(int64_t), cudaMemcpyHostToDevice,
                                stream));
  barrier(stream);
  kernels::ShardExchangeParams p;
  for (int r = 0; r < ranks; ++r) p.window.base[r] = static_cast<char*>(window_->peer(r));
  p.tensors[0].offset = static_cast<std::size_t>(reinterpret_cast<char*>(shared_table_) - static_cast<char*>(window_->local()));
  p.tensors[0].ranges = table_ranges;
  p.tensors[0].type = DType::kFP32;  // 4-byte words
  p.count = 1, p.rank = rank, p.ranks = ranks, p.max_elements = static_cast<int64_t>(row_bytes / 4);
  kernels::launch_shard_gather(p, stream);
  // No rank reads a peer's table after this barrier. It is here for the error path: a bad table
  // throws on every rank, and a rank's window must not be freed while a peer still pulls from it.
  barrier(stream);
  table_.assign(static_cast<std::size_t>(ranks) * kernels::kMaxShardTensors, Shard{});
  MG_CUDA_CHECK(cudaMemcpyAsync(table_.data(), shared_table_, table_.size() * sizeof(Shard), cudaMemcpyDeviceToHost,
                                stream));
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));
  check_device_errors(stream);
  // Every rank checks the whole table, so a bad descriptor fails everywhere with the same message.
  std::vector<int64_t> elements(kernels::kMaxShardTensors * ranks * 2, 0);
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    std::vector<Shard> column;
    for (int r = 0; r < ranks; ++r) column.push_back(table_[r * kernels::kMaxShardTensors + t]);
    check_shard_table(column, tensors_[t].shape.name);
    for (int r = 0; r < ranks; ++r) {
      const int64_t per = tensors_[t].shape.row_elements;
      elements[(t * ranks + r) * 2] = checked_mul("shard elements", column[r].first_row, per);
      elements[(t * ranks + r) * 2 + 1] = checked_mul("shard elements", column[r].rows, per);
    }
  }
  MG_CUDA_CHECK(cudaMemcpyAsync(ranges_.get(), elements.data(), elements.size() * sizeof(int64_t),
                                cudaMemcpyHostToDevice, stream));
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));
}

kernels::ShardExchangeParams ShardedWeights::params(bool gradients, bool weights, bool biases) const {
  kernels::ShardExchangeParams p;
  const int ranks = comm_->ranks();
  for (int r = 0; r < ranks; ++r) p.window.base[r] = static_cast<char*>(window_->peer(r));
  p.rank = comm_->rank(), p.ranks = ranks;
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    if (is_bias(t) ? !biases : !weights) continue;
    const Tensor& x = tensors_[t];
    kernels::ShardTensor& k = p.tensors[p.count++];
    k.ranges = ranges_.as<int64_t>() + t * ranks * 2;
    k.offset = gradients ? x.grad_offset : x.weight_offset;
    k.type = gradients ? x.grad_type : options_.layer.dtype;
    k.out = gradients ? x.grad_shard : nullptr;
    for (int r = 0; r < ranks; ++r) {
      const Shard& s = table_[r * kernels::kMaxShardTensors + t];
      p.max_elements = std::max(p.max_elements, s.rows * x.shape.row_elements);
    }
  }
  return p;
}

void ShardedWeights::gather(cudaStream_t stream) {
  const std::size_t es = dtype_size(options_.layer.dtype);
  char* local = static_cast<char*>(window_->local());
  for (const Tensor& x : tensors_) {
    const std::size_t bytes = static_cast<std::size_t>(x.own.rows * x.shape.row_elements) * es;
    if (bytes == 0) continue;
    char* to = local + x.weight_offset + static_cast<std::size_t>(x.own.first_row * x.shape.row_elements) * es;
    MG_CUDA_CHECK(cudaMemcpyAsync(to, x.shard, bytes, cudaMemcpyDeviceToDevice, stream));
  }
  barrier(stream);
  kernels::launch_shard_gather(params(false, true, true), stream);
  barrier(stream);
}

void ShardedWeights::zero_weight_gradients(cudaStream_t stream) {
  if (!options_.layer.main_grad_fp32) return;  // 16-bit dw is written whole, empty experts included
  char* local = static_cast<char*>(window_->local());
  for (std::size_t t = 0; t < 2; ++t) {
    const Tensor& x = tensors_[t];
    const std::size_t bytes = static_cast<std::size_t>(x.shape.global_rows * x.shape.row_elements) * sizeof(float);
    MG_CUDA_CHECK(cudaMemsetAsync(local + x.grad_offset, 0, bytes, stream));
  }
}

void ShardedWeights::reduce(bool weights, bool biases, cudaStream_t stream) {
  biases = biases && options_.layer.bias;
  if (!weights && !biases) return;
  barrier(stream);
  kernels::launch_shard_reduce(params(true, weights, biases), stream);
  barrier(stream);
}

void ShardedWeights::check_device_errors(cudaStream_t stream) {
  MG_CUDA_CHECK(cudaStreamSynchronize(stream));
  const DeviceErrorRecord r = take_device_error_record(error_);
  if (r.code == kDeviceErrorNone) return;
  detail::throw_error(__FILE__, __LINE__, describe_device_error(r, 1, "data-parallel (sharding)"),
                      ErrorKind::kDeviceSplits);
}

std::string ShardedWeights::describe() const {
  std::ostringstream os;
  const int ranks = comm_->ranks();
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    const Tensor& x = tensors_[t];
    os << x.shape.name << " (" << x.shape.global_rows << " rows of " << x.shape.row_elements << " elements):";
    for (int r = 0; r < ranks && !table_.empty(); ++r) {
      const Shard& s = table_[r * kernels::kMaxShardTensors + t];
      os << " rank " << r << " [" << s.first_row << ", " << s.first_row + s.rows << ")";
    }
    os << "\n";
  }
  return os.str();
}

}  // namespace moegraph
