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
#include "engine/random.h"
#include "optim/schedules_impl.h"

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

bool chunk_has_labels(const Batch& batch, int64_t t0, int64_t t1) {
  const int64_t T = batch.T();
  const int32_t* lab = batch.labels.tensor.ptr<int32_t>();
  for (int64_t b = 0; b < batch.B(); ++b)
    for (int64_t t = t0; t < t1; ++t)
      if (lab[b * T + t] != -100) return true;
  return false;
}

class SpacoSchedule : public Schedule {
 public:
  using Schedule::Schedule;

  StepStats step(LlamaModel& model, const Batch& batch, const ParamSet& grads, double normaliser,
                 uint64_t step_index) override {
    StepStats st;
    st.supervised = batch.supervised();
    const double norm = step_normaliser(batch, normaliser);
    const int64_t B = batch.B(), T = batch.T();
    model.ensure_positions(T);
    KVStore& kv = step_store(store_, model, B, T, options_.offload_window, options_.save_attention);
    const size_t moved_before = kv.bytes_moved();
    arena_on(model.device()).reset_high_water();
    st.loss = prefill(kv, model, batch, chunk_bounds(T, options_.chunk), norm, true, arena_, options_.mlp_shards);

    const std::vector<int64_t> bounds = chunk_bounds(T, options_.bwd_chunk > 0 ? options_.bwd_chunk : options_.chunk);
    const int64_t k = static_cast<int64_t>(bounds.size()) - 1;
    const int64_t t = options_.keep > 0 ? std::min(options_.keep, k) : k;
    std::vector<double> weight(static_cast<size_t>(k), 0.0);  // 0: not visited; else the loss weight
    choose(batch, bounds, k, t, step_index, weight);

    const double relay_factor = static_cast<double>(k) / static_cast<double>(t);
    double cumulative_relay = 1.0;
    bool later_visited = false;
    for (int64_t i = k - 1; i >= 0; --i) {
      if (weight[static_cast<size_t>(i)] == 0.0) continue;
      const int64_t s = bounds[static_cast<size_t>(i)], e = bounds[static_cast<size_t>(i) + 1];
      if (later_visited && (options_.drop_relay || options_.scale_relay)) {
        double f = 0.0;
        if (!options_.drop_relay) {
          f = relay_factor;
          if (options_.relay_cap > 0) f = std::max(1.0, std::min(f, options_.relay_cap / cumulative_relay));
          cumulative_relay *= f;
        }
        for (int l = 0; l < model.config().num_hidden_layers; ++l) {
          for (const Tensor& g : {kv.d_keys(l, s, e), kv.d_values(l, s, e)}) {
            if (f == 0.0) fill(g, 0.0);
            else scale_inplace(g, f);
          }
        }
      }
      backprop_chunk(kv, model, batch, s, e, grads, norm, arena_, activation_policy(options_),
                     weight[static_cast<size_t>(i)]);
      kv.release_from(s);
      later_visited = true;
    }
    st.chunks = k;
    st.chunks_visited = t;
    st.activation_high_water = arena_.high_water();
    st.kv_bytes = kv.bytes();
    st.kv_host_bytes = kv.host_bytes();
    st.kv_bytes_moved = kv.bytes_moved() - moved_before;
    return st;
  }

 private:
  void choose(const Batch& batch, const std::vector<int64_t>& bounds, int64_t k, int64_t t, uint64_t step_index,
              std::vector<double>& weight) const {
    Rng rng(mix64(options_.seed) ^ mix64(step_index + 0x9e37));
    std::vector<std::vector<int64_t>> strata(1);
    if (options_.stratified) {
      strata.assign(2, {});
      for (int64_t i = 0; i < k; ++i)
        strata[chunk_has_labels(batch, bounds[static_cast<size_t>(i)], bounds[static_cast<size_t>(i) + 1]) ? 0 : 1]
            .push_back(i);
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
  }

  std::optional<KVStore> store_;
};
}  // namespace

std::unique_ptr<Schedule> make_spaco_schedule(const ScheduleOptions& o) { return std::make_unique<SpacoSchedule>(o); }

}  // namespace cw
