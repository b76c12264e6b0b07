#include "tools/train/train.h"

#include "engine/random.h"
#include "engine/trace.h"
#include "model/checkpoint.h"
#include "optim/adamw.h"
#include "optim/lr_schedule.h"
#include "optim/schedule.h"
#include "optim/training.h"
#include "chunkwise_config.h"
#include "engine/engine.h"
#if CW_HAVE_CUDA
#endif
#include "tools/data/tokenizer.h"
#include "tools/data/tokens.h"
#include "tools/plot.h"
#include "tools/train/run_dir.h"
#include "tools/train/sample.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <ostream>
#include <unistd.h>

namespace cw {

namespace fs = std::filesystem;

namespace {
std::atomic<int> g_signals{0};

void on_signal(int) {
  if (g_signals.fetch_add(1) >= 1) _exit(128 + SIGINT);  // the second signal: leave at once
}

struct SignalGuard {
  struct sigaction old_int {}, old_term {};
  SignalGuard() {
    g_signals = 0;
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
  }
  ~SignalGuard() {
    sigaction(SIGINT, &old_int, nullptr);
    sigaction(SIGTERM, &old_term, nullptr);
  }
};

double rss_mib() {
  std::ifstream f("/proc/self/statm");
  long pages = 0, resident = 0;
  f >> pages >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / (1 << 20);
}

double available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  double kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024.0;
  return 0;
}

std::string human_bytes(double b) {
  if (b >= double(1ull << 30)) return fmt::format("{:.2f} GiB", b / double(1ull << 30));
  return fmt::format("{:.1f} MiB", b / double(1 << 20));
}

std::string duration(double s) {
  const int64_t t = static_cast<int64_t>(s + 0.5);
  return t >= 3600 ? fmt::format("{}h{:02}m", t / 3600, (t / 60) % 60) : fmt::format("{}m{:02}s", t / 60, t % 60);
}

// Memory the run will need on its device: parameters (compute copy, f32 master for bf16), gradients
// and two moments in the master dtype, one chunk's activations, the K/V store with its gradients,
// the LM-head and attention scratch.
double planned_bytes(const LlamaConfig& c, DType dt, const RunConfig& rc) {
  const double e = static_cast<double>(dtype_size(dt)), a = static_cast<double>(dtype_size(accum_dtype(dt)));
  const double params = static_cast<double>(c.parameter_count());
  const int64_t B = rc.data.batch_size, T = rc.data.seq_len;
  const ScheduleOptions so = rc.schedule_options();
  int64_t chunk = (so.name == "full" || so.name == "checkpointed") ? T : std::max(so.chunk, so.bwd_chunk);
  if (chunk <= 0 || chunk > T) chunk = T;
  const ActivationPolicy policy{!(so.name == "checkpointed" && so.recompute == "full"), so.mlp_shards};
  const double acts = static_cast<double>(ChunkActivations::bytes(c, B, chunk, dt, policy));
  const double kv = static_cast<double>(c.num_hidden_layers * B * T * c.kv_dim()) * 2 * (e + a);
  const double scratch = static_cast<double>(kLmHeadBlockRows * c.vocab_size) * e +
                         static_cast<double>(B * chunk * (2 * c.hidden_size + 3 * c.intermediate_size)) * e;
  const double master = dt == DType::bf16 ? 4.0 : e;
  return params * (e + (dt == DType::bf16 ? master : 0.0) + 3 * master) + acts + kv + scratch;
}

Device resolve_train_device(const std::string& setting) {
  if (setting == "cpu") return Device::host();
  if (setting == "cuda") {
    if (!gpu_available())
      fail("train.device = cuda but no GPU is usable (this build has no CUDA, or the driver sees no device)",
           "use train.device = cpu (or auto)");
    return Device::gpu(0);
  }
  return gpu_available() ? Device::gpu(0) : Device::host();  // auto
}

// model.dtype = auto: bf16 compute on a GPU (fp32 master weights), f32 on the CPU.
DType resolve_train_dtype(const std::string& setting, Device device) {
  if (setting == "auto") return device.is_cpu() ? DType::f32 : DType::bf16;
  const DType dt = parse_dtype(setting);
  if (dt == DType::bf16 && device.is_cpu())
    fail("model.dtype = bf16 needs the GPU backend", "use model.dtype = f32 (or f64, or auto) on the CPU");
  if (dt == DType::f64 && !device.is_cpu())
    fail("model.dtype = f64 runs on the CPU only", "use bf16 or f32 on the GPU, or train.device = cpu");
  return dt;
}

// Loads a checkpoint's weights (any stored dtype) as the run's master weights.
void load_master_from(TrainingState& state, const std::string& dir) {
  ParamSet host(state.model().config(), state.master_dtype());
  load_checkpoint_weights(host, dir);
  state.load_master(host);
}

std::vector<std::string> resolve_demo(const std::vector<std::string>& specs) {
  std::vector<std::string> out;
  for (const auto& s : specs) out.push_back(s == "@demo" ? demo_data_path() : s);
  return out;
}
}  // namespace

std::string demo_data_path() {
  if (const char* env = std::getenv("CHUNKWISE_DEMO_DATA")) return env;
  const std::string p = ".cache/demo/jargon.bin";
  if (!fs::exists(p))
    fail(fmt::format("the demo corpus '{}' is not there", p),
         "run `tools/run train`, which fetches it (the Jargon File from Debian's jargon-text), or set data.train");
  return p;
}

TrainResult run_training(const RunConfig& rc, const TrainOptions& opt, std::ostream& out) {
  rc.validate();
  const auto t_start = std::chrono::steady_clock::now();
  TrainResult result;
  result.run_dir = !opt.run_dir.empty() ? opt.run_dir : (!rc.log.run_dir.empty() ? rc.log.run_dir : default_run_dir());
  const bool resume = opt.resume || rc.checkpoint.resume;

  // Model and device.
  LlamaConfig mc = LlamaConfig::resolve(rc.model.source);
  if (rc.model.tie_embeddings) mc.tie_word_embeddings = *rc.model.tie_embeddings;
  const Device device = resolve_train_device(rc.train.device);
  const DType dtype = resolve_train_dtype(rc.model.dtype, device);
#if CW_HAVE_CUDA
  if (!device.is_cpu()) set_deterministic(rc.train.deterministic);
#endif

  // Data.
  const ByteTokenizer tokenizer;
  const std::vector<std::string> train_specs = resolve_demo(rc.data.train);
  if (train_specs.empty()) fail("data.train is empty", "list token shards or globs in data.train");
  const TokenDatasetOptions dopt{parse_token_format(rc.data.format, "data.format"), mc.vocab_size};
  const TokenDataset train_data = TokenDataset::open(train_specs, dopt);
  WindowSplit split;
  if (rc.data.eval.empty()) {
    split = split_by_fraction(train_data, rc.data.seq_len, rc.data.eval_fraction);
  } else {
    split = split_by_files(train_data, TokenDataset::open(resolve_demo(rc.data.eval), dopt), rc.data.seq_len);
  }
  WindowSampler sampler(split.train, rc.data.seed);

  // Memory guard: fail before step 1, not in the middle of it.
  const double need = planned_bytes(mc, dtype, rc);
  const double have = device.is_cpu() ? available_bytes() : static_cast<double>(device_memory(device).free);
  if (have > 0 && need > have)
    fail(fmt::format("this run needs about {} of {} memory and the {} has {} available", human_bytes(need),
                     device.is_cpu() ? "host" : "device", device_name(device), human_bytes(have)),
         "lower data.batch_size, data.seq_len or schedule.chunk, or use schedule.name = seco");

  AdamWOptions aopt;
  aopt.beta1 = rc.optimizer.beta1;
  aopt.beta2 = rc.optimizer.beta2;
  aopt.eps = rc.optimizer.eps;
  aopt.weight_decay = rc.optimizer.weight_decay;
  TrainingState state(mc, dtype, device, aopt);
  LlamaModel& model = state.model();
  const ParamSet& grads = state.grads();
  AdamW& adamw = state.optimizer();
  LrSchedule lr_schedule{rc.optimizer.lr, rc.optimizer.min_lr, rc.optimizer.warmup_steps, rc.train.steps,
                         LrSchedule::parse(rc.optimizer.decay)};
  auto schedule = Schedule::create(rc.schedule_options());

  RunDirectory run_dir(result.run_dir);
  run_dir.remove_stale_temporaries();
  const std::string metrics_path = (fs::path(result.run_dir) / "metrics.jsonl").string();
  int64_t start_step = 0, tokens_seen = 0;
  if (resume) {
    std::vector<std::string> skipped;
    const auto ref = run_dir.latest_complete(&skipped);
    for (const auto& s : skipped) out << "resume: skipped " << s << "\n";
    if (!ref)
      fail(fmt::format("--resume: no complete checkpoint in '{}'", result.run_dir),
           "start without --resume, or point --run-dir at the run to continue");
    load_master_from(state, ref->path);
    adamw.load((fs::path(ref->path) / "optimizer.safetensors").string());
    std::ifstream sf(fs::path(ref->path) / "state.json");
    nlohmann::json state;
    try {
      state = nlohmann::json::parse(sf);
    } catch (const nlohmann::json::exception& e) {
      fail(fmt::format("{}/state.json: not valid JSON ({})", ref->path, e.what()), "the checkpoint is damaged");
    }
    start_step = state.at("step").get<int64_t>();
    tokens_seen = state.at("tokens_seen").get<int64_t>();
    sampler.restore(SamplerState::from_json(state.at("sampler"), ref->path + "/state.json"));
    truncate_metrics_after(metrics_path, start_step);
    out << fmt::format("resumed from {} (step {})\n", ref->path, start_step);
  } else if (fs::is_directory(rc.model.source) && fs::exists(fs::path(rc.model.source) / "config.json") &&
             (fs::exists(fs::path(rc.model.source) / "model.safetensors") ||
              fs::exists(fs::path(rc.model.source) / "model.safetensors.index.json"))) {
    load_master_from(state, rc.model.source);
  } else {
    state.init(rc.model.init_seed, mc.initializer_range);
  }

  write_text_atomic((fs::path(result.run_dir) / "config.toml").string(), rc.to_toml());
  write_text_atomic((fs::path(result.run_dir) / "tokenizer.json").string(), tokenizer.to_json().dump(2) + "\n");
  MetricsLog metrics(metrics_path);

  const int64_t B = rc.data.batch_size, T = rc.data.seq_len, accum = rc.data.grad_accum;
  const int64_t tokens_per_step = B * T * accum;
  out << fmt::format("run dir: {}\n", result.run_dir);
  out << fmt::format("model {}: {} layers, hidden {}, {} heads ({} K/V), vocab {}, {:.2f} M parameters, {} on {}{}\n",
                     rc.model.source, mc.num_hidden_layers, mc.hidden_size, mc.num_attention_heads,
                     mc.num_key_value_heads, mc.vocab_size, static_cast<double>(mc.parameter_count()) / 1e6,
                     dtype_name(dtype), device_name(device),
                     dtype == DType::bf16 ? " (f32 master weights, f32 gradients)" : "");
  out << fmt::format("data: {} ({} tokens): {} train windows, {} eval windows of {} tokens\n", train_data.describe(),
                     train_data.size(), split.train.size(), split.eval.size(), T);
  out << fmt::format("schedule {} (chunk {}, bwd chunk {}), {} x {} x {} = {} tokens per step, {} steps, "
                     "planned memory {}\n",
                     rc.schedule.name, rc.schedule.chunk, rc.schedule.bwd_chunk, accum, B, T, tokens_per_step,
                     rc.train.steps, human_bytes(need));
  out << "config:\n" << rc.to_toml() << "\n";
  out.flush();

  const bool tty = isatty(STDOUT_FILENO) && &out == &std::cout;
  SignalGuard signals;
  std::vector<double> plot_tokens, plot_loss, eval_tokens, eval_loss;
  Arena eval_arena(device);
  auto evaluate = [&]() {
    double sum = 0;
    int64_t count = 0;
    const int64_t n = std::min<int64_t>(rc.eval.batches, split.eval.num_batches(B));
    for (int64_t i = 0; i < n; ++i) {
      const std::vector<uint32_t> w = split.eval.batch_in_order(i, B);
      const int64_t rows = static_cast<int64_t>(w.size()) / (T + 1);
      const Batch batch = window_batch(w, rows, T);
      sum += batch_loss(model, batch, rc.schedule.chunk, eval_arena) * static_cast<double>(batch.supervised());
      count += batch.supervised();
    }
    return count > 0 ? sum / static_cast<double>(count) : std::nan("");
  };
  auto save = [&](int64_t step) {
    const SamplerState ss = sampler.state();
    run_dir.save_checkpoint(
        step,
        [&](const std::string& dir) {
          // The master weights (f32 for a bf16 run), so that a resume continues bit-exactly.
          save_checkpoint_weights(state.master_on_host(), mc, dir, state.master_dtype());
          adamw.save((fs::path(dir) / "optimizer.safetensors").string());
          nlohmann::json state = {{"step", step},
                                  {"tokens_seen", tokens_seen},
                                  {"sampler", ss.to_json()},
                                  {"tokenizer", tokenizer.to_json()}};
          write_text_atomic((fs::path(dir) / "state.json").string(), state.dump(2) + "\n");
          write_text_atomic((fs::path(dir) / "run.toml").string(), rc.to_toml());
        },
        rc.checkpoint.keep_last);
  };

  const auto t_loop = std::chrono::steady_clock::now();
  int64_t step = start_step;
  double last_loss = std::nan("");
  while (step < rc.train.steps) {
    ++step;
    const bool traced = !opt.trace.empty() && step == start_step + 1;
    if (traced) trace::start(device);
    const auto t0 = std::chrono::steady_clock::now();
    grads.zero();
    std::vector<Batch> micro;
    double normaliser = 0;
    for (int64_t m = 0; m < accum; ++m) {
      micro.push_back(window_batch(sampler.next_batch(B), B, T));
      normaliser += static_cast<double>(micro.back().supervised());
    }
    double loss = 0;
    StepStats stats;
    for (int64_t m = 0; m < accum; ++m) {
      stats = schedule->step(model, micro[static_cast<size_t>(m)], grads, normaliser,
                             static_cast<uint64_t>(step * accum + m));
      loss += stats.loss;
    }
    const double grad_norm = grad_global_norm(grads);
    const double lr = lr_schedule.at(step);
    bool skipped = false;
    if (!std::isfinite(loss) || !std::isfinite(grad_norm)) {
      const std::string what = fmt::format("step {}: non-finite {} (loss {}, grad norm {}) over {} micro-batches",
                                           step, std::isfinite(loss) ? "gradient" : "loss", loss, grad_norm, accum);
      if (rc.train.nonfinite == "stop") fail(what, "lower optimizer.lr or set train.nonfinite = skip");
      out << "warning: " << what << "; update skipped\n";
      skipped = true;
    } else {
      clip_grad_norm(grads, rc.optimizer.grad_clip);
      state.optimizer_step(lr);
    }
    tokens_seen += tokens_per_step;
    last_loss = loss;
    const auto t1 = std::chrono::steady_clock::now();
    if (traced) {
      trace::stop().write(opt.trace);
      out << fmt::format("trace of step {}: {}\n", step, opt.trace);
    }
    const double step_s = std::chrono::duration<double>(t1 - t0).count();
    const double elapsed = std::chrono::duration<double>(t1 - t_loop).count();
    const double eta = elapsed / static_cast<double>(step - start_step) * static_cast<double>(rc.train.steps - step);
    const double tok_s = static_cast<double>(tokens_per_step) / step_s;
    metrics.append({{"step", step}, {"loss", loss}, {"lr", lr}, {"grad_norm", grad_norm}, {"tokens", tokens_seen},
                    {"tokens_per_s", tok_s}, {"step_s", step_s}, {"skipped", skipped}, {"rss_mib", rss_mib()}});
    plot_tokens.push_back(static_cast<double>(tokens_seen));
    plot_loss.push_back(loss);
    if (step % rc.log.every == 0 || step == rc.train.steps || step == start_step + 1) {
      const std::string line = fmt::format(
          "step {:>5}/{} | loss {:.4f} | grad norm {:.3f} | lr {:.2e} | {:.0f} tok/s | {} elapsed, ETA {} | mem {:.0f} MiB",
          step, rc.train.steps, loss, grad_norm, lr, tok_s, duration(elapsed), duration(eta), rss_mib());
      if (tty) {
        const int width = 30, done = static_cast<int>(width * step / rc.train.steps);
        out << "\r\033[K" << line << "\n"
            << "[" << std::string(static_cast<size_t>(done), '#') << std::string(static_cast<size_t>(width - done), '.')
            << "] " << fmt::format("{}%", 100 * step / rc.train.steps) << std::flush;
      } else {
        out << line << "\n" << std::flush;
      }
    }
    if (step == start_step + 1) {
      // Where the memory goes, once the first step has shown the activation and K/V peaks.
      const MemoryReport mem = memory_report(state, stats.activation_high_water, stats.kv_bytes);
      out << (tty ? "\r\033[K" : "") << fmt::format("memory ({}): {}\n", device_name(device), mem.line());
      nlohmann::json mj = {{"step", step}};
      for (const auto& [name, bytes] : mem.categories()) mj["memory_" + name] = bytes;
      metrics.append(mj);
    }
    const bool last = step == rc.train.steps;
    if ((rc.eval.every > 0 && step % rc.eval.every == 0) || last) {
      const double el = evaluate();
      metrics.append({{"step", step}, {"eval_loss", el}, {"tokens", tokens_seen}});
      eval_tokens.push_back(static_cast<double>(tokens_seen));
      eval_loss.push_back(el);
      result.last_eval_loss = el;
      out << (tty ? "\r\033[K" : "") << fmt::format("step {:>5}: eval loss {:.4f} ({:.3f} bits per token)\n", step, el,
                                                 el / std::log(2.0));
    }
    const bool stop = g_signals.load() > 0 || (opt.stop_after > 0 && step - start_step >= opt.stop_after && !last);
    if ((rc.checkpoint.every > 0 && step % rc.checkpoint.every == 0) || last || stop) save(step);
    if (stop) {
      out << (tty ? "\r\033[K" : "") << fmt::format("stopped: saved step {} in {}; continue with --resume\n", step,
                                                 result.run_dir);
      result.interrupted = true;
      break;
    }
  }
  if (tty) out << "\r\033[K";
  result.last_step = step;
  result.last_loss = last_loss;
  if (rc.log.plot && !plot_tokens.empty() && png_output_available()) {
    ChartOptions co;
    co.title = fmt::format("{} / {}: loss against tokens", rc.model.source, rc.schedule.name);
    co.x_label = "tokens seen";
    co.y_label = "loss (nats per token)";
    std::vector<Series> series{{"train loss", plot_tokens, plot_loss, chart_palette(0), false}};
    if (!eval_tokens.empty()) series.push_back({"eval loss", eval_tokens, eval_loss, chart_palette(1), true});
    write_line_chart((fs::path(result.run_dir) / "loss.png").string(), series, co);
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  out << fmt::format("done: step {}, loss {:.4f}{}, {} in {}\n", step, last_loss,
                     result.last_eval_loss ? fmt::format(", eval loss {:.4f}", *result.last_eval_loss) : "",
                     result.interrupted ? "interrupted" : "finished", duration(total));
  if (opt.print_sample && !result.interrupted && rc.sample.tokens > 0) {
    SampleOptions so;
    so.prompt = rc.sample.prompt;
    so.tokens = rc.sample.tokens;
    so.temperature = rc.sample.temperature;
    so.top_k = rc.sample.top_k;
    so.top_p = rc.sample.top_p;
    so.seed = rc.sample.seed;
    // Sampling runs on the host, from the master weights.
    LlamaModel host_model(mc, state.master_dtype());
    copy_params(host_model.params(), state.master_on_host());
    out << "sample:\n" << rc.sample.prompt << generate(host_model, tokenizer, so) << "\n";
  }
  return result;
}

}  // namespace cw
