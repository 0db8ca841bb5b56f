// Running a moe_layer case: every step eagerly for each token count, then each step captured once
// under cudaStreamCaptureModeGlobal and replayed over every token count with fresh data, each run
// checked against the fp64 layer reference. Inputs past the token count hold NaN and outputs are
// poisoned with NaN before every run, so reading stale rows or skipping a write fails a check.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "moegraph/error.hpp"
#include "testing/graph.hpp"
#include "tools/check/moe_layer_case.hpp"
#include "tools/check/moe_layer_problem.hpp"

namespace moegraph::check {
namespace {

using Step = CaseStep;

void enqueue(MoeLayer& layer, Step step, const MoeLayerIO& io, cudaStream_t stream) {
  if (step == Step::kInference) {
    layer.forward(io, stream);
    return;
  }
  layer.forward_train(io, stream);
  layer.backward(io, stream);
  if (step == Step::kTrainingDelayedWgrad) layer.backward_dw(stream);
}

// The state of one case run: the steps, the run --dump writes, the worst error so far.
class CaseRun {
 public:
  CaseRun(const MoeLayerCase& c, MoeProblem& p) : c_(c), p_(p), plans_(plan_steps(c.phases)) {}

  // Eager: every step once per token count, with direct calls. This is also the warm-up before capture.
  bool run_eager() {
    for (int64_t n : c_.tokens) {
      where_ = detail::concat("eager data for ", n, " tokens");
      p_.draw(n);
      for (const StepPlan& plan : plans_) {
        const std::string where = detail::concat("eager ", plan.label, ", ", n, " tokens");
        if (!run_step(plan, where, [&] { enqueue(p_.layer(plan.step), plan.step, p_.io(), stream_.get()); }))
          return false;
      }
    }
    return true;
  }

  // Graph: every step captured once, then replayed over every token count with fresh data.
  bool run_graphs() {
    std::vector<std::unique_ptr<testing::Graph>> graphs;
    for (const StepPlan& plan : plans_) {
      where_ = detail::concat("graph capture of ", plan.label);
      graphs.push_back(std::make_unique<testing::Graph>(
          stream_.get(), [&] { enqueue(p_.layer(plan.step), plan.step, p_.io(), stream_.get()); }));
    }
    for (int replay = 0; replay < c_.replays; ++replay)
      for (int64_t n : c_.tokens) {
        where_ = detail::concat("graph replay ", replay, " data for ", n, " tokens");
        p_.draw(n);
        for (std::size_t i = 0; i < plans_.size(); ++i) {
          const std::string where = detail::concat("graph replay ", replay, " of ", plans_[i].label, ", ", n, " tokens");
          if (!run_step(plans_[i], where, [&] { graphs[i]->launch(stream_.get()); })) return false;
        }
      }
    return true;
  }

  double max_rel_err() const { return max_rel_err_; }
  const std::string& failure() const { return failure_; }
  const std::string& where() const { return where_; }
  // What --dump writes: the failing run (the one in progress when a check failed or something threw),
  // or after a pass the first passing run of the most tokens (a run with a backward before one without),
  // not merely the last: a case's last token count may be 0.
  const MoeLayerRun& dump_run(bool passed) const { return passed && kept_.has_value() ? *kept_ : last_; }

 private:
  bool run_step(const StepPlan& plan, const std::string& where, const std::function<void()>& launch) {
    where_ = where;
    last_ = MoeLayerRun{};
    last_.label = where;
    last_.tokens = p_.tokens();
    last_.x = p_.x();
    last_.backward = plan.step != Step::kInference;
    if (last_.backward) last_.dy = p_.dy();

    p_.prepare_run();
    // Uploads and poisoning went through the legacy default stream; the step runs on ours.
    MG_CUDA_CHECK(cudaDeviceSynchronize());
    launch();
    MoeLayer& layer = p_.layer(plan.step);
    layer.check_device_errors(stream_.get());
    MG_CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
    last_.dropped = layer.read_dropped(stream_.get());
    last_.ref_dropped = p_.ref_dropped();
    last_.dropped_read = true;
    last_.outputs = p_.outputs(plan);

    for (const MoeLayerOutput& o : last_.outputs) {
      if (!o.checked) continue;
      const bool from_main_grad = c_.main_grad && (o.name == "d_router_weight" || o.name == "dw1" || o.name == "dw2");
      const int64_t cols = o.shape.size() > 1 ? o.shape.back() : 1;
      const testing::CompareResult r = testing::all_close(
          detail::concat(where, ": ", o.name, from_main_grad ? " (main_grad increment)" : ""), o.got, o.ref, cols, {},
          o.tol);
      max_rel_err_ = std::max(max_rel_err_, r.rel_fro);
      if (!r.ok) return fail(r.message);
    }
    const std::string past_n = p_.rows_past_n_error(plan.step != Step::kInference && plan.check_grads);
    if (!past_n.empty()) return fail(detail::concat(where, ": ", past_n));
    if (last_.dropped != last_.ref_dropped)
      return fail(detail::concat(where, ": read_dropped() gives ", last_.dropped, " dropped assignments, the reference ",
                                 last_.ref_dropped, " (capacity_factor ", c_.capacity_factor, ")"));

    if (plan.step == Step::kTraining) immediate_bits_ = p_.gradient_bits();
    if (plan.step == Step::kTrainingDelayedWgrad) {
      const auto delayed = p_.gradient_bits();
      for (std::size_t i = 0; i < delayed.size(); ++i)
        if (delayed[i].second != immediate_bits_.at(i).second)
          return fail(detail::concat(where, ": the delayed ", delayed[i].first,
                                     " is not bit-identical to the immediate step's"));
    }
    // Copied only when it beats the kept one: a tie (the next replay, plan) keeps the first.
    if (!kept_ || std::pair(last_.backward, last_.tokens) > std::pair(kept_->backward, kept_->tokens)) kept_ = last_;
    return true;
  }

  bool fail(std::string message) {
    failure_ = std::move(message);
    return false;
  }

  const MoeLayerCase& c_;
  MoeProblem& p_;
  std::vector<StepPlan> plans_;
  testing::Stream stream_;
  std::vector<std::pair<std::string, std::vector<unsigned char>>> immediate_bits_;  // of the current data
  MoeLayerRun last_;
  std::optional<MoeLayerRun> kept_;  // the passing run --dump writes (dump_run)
  double max_rel_err_ = 0.0;
  std::string failure_;
  std::string where_ = "set-up";
};

}  // namespace

CaseOutcome MoeLayerRunner::run(const RunSettings& settings) {
  CaseOutcome outcome;
  std::unique_ptr<MoeProblem> problem;
  std::unique_ptr<CaseRun> run;
  try {
    problem = std::make_unique<MoeProblem>(case_);
    run = std::make_unique<CaseRun>(case_, *problem);
    outcome.passed = run->run_eager() && run->run_graphs();
    outcome.failure = run->failure();
  } catch (const std::exception& e) {
    outcome.passed = false;
    outcome.failure = detail::concat(run ? run->where() : std::string("set-up"), ": ", e.what());
  }
  std::string counts;
  for (int64_t n : case_.tokens) counts += detail::concat(counts.empty() ? "" : ",", n);
  outcome.paths = detail::concat("eager+graph, tokens ", counts);
  if (run) outcome.max_rel_err = run->max_rel_err();
  if (settings.dump_dir && run) {
    try {
      dump_moe_layer(case_, problem->params(), run->dump_run(outcome.passed), outcome.passed, *settings.dump_dir / name());
    } catch (const std::exception& e) {
      outcome.failure += detail::concat(outcome.passed ? "" : "; ", "dump failed: ", e.what());
      outcome.passed = false;
    }
  }
  return outcome;
}

}  // namespace moegraph::check
