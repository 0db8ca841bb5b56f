// Running a grouped_linear case: the eager path (direct calls), then the graph path (each step
// captured under cudaStreamCaptureModeGlobal and replayed with fresh data), every step checked
// against the fp64 reference. The capture and replay follow tests/gpu/test_graph_capture.cpp.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moegraph/error.hpp"
#include "testing/graph.hpp"
#include "tools/check/grouped_linear_case.hpp"

namespace moegraph::check {
namespace {

using testing::OutputSet;
using testing::Problem;
using Step = CaseStep;

void enqueue(Problem& p, Step step, cudaStream_t stream) {
  if (step == Step::kInference) {
    p.op->forward(p.forward_args(), stream);
    return;
  }
  p.op->forward_train(p.forward_args(), stream);
  const bool delayed = step == Step::kTrainingDelayedWgrad;
  p.op->backward(p.backward_args(), delayed ? WgradMode::kDelayed : WgradMode::kImmediate, stream);
  if (delayed) p.op->backward_dw(stream);
}

template <class T>
std::vector<unsigned char> bytes_of(const std::vector<T>& values) {
  std::vector<unsigned char> out(values.size() * sizeof(T));
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

std::vector<unsigned char> wgrad_bits(const Problem& p) {
  return p.spec.main_grad ? bytes_of(p.d_main_grad.download()) : bytes_of(p.d_dw.download());
}

// The state of one case run: the steps, what the last one was, the worst error so far.
class CaseRun {
 public:
  CaseRun(Problem& p, std::vector<StepPlan> plans) : p_(p), plans_(std::move(plans)) {}

  // Eager: every step once, with direct calls. This is also the warm-up before capture.
  bool run_eager() {
    for (const StepPlan& plan : plans_)
      if (!run_step(plan, detail::concat("eager ", plan.label), [&] { enqueue(p_, plan.step, stream_.get()); }))
        return false;
    return true;
  }

  // Graph: every step captured once, then replayed with new routings and data.
  bool run_graphs(SplitGenerator& routing, int replays) {
    std::vector<std::unique_ptr<testing::Graph>> graphs;
    for (const StepPlan& plan : plans_) {
      where_ = detail::concat("graph capture of ", plan.label);
      graphs.push_back(std::make_unique<testing::Graph>(stream_.get(), [&] { enqueue(p_, plan.step, stream_.get()); }));
    }
    for (int replay = 0; replay < replays; ++replay) {
      p_.reroute(routing.next());
      for (std::size_t i = 0; i < plans_.size(); ++i) {
        const std::string where = detail::concat("graph replay ", replay, " of ", plans_[i].label);
        if (!run_step(plans_[i], where, [&] { graphs[i]->launch(stream_.get()); })) return false;
      }
    }
    return true;
  }

  double max_rel_err() const { return max_rel_err_; }
  const std::string& failure() const { return failure_; }
  const std::string& where() const { return where_; }
  Step last_step() const { return last_step_; }

 private:
  bool run_step(const StepPlan& plan, const std::string& where, const std::function<void()>& launch) {
    where_ = where;
    last_step_ = plan.step;
    p_.poison_outputs();
    p_.restore_main_grad();
    // Uploads and poisoning went through the legacy default stream; the step runs on ours.
    MG_CUDA_CHECK(cudaDeviceSynchronize());
    launch();
    p_.op->check_device_errors(stream_.get());

    std::vector<OutputSet> sets;
    if (plan.check_forward) sets.push_back(OutputSet::kForward);
    if (plan.check_grads) sets.insert(sets.end(), {OutputSet::kDgrad, OutputSet::kBiasGrads, OutputSet::kWgrad});
    for (OutputSet set : sets)
      for (const testing::CompareResult& r : p_.check(set, where)) {
        max_rel_err_ = std::max(max_rel_err_, r.rel_fro);
        if (!r.ok) return fail(r.message);
      }
    if (plan.step == Step::kTraining) immediate_wgrad_ = wgrad_bits(p_);
    if (plan.step == Step::kTrainingDelayedWgrad && wgrad_bits(p_) != immediate_wgrad_)
      return fail(where + ": the delayed weight gradient is not bit-identical to the immediate one");
    return true;
  }

  bool fail(std::string message) {
    failure_ = std::move(message);
    return false;
  }

  Problem& p_;
  std::vector<StepPlan> plans_;
  testing::Stream stream_;
  std::vector<unsigned char> immediate_wgrad_;  // of the current routing
  double max_rel_err_ = 0.0;
  std::string failure_;
  std::string where_ = "set-up";
  Step last_step_ = Step::kInference;
};

}  // namespace

CaseOutcome GroupedLinearRunner::run(const RunSettings& settings) {
  SplitGenerator routing(case_.routing, case_.spec.groups);
  testing::CaseSpec spec = case_.spec;
  spec.splits = routing.next();
  Problem p(spec, case_.data_seed);
  CaseRun run(p, plan_steps(case_.phases));

  CaseOutcome outcome;
  try {
    outcome.passed = run.run_eager() && run.run_graphs(routing, case_.replays);
    outcome.failure = run.failure();
  } catch (const std::exception& e) {
    outcome.passed = false;
    outcome.failure = detail::concat(run.where(), ": ", e.what());
  }
  outcome.paths = "eager+graph";
  outcome.max_rel_err = run.max_rel_err();
  if (settings.dump_dir) {
    const std::string label = detail::concat(outcome.passed ? "the last step checked, " : "the failing step, ",
                                             run.where());
    try {
      dump_grouped_linear(p, run.last_step(), label, case_.json, *settings.dump_dir / name());
    } catch (const std::exception& e) {
      outcome.failure += detail::concat(outcome.passed ? "" : "; ", "dump failed: ", e.what());
      outcome.passed = false;
    }
  }
  return outcome;
}

}  // namespace moegraph::check
