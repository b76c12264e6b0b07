// The `spaco` schedule (Sparse Chunk-wise Optimization, Li et al. 2025): seco's prefill, then a
// reverse sweep over only t of the k backward chunks.
//
// Sample: t chunks drawn without replacement, uniformly, from Rng(seed, step); or, `stratified`,
// from two strata — chunks holding at least one supervised label, and chunks holding none — with
// t_s = round(t k_s / k) from the supervised stratum (at least one when it is not empty), the rest
// from the other. t = k visits every chunk and reproduces seco exactly.
// Scaling: `scale_loss` multiplies a visited chunk's loss gradient by k_s / t_s of its stratum
// (k / t unstratified). `scale_relay` multiplies the relay accumulated for a visited chunk (the dK/dV
// that later visited chunks added over its tokens) by k / t before it is used, so a gradient that
// crosses h visited chunks is scaled (k/t)^h; `relay_cap` stops the growth once the cumulative factor
// reaches the cap. `drop_relay` discards all relay (each chunk's backward sees only its own dK/dV).
// Relay left on unvisited chunks is always dropped: nothing reads it.
//
// What the estimator is unbiased for. Write the exact gradient as g = sum_i (g_i^0 + g_i^1 + ...),
// where g_i^0 is the gradient of chunk i's loss along paths that stay inside chunk i (earlier K/V held
// constant) and g_i^h collects the paths that cross h chunk boundaries through K/V. A path of h hops
// contributes only when all of its h + 1 chunks are visited.
//   * With scale_loss (and drop_relay, or t = 1), E[spaco] = sum_i g_i^0 exactly: the chunk-local
//     ("cache-truncated") gradient. Each chunk is visited with probability t/k and weighted k/t.
//     Stratified sampling keeps this, stratum by stratum. This is the claim the tests check
//     statistically over many seeds.
//   * It is NOT unbiased for the full gradient: a path of h >= 1 hops survives with probability
//     C(k-h-1, t-h-1)/C(k, t) and is weighted k/t, i.e. one-hop terms get (t-1)/(k-1) of their
//     weight. scale_relay with factor k/t overcorrects one-hop terms slightly; (k-1)/(t-1) per hop
//     would make exactly the one-hop terms unbiased, but no per-hop constant fixes all orders.
//   * The loss it reports is exact: the prefill computes every chunk's loss.
//
// Data parallel: every rank runs t chunk backwards, the same t chunks. The sample depends only on
// (seed, step) and, stratified, on which chunks hold a supervised label anywhere in the global batch
// (the per-chunk label counts summed over the ranks through StepHooks::sum_over_ranks). Every rank
// has the same T and options, hence the same k and t, and draws the sample one process would draw on
// the ranks' batches concatenated, so DP spaco equals that process's spaco (to rounding).
#include "engine/random.h"
#include "optim/chunks.h"

#include <algorithm>
#include <cmath>

namespace cw {

namespace {
// Chooses `take` of `items` uniformly without replacement (a partial Fisher-Yates shuffle).
std::vector<int64_t> sample(std::vector<int64_t> items, int64_t take, Rng& rng) {
  take = std::min<int64_t>(take, static_cast<int64_t>(items.size()));
  for (int64_t i = 0; i < take; ++i) {
    const int64_t j = i + static_cast<int64_t>(rng.below(static_cast<uint64_t>(items.size()) - static_cast<uint64_t>(i)));
    std::swap(items[static_cast<size_t>(i)], items[static_cast<size_t>(j)]);
  }
  items.resize(static_cast<size_t>(take));
  return items;
}

int64_t chunk_labels(const Batch& batch, int64_t t0, int64_t t1) {
  const int64_t T = batch.T();
  const int32_t* lab = batch.labels.tensor.ptr<int32_t>();
  int64_t n = 0;
  for (int64_t b = 0; b < batch.B(); ++b)
    for (int64_t t = t0; t < t1; ++t) n += lab[b * T + t] != -100;
  return n;
}

class SpacoSchedule : public Schedule {
 public:
  using Schedule::Schedule;

  StepStats step(LlamaModel& model, const Batch& batch, const ParamSet& grads, double normaliser,
                 uint64_t step_index) override {
    StepFrame f(*this, store_, model, batch, normaliser, step_index);
    f.prefill(/*with_loss=*/true);  // seco's prefill; every chunk's loss is the step's
    const std::vector<int64_t> b = f.sweep_bounds();
    const int64_t k = static_cast<int64_t>(b.size()) - 1;
    const int64_t t = options_.keep > 0 ? std::min(options_.keep, k) : k;
    f.backprops = t;
    const std::vector<double> weight = choose(batch, b, t, step_index);  // 0: not visited; else the loss weight
    int64_t earliest = 0;  // the earliest visited chunk: the sweep's last backward
    while (weight[static_cast<size_t>(earliest)] == 0.0) ++earliest;

    const double relay_factor = static_cast<double>(k) / static_cast<double>(t);
    double cumulative_relay = 1.0;
    bool later_visited = false;
    for (int64_t i = k - 1; i >= 0; --i) {  // seco's reverse sweep over the visited chunks
      if (weight[static_cast<size_t>(i)] == 0.0) continue;
      const int64_t s = b[static_cast<size_t>(i)], e = b[static_cast<size_t>(i) + 1];
      if (later_visited && (options_.drop_relay || options_.scale_relay)) {
        double factor = 0.0;  // drop_relay
        if (!options_.drop_relay) {
          factor = relay_factor;
          if (options_.relay_cap > 0) factor = std::max(1.0, std::min(factor, options_.relay_cap / cumulative_relay));
          cumulative_relay *= factor;
        }
        scale_relay(f.kv, model.config().num_hidden_layers, s, e, factor);
      }
      f.backprop(s, e, grads, weight[static_cast<size_t>(i)], /*last=*/i == earliest, /*count_loss=*/false);
      f.kv.release_from(s);
      later_visited = true;
    }
    return f.finish(/*chunks=*/k, /*visited=*/t);
  }

 private:
  // Multiplies the dK/dV that later chunks relayed into tokens [s, e) by `factor` (0: discards it).
  static void scale_relay(const KVStore& kv, int64_t layers, int64_t s, int64_t e, double factor) {
    for (int l = 0; l < layers; ++l) {
      for (const Tensor& g : {kv.d_keys(l, s, e), kv.d_values(l, s, e)}) {
        if (factor == 0.0) fill(g, 0.0);
        else scale_inplace(g, factor);
      }
    }
  }

  // The sample: per chunk of `bounds` 0 when not visited, else its loss weight.
  std::vector<double> choose(const Batch& batch, const std::vector<int64_t>& bounds, int64_t t,
                             uint64_t step_index) const {
    const int64_t k = static_cast<int64_t>(bounds.size()) - 1;
    std::vector<double> weight(static_cast<size_t>(k), 0.0);
    Rng rng(mix64(options_.seed) ^ mix64(step_index + 0x9e37));
    std::vector<std::vector<int64_t>> strata(1);
    if (options_.stratified) {
      std::vector<double> labels(static_cast<size_t>(k));
      for (int64_t i = 0; i < k; ++i)
        labels[static_cast<size_t>(i)] =
            static_cast<double>(chunk_labels(batch, bounds[static_cast<size_t>(i)], bounds[static_cast<size_t>(i) + 1]));
      if (hooks_.sum_over_ranks) hooks_.sum_over_ranks(labels);  // the global batch's strata
      strata.assign(2, {});
      for (int64_t i = 0; i < k; ++i) strata[labels[static_cast<size_t>(i)] > 0 ? 0 : 1].push_back(i);
    } else {
      for (int64_t i = 0; i < k; ++i) strata[0].push_back(i);
    }
    std::vector<int64_t> take(strata.size());
    if (strata.size() == 1) {
      take[0] = t;
    } else {
      const int64_t ks = static_cast<int64_t>(strata[0].size()), ku = static_cast<int64_t>(strata[1].size());
      int64_t ts = static_cast<int64_t>(std::llround(static_cast<double>(t) * static_cast<double>(ks) / static_cast<double>(k)));
      if (ks > 0) ts = std::max<int64_t>(ts, 1);
      ts = std::min(ts, ks);
      int64_t tu = std::min(t - ts, ku);
      ts = std::min(ks, t - tu);  // give back what the unsupervised stratum cannot take
      take = {ts, tu};
    }
    for (size_t s = 0; s < strata.size(); ++s) {
      if (take[s] == 0) continue;
      const double w = options_.scale_loss ? static_cast<double>(strata[s].size()) / static_cast<double>(take[s]) : 1.0;
      for (int64_t i : sample(strata[s], take[s], rng)) weight[static_cast<size_t>(i)] = w;
    }
    return weight;
  }

  std::optional<KVStore> store_;
};
}  // namespace

std::unique_ptr<Schedule> make_spaco_schedule(const ScheduleOptions& o) { return std::make_unique<SpacoSchedule>(o); }

}  // namespace cw
