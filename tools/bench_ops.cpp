#include "tools/bench_ops.h"

#include "chunkwise_config.h"
#include "engine/engine.h"
#include "engine/ops/attention.h"
#include "engine/ops/embedding.h"
#include "engine/ops/lm_head_loss.h"
#include "engine/ops/linear.h"
#include "engine/ops/residual.h"
#include "engine/ops/rmsnorm.h"
#include "engine/ops/rope.h"
#include "engine/ops/swiglu.h"
#include "engine/random.h"

#if CW_HAVE_CUDA
#include "engine/engine.h"
#endif

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <deque>
#include <exception>
#include <fstream>
#include <sstream>
#include <ostream>
#include <utility>

namespace cw {

namespace {
// A device tensor of random values (drawn on the host in f32, converted on upload).
OwnedTensor random_on_gpu(DType dt, std::initializer_list<int64_t> shape, uint64_t stream, double mean = 0.0,
                          double stddev = 1.0) {
  OwnedTensor host(DType::f32, shape);
  fill_normal(host, 77, stream, mean, stddev);
  OwnedTensor dev = OwnedTensor::on(Device::gpu(0), dt, shape);
  copy_convert(dev, host);
  return dev;
}

// Uniform labels / ids in [0, n) on the device.
OwnedTensor random_ids_on_gpu(int64_t count, int64_t n, uint64_t seed) {
  OwnedTensor host(DType::i32, {count}), dev = OwnedTensor::on(Device::gpu(0), DType::i32, {count});
  Rng rng(seed);
  for (int64_t i = 0; i < count; ++i)
    host.tensor.ptr<int32_t>()[i] = static_cast<int32_t>(rng.below(static_cast<uint64_t>(n)));
  copy_convert(dev, host);
  return dev;
}

struct Row {
  Row(std::string name, double ms_, double bytes_, double flops_)
      : op(std::move(name)), ms(ms_), bytes(bytes_), flops(flops_) {}
  std::string op;
  double ms = 0, bytes = 0, flops = 0;
  std::string status = "ok";  // ok | unsupported | error (the new rows; the old ones are always ok)
  std::string note;           // implementation, reason, extra memory: free text for the table
  nlohmann::json extra = nlohmann::json::object();  // more JSON fields for this row
};

// The first line of an exception's message: a row note, not a report.
std::string first_line(const std::exception& e) {
  std::string m = e.what();
  return m.substr(0, m.find('\n'));
}

#if CW_HAVE_CUDA
// One attention call's operands on the GPU: c queries against S keys, batch 1; q, k, v and d_out
// random (streams seed..seed+3), the f32 dK, dV accumulators zeroed, the rest written by the calls.
struct AttentionOperands {
  OwnedTensor q, k, v, d_out, out, lse, d_q, d_k, d_v;
  AttentionOperands(DType dt, int64_t c, int64_t S, int64_t H, int64_t Hkv, int64_t D, uint64_t seed)
      : q(random_on_gpu(dt, {1, c, H, D}, seed)),
        k(random_on_gpu(dt, {1, S, Hkv, D}, seed + 1)),
        v(random_on_gpu(dt, {1, S, Hkv, D}, seed + 2)),
        d_out(random_on_gpu(dt, {1, c, H, D}, seed + 3)),
        out(OwnedTensor::on(Device::gpu(0), dt, {1, c, H, D})),
        lse(OwnedTensor::on(Device::gpu(0), DType::f32, {1, H, c})),
        d_q(OwnedTensor::on(Device::gpu(0), dt, {1, c, H, D})),
        d_k(OwnedTensor::on(Device::gpu(0), DType::f32, {1, S, Hkv, D})),
        d_v(OwnedTensor::on(Device::gpu(0), DType::f32, {1, S, Hkv, D})) {
    fill(d_k, 0.0);
    fill(d_v, 0.0);
  }
};
#endif

// Times attention forward and backward for one shape and one implementation: "cudnn", "flash"
// (our kernel as training runs it by default: the wgmma kernels on an H100, the fused backward with
// atomic dQ), "flash-mma" (the same with the mma.sync kernels forced), "flash-det" (our kernel
// with cw::deterministic() on: the two-kernel mma.sync backward) or "flash-simt" (the SIMT kernels;
// with mma.sync the families that take a score cap). softcap: the calls' score cap (0: none). Rows named
// "attn fwd|bwd H/Hkv/D T impl" (ops_vs_torch.py builds the same names), " cap X" after the shape
// with a cap.
void bench_attention(std::vector<Row>& rows, DType dt, int64_t T, int64_t H, int64_t Hkv, int64_t D, int repeat,
                     const std::string& impl, double softcap) {
  const std::string shape =
      fmt::format("{}/{}/{} {}{}", H, Hkv, D, T, softcap > 0 ? fmt::format(" cap {:g}", softcap) : "");
  const bool cudnn = impl == "cudnn";
  const double fwd_flops = 4.0 * double(H) * double(T) * double(T) * double(D) / 2.0;
  Row fwd{fmt::format("attn fwd {} {}", shape, impl), 0, 0, fwd_flops};
  Row bwd{fmt::format("attn bwd {} {}", shape, impl), 0, 0, 2.5 * fwd_flops};
  for (Row* r : {&fwd, &bwd}) r->extra = {{"kind", "attention"}, {"impl", impl}, {"tokens", T}, {"heads", H},
                                          {"kv_heads", Hkv}, {"head_dim", D}, {"softcap", softcap}};
#if CW_HAVE_CUDA
  try {
    Arena scratch(Device::gpu(0));
    const AttentionOperands ops(dt, T, T, H, Hkv, D, 40);
    const auto& [q, k, v, d_out, out, lse, d_q, d_k, d_v] = ops;
    const AttentionKernel family = cudnn                 ? AttentionKernel::cudnn
                                   : impl == "flash-mma"  ? AttentionKernel::flash_mma
                                   : impl == "flash-simt" ? AttentionKernel::flash_simt
                                                          : AttentionKernel::flash;
    std::string why;
    try {  // the chooser says whether the family can take both directions (and why not)
      choose_attention_kernel(attention_call(q, k, v, out, &d_q.tensor, &d_out.tensor, &d_k.tensor, &d_v.tensor,
                                             AttentionMask::causal, {}, softcap),
                              {family, impl == "flash-det"});
    } catch (const Error& e) {
      why = first_line(e);
    }
    if (!why.empty()) {
      for (Row* r : {&fwd, &bwd}) r->status = "unsupported", r->note = impl + " unsupported: " + why;
    } else {
      // The family and the determinism switch for these rows, restored however the timing ends.
      const SettingScope<AttentionKernel> kernel(attention_kernel, set_attention_kernel, family);
      const SettingScope<bool> determinism(deterministic, set_deterministic, impl == "flash-det");
      const double scale = 1.0 / std::sqrt(double(D));
      const AttentionSaved saved{lse};
      auto forward = [&] {
        ArenaScope s(scratch);
        attention_forward(out, saved, q, k, v, scale, scratch, AttentionMask::causal, {}, softcap);
      };
      fwd.ms = median_ms(forward, Device::gpu(0), 3, repeat);
      forward();  // out and lse of these inputs for the backward
      // d_k, d_v keep accumulating over the repeats (the op adds): values grow by ~repeat x, harmless.
      bwd.ms = median_ms([&] {
        ArenaScope s(scratch);
        attention_backward(d_q, d_k, d_v, d_out, saved, q, k, v, out, scale, GradMode::overwrite, scratch,
                           AttentionMask::causal, {}, softcap);
      }, Device::gpu(0), 3, repeat);
      fwd.note = bwd.note = impl;
    }
  } catch (const std::exception& e) {
    for (Row* r : {&fwd, &bwd}) r->status = "error", r->note = impl + ": " + first_line(e);
  }
#else
  (void)dt, (void)repeat;
  for (Row* r : {&fwd, &bwd}) r->status = "unsupported", r->note = "no CUDA in this build";
#endif
  rows.push_back(std::move(fwd));
  rows.push_back(std::move(bwd));
}

// "A:B:..." of a row option: `count` integers separated by colons; empty where the text is not that.
std::vector<int64_t> parse_colon_integers(const std::string& spec, size_t count) {
  std::vector<int64_t> values;
  std::istringstream parts(spec);
  std::string part;
  while (std::getline(parts, part, ':')) {
    size_t used = 0;
    try {
      values.push_back(std::stoll(part, &used));
    } catch (const std::exception&) {
      return {};
    }
    if (used != part.size()) return {};
  }
  // getline drops a trailing empty part ("512:2048:"): a colon at the end is one part too many.
  if (values.size() != count || (!spec.empty() && spec.back() == ':')) return {};
  return values;
}

// "C:S" of --chunk-attention: a chunk of C queries against S keys, S a multiple of C.
std::pair<int64_t, int64_t> parse_chunk_attention(const std::string& spec) {
  const std::vector<int64_t> v = parse_colon_integers(spec, 2);
  if (v.empty() || v[0] <= 0 || v[1] < v[0] || v[1] % v[0] != 0)
    fail(fmt::format("bench-ops --chunk-attention '{}': expected CHUNK:KEYS", spec),
         "give the chunk's queries and the keys it sees, KEYS a multiple of CHUNK (e.g. 4096:131072)");
  return {v[0], v[1]};
}

// "O:I" of --linears.
std::pair<int64_t, int64_t> parse_linear(const std::string& spec) {
  const std::vector<int64_t> v = parse_colon_integers(spec, 2);
  if (v.empty() || v[0] <= 0 || v[1] <= 0)
    fail(fmt::format("bench-ops --linears '{}': expected OUT:IN", spec),
         "give the linear's output and input features, e.g. 512:2048 (Llama-3.2-1B's k_proj)");
  return {v[0], v[1]};
}

// "H:HKV:D" of --attention-shapes: query heads, K/V heads dividing them, an even head dim.
struct HeadShape {
  int64_t H, Hkv, D;
};
HeadShape parse_head_shape(const std::string& spec) {
  const std::vector<int64_t> v = parse_colon_integers(spec, 3);
  if (v.empty() || v[0] <= 0 || v[1] <= 0 || v[0] % v[1] != 0 || v[2] <= 0 || v[2] % 2 != 0)
    fail(fmt::format("bench-ops --attention-shapes '{}': expected HEADS:KV_HEADS:HEAD_DIM", spec),
         "give query heads, K/V heads dividing them and an even head dim, e.g. 8:4:256 (Gemma 2 2B's)");
  return {v[0], v[1], v[2]};
}

// A linear of O outputs and I inputs at N rows: forward, d_x (overwrite) and d_W (f32, accumulated),
// first with cuBLASLt's first algorithm, then with the fastest of its candidates (engine.h,
// gemm_tuning). Rows "linear OxI fwd|dx|dW first|tuned"; FLOPs 2 N O I each.
void bench_linear(std::vector<Row>& rows, DType dt, int64_t N, int64_t O, int64_t I, int repeat) {
  const Device g = Device::gpu(0);
  OwnedTensor x = random_on_gpu(dt, {N, I}, 60), w = random_on_gpu(dt, {O, I}, 61), dy = random_on_gpu(dt, {N, O}, 62);
  OwnedTensor y = OwnedTensor::on(g, dt, {N, O}), dx = OwnedTensor::on(g, dt, {N, I});
  OwnedTensor dw = OwnedTensor::on(g, DType::f32, {O, I});
  fill(dw, 0.0);
  const double flops = 2.0 * double(N) * double(O) * double(I);
  for (const bool tuned : {false, true}) {
    const SettingScope<bool> tuning(gemm_tuning, set_gemm_tuning, tuned);
    const std::string shape = fmt::format("linear {}x{} N={}", O, I, N), how = tuned ? "tuned" : "first";
    const Tensor none{};
    rows.push_back({fmt::format("{} fwd {}", shape, how), median_ms([&] { linear_forward(y, x, w); }, g, 3, repeat), 0, flops});
    rows.push_back({fmt::format("{} dx {}", shape, how),
                    median_ms([&] { linear_backward(dx, none, dy, x, w, GradMode::overwrite); }, g, 3, repeat), 0, flops});
    rows.push_back({fmt::format("{} dW {}", shape, how),
                    median_ms([&] { linear_backward(none, dw, dy, x, w, GradMode::overwrite); }, g, 3, repeat), 0, flops});
  }
}

// One chunk of c queries (the last c of S positions) attending causally to S keys, forward and
// backward, two ways: one call (the store on the device), and block by block as the streamed K/V
// store runs it (model/kv_store.cpp's attend_forward / attend_backward without the copies: the own
// block causal, each earlier c-key block unmasked, merged in f32; in the backward every block given
// the merged out and lse, dQ summed in f32). Their ratio is the blocked form's compute cost alone.
// The one call twice: as one masked cuDNN graph (cudnn_split_prefix off: row "one-call") and as the
// engine runs it by default, the earlier keys apart (row "split"; the same as one call where the chooser
// does not pick cuDNN or S < 2c). Rows "attn chunk fwd|bwd c/S one-call|blocked|split"; FLOPs count
// the causal pairs, c (S - c) + c^2 / 2.
void bench_chunk_attention(std::vector<Row>& rows, DType dt, int64_t c, int64_t S, int64_t H, int64_t Hkv, int64_t D,
                           int repeat) {
  const double pairs = double(c) * double(S - c) + double(c) * double(c) / 2.0;
  const double fwd_flops = 4.0 * double(H) * double(D) * pairs;
  const std::string shape = fmt::format("{}/{}", c, S);
  std::vector<Row> mine;
  for (const char* form : {"one-call", "blocked", "split"}) {
    mine.emplace_back(fmt::format("attn chunk fwd {} {}", shape, form), 0, 0, fwd_flops);
    mine.emplace_back(fmt::format("attn chunk bwd {} {}", shape, form), 0, 0, 2.5 * fwd_flops);
  }
  for (Row& r : mine) r.extra = {{"kind", "chunk_attention"}, {"chunk", c}, {"keys", S}, {"heads", H},
                                 {"kv_heads", Hkv}, {"head_dim", D}};
#if CW_HAVE_CUDA
  try {
    const Device g = Device::gpu(0);
    Arena scratch(g);
    const AttentionOperands ops(dt, c, S, H, Hkv, D, 50);
    const auto& [q, k, v, d_out, out, lse, d_q, d_k, d_v] = ops;
    const double scale = 1.0 / std::sqrt(double(D));
    const AttentionSaved saved{lse};
    const int64_t blocks = S / c;
    auto block = [&](const Tensor& t, int64_t i) { return t.slice(1, i * c, c); };
    auto one_call_forward = [&] {
      ArenaScope sc(scratch);
      attention_forward(out, saved, q, k, v, scale, scratch);
    };
    auto blocked_forward = [&] {
      ArenaScope sc(scratch);
      attention_forward(out, saved, q, block(k, blocks - 1), block(v, blocks - 1), scale, scratch);
      const Tensor acc = scratch.alloc(DType::f32, {1, c, H, D}), block_out = scratch.alloc(dt, {1, c, H, D});
      const Tensor block_lse = scratch.alloc(DType::f32, {1, H, c});
      copy_convert(acc, out);
      for (int64_t i = 0; i + 1 < blocks; ++i) {
        attention_forward(block_out, {block_lse}, q, block(k, i), block(v, i), scale, scratch, AttentionMask::none);
        attention_merge(acc, lse, block_out, block_lse);
      }
      copy_convert(out, acc);
    };
    auto one_call_backward = [&] {
      ArenaScope sc(scratch);
      attention_backward(d_q, d_k, d_v, d_out, saved, q, k, v, out, scale, GradMode::overwrite, scratch);
    };
    auto blocked_backward = [&] {
      ArenaScope sc(scratch);
      attention_backward(d_q, block(d_k, blocks - 1), block(d_v, blocks - 1), d_out, saved, q, block(k, blocks - 1),
                         block(v, blocks - 1), out, scale, GradMode::overwrite, scratch);
      const Tensor dq_sum = scratch.alloc(DType::f32, {c, H * D}), dq_block = scratch.alloc(dt, {1, c, H, D});
      copy_convert(dq_sum, d_q.tensor.view({c, H * D}));
      for (int64_t i = 0; i + 1 < blocks; ++i) {
        attention_backward(dq_block, block(d_k, i), block(d_v, i), d_out, saved, q, block(k, i), block(v, i), out,
                           scale, GradMode::overwrite, scratch, AttentionMask::none);
        accumulate(dq_sum, dq_block.view({c, H * D}));
      }
      copy_convert(d_q.tensor.view({c, H * D}), dq_sum);
    };
    // One masked graph first; the setting restored however the timing ends (the rows after these
    // use the default).
    const SettingScope<bool> split(cudnn_split_prefix, set_cudnn_split_prefix, false);
    mine[0].ms = median_ms(one_call_forward, g, 3, repeat);
    one_call_forward();  // out and lse for the backward rows (every form gives the same)
    mine[1].ms = median_ms(one_call_backward, g, 3, repeat);
    set_cudnn_split_prefix(true);
    mine[4].ms = median_ms(one_call_forward, g, 3, repeat);
    mine[5].ms = median_ms(one_call_backward, g, 3, repeat);
    set_cudnn_split_prefix(split.saved());
    mine[2].ms = median_ms(blocked_forward, g, 3, repeat);
    mine[3].ms = median_ms(blocked_backward, g, 3, repeat);
    // The kernels the chooser picks for the one call and for an unmasked block (forward, backward),
    // with its reason where that is not cuDNN.
    auto picked = [&](const Tensor& kk, const Tensor& vv, bool backward, AttentionMask mask) {
      const AttentionCall call = backward ? attention_call(q, kk, vv, out, &d_q.tensor, &d_out.tensor, &d_k.tensor,
                                                           &d_v.tensor, mask)
                                          : attention_call(q, kk, vv, out, nullptr, nullptr, nullptr, nullptr, mask);
      const AttentionChoice choice = choose_attention_kernel(call, attention_flags());
      const std::string name = attention_kernel_name(choice.kernel);
      return choice.kernel == AttentionKernel::cudnn ? name : fmt::format("{} ({})", name, choice.reason);
    };
    mine[0].note = picked(k, v, false, AttentionMask::causal);
    mine[1].note = picked(k, v, true, AttentionMask::causal);
    mine[2].note = picked(block(k, 0), block(v, 0), false, AttentionMask::none);
    mine[3].note = picked(block(k, 0), block(v, 0), true, AttentionMask::none);
    mine[2].note += fmt::format(", {} calls + {} merges: {:.2f}x one call", blocks, blocks - 1, mine[2].ms / mine[0].ms);
    mine[3].note += fmt::format(", {} calls: {:.2f}x one call", blocks, mine[3].ms / mine[1].ms);
    mine[4].note = mine[0].note + fmt::format(", prefix apart: {:.2f}x one call", mine[4].ms / mine[0].ms);
    mine[5].note = mine[1].note + fmt::format(", prefix apart: {:.2f}x one call", mine[5].ms / mine[1].ms);
  } catch (const std::exception& e) {
    for (Row& r : mine) r.status = "error", r.note = first_line(e);
  }
#else
  (void)dt, (void)repeat, (void)Hkv;
  for (Row& r : mine) r.status = "unsupported", r.note = "no CUDA in this build";
#endif
  for (Row& r : mine) rows.push_back(std::move(r));
}

// The fused LM head + cross-entropy at each N in `tokens` (ascending), with its extra peak memory.
// Runs before anything else allocates on the device: then the pool's peak equals its current use
// and peak - in_use is exactly what the calls added. Operands are allocated once at the largest N
// (smaller N use the leading rows) and each N gets a fresh arena that is kept alive afterwards, so
// the next N again starts with peak == in use.
std::vector<Row> bench_lm_head(std::vector<int64_t> tokens, DType dt, int64_t C, int64_t V, int repeat) {
  std::vector<Row> rows;
  tokens.erase(std::remove_if(tokens.begin(), tokens.end(), [](int64_t n) { return n <= 0; }), tokens.end());
  std::sort(tokens.begin(), tokens.end());
  tokens.erase(std::unique(tokens.begin(), tokens.end()), tokens.end());
  if (tokens.empty()) return rows;
  const Device g = Device::gpu(0);
  const int64_t nmax = tokens.back();
  // cuBLASLt's handle and workspace are made on the first GEMM of the process and kept: make them
  // here so they do not count as the LM head's memory.
  OwnedTensor wa = random_on_gpu(dt, {64, 64}, 30), wb = random_on_gpu(dt, {64, 64}, 31);
  OwnedTensor wc = OwnedTensor::on(g, dt, {64, 64});
  linear_forward(wc, wa, wb);
  // Weights at the usual init scale (std 0.02): logits of a realistic spread, not saturated softmaxes.
  OwnedTensor x = random_on_gpu(dt, {nmax, C}, 32), w = random_on_gpu(dt, {V, C}, 33, 0.0, 0.02);
  OwnedTensor labels = random_ids_on_gpu(nmax, V, 34);
  OwnedTensor d_x = OwnedTensor::on(g, dt, {nmax, C}), d_w = OwnedTensor::on(g, DType::f32, {V, C});
  OwnedTensor row_loss = OwnedTensor::on(g, DType::f32, {nmax});
  fill(d_w, 0.0);
  std::deque<Arena> arenas;  // kept until every N is measured (see above)
  for (const int64_t N : tokens) {
    Row r{fmt::format("lm head+CE fused {}", N), 0, 0, 6.0 * double(N) * double(C) * double(V)};
    r.extra = {{"kind", "lm_head"}, {"tokens", N}, {"hidden", C}, {"vocab", V}};
    try {
      Arena& scratch = arenas.emplace_back(g);
      const Tensor xn = x.tensor.slice(0, 0, N), dxn = d_x.tensor.slice(0, 0, N);
      const Tensor ln = labels.tensor.slice(0, 0, N), rl = row_loss.tensor.slice(0, 0, N);
      synchronize(Device::gpu(0));
      const PoolStats before = pool_stats(Device::gpu(0));
      r.ms = median_ms([&] {
        lm_head_loss_fused(rl, dxn, d_w, xn, w, ln, double(N), GradMode::overwrite, scratch);
      }, Device::gpu(0), 3, repeat);
      synchronize(Device::gpu(0));
      const PoolStats after = pool_stats(Device::gpu(0));
      const double extra = double(after.peak_in_use) - double(before.in_use);
      const bool exact = before.peak_in_use <= before.in_use;
      r.extra["extra_bytes"] = extra;
      r.extra["extra_exact"] = exact;
      r.extra["outputs_bytes"] = double(dxn.bytes() + d_w.tensor.bytes() + rl.bytes());
      r.note = fmt::format("extra peak {}{:.2f} GiB", exact ? "" : ">= ", extra / double(1ull << 30));
    } catch (const std::exception& e) {
      r.status = "error";
      r.note = first_line(e);
    }
    rows.push_back(std::move(r));
  }
  return rows;
}
}  // namespace

void run_bench_ops(const BenchOpsOptions& o, std::ostream& out) {
  std::vector<std::pair<int64_t, int64_t>> chunk_shapes;  // checked first: a bad flag is an error on any machine
  for (const std::string& spec : o.chunk_attention) chunk_shapes.push_back(parse_chunk_attention(spec));
  std::vector<HeadShape> attention_shapes;
  for (const std::string& spec : o.attention_shapes) attention_shapes.push_back(parse_head_shape(spec));
  std::vector<std::pair<int64_t, int64_t>> linear_shapes;
  for (const std::string& spec : o.linears) linear_shapes.push_back(parse_linear(spec));
  if (!(o.attention_softcap >= 0 && std::isfinite(o.attention_softcap)))
    fail(fmt::format("bench-ops --attention-softcap {}: must be finite and >= 0", o.attention_softcap),
         "give Gemma 2's 50, or 0 for none");
  if (o.kv_heads <= 0 || o.heads % o.kv_heads != 0)
    fail(fmt::format("bench-ops --kv-heads {}: must divide --heads {}", o.kv_heads, o.heads),
         "give a K/V head count that divides the query heads (8 of 32 is Llama-3.2-1B's)");
  if (!gpu_available()) fail("bench-ops needs a GPU", "run it on the GPU machine (tools/gpu-check)");
  const DType dt = parse_dtype(o.dtype);
  const int64_t N = o.tokens, C = o.hidden, F = o.ffn, H = o.heads, D = o.head_dim, V = o.vocab;
  const double es = static_cast<double>(dtype_size(dt));
  const Device g = Device::gpu(0);
  // First, while nothing else is allocated (its memory figure depends on it).
  std::vector<Row> lm_rows = bench_lm_head(o.lm_head_tokens, dt, C, V, o.repeat);
  Arena scratch(g);

  OwnedTensor x = random_on_gpu(dt, {N, C}, 1), y = OwnedTensor::on(g, dt, {N, C}), w = random_on_gpu(dt, {C}, 2, 1.0);
  OwnedTensor rstd = OwnedTensor::on(g, DType::f32, {N}), dx = OwnedTensor::on(g, dt, {N, C});
  OwnedTensor dw = OwnedTensor::on(g, DType::f32, {C}), dy = random_on_gpu(dt, {N, C}, 3);
  OwnedTensor q = random_on_gpu(dt, {1, N, H, D}, 4), qr = OwnedTensor::on(g, dt, {1, N, H, D});
  OwnedTensor cos_h(DType::f32, {N, D / 2}), sin_h(DType::f32, {N, D / 2});
  rope_tables(cos_h, sin_h, D, 500000.0, RopeScaling{RopeScaling::Type::llama3, 32.0, 1.0, 4.0, 8192});
  OwnedTensor cos = OwnedTensor::on(g, DType::f32, {N, D / 2}), sin = OwnedTensor::on(g, DType::f32, {N, D / 2});
  copy_convert(cos, cos_h);
  copy_convert(sin, sin_h);
  OwnedTensor gate = random_on_gpu(dt, {N, F}, 5), up = random_on_gpu(dt, {N, F}, 6), act = OwnedTensor::on(g, dt, {N, F});
  OwnedTensor dgate = OwnedTensor::on(g, dt, {N, F}), dup = OwnedTensor::on(g, dt, {N, F}), dact = random_on_gpu(dt, {N, F}, 7);
  OwnedTensor table = random_on_gpu(dt, {V, C}, 8), ids_h(DType::i32, {N}), ids = OwnedTensor::on(g, DType::i32, {N});
  Rng rng(9);
  for (int64_t n = 0; n < N; ++n) ids_h.tensor.ptr<int32_t>()[n] = static_cast<int32_t>(rng.below(static_cast<uint64_t>(V)));
  copy_convert(ids, ids_h);
  OwnedTensor wsq = random_on_gpu(dt, {C, C}, 10), dwsq = OwnedTensor::on(g, DType::f32, {C, C});
  OwnedTensor wup = random_on_gpu(dt, {F, C}, 11), hup = OwnedTensor::on(g, dt, {N, F});

  std::vector<Row> rows;
  auto bench = [&](const std::string& name, double bytes, double flops, const std::function<void()>& fn) {
    rows.push_back({name, median_ms(fn, Device::gpu(0), 3, o.repeat), bytes, flops});
  };
  const double nc = double(N) * double(C), nf = double(N) * double(F), nq = double(N) * double(H) * double(D);
  bench("copy (d2d)", 2 * nc * es, 0, [&] { copy_convert(y, x); });
  bench("rmsnorm fwd", 2 * nc * es + 4.0 * N, 0, [&] { rmsnorm_forward(y, {rstd}, x, w, 1e-5); });
  bench("rmsnorm bwd", 3 * nc * es + 4.0 * N, 0,
        [&] { rmsnorm_backward(dx, dw, dy, {rstd}, x, w, GradMode::overwrite, scratch); });
  bench("rope fwd (q)", 2 * nq * es, 0, [&] { rope_forward(qr, q, cos, sin, 0); });
  bench("swiglu fwd", 3 * nf * es, 0, [&] { swiglu_forward(act, gate, up); });
  bench("swiglu bwd", 5 * nf * es, 0, [&] { swiglu_backward(dgate, dup, dact, gate, up, GradMode::overwrite); });
  bench("residual add", 3 * nc * es, 0, [&] { residual_forward(y, x, dy); });
  bench("embedding fwd", 2 * nc * es + 4.0 * N, 0, [&] { embedding_forward(y, ids, table); });
  OwnedTensor dtable = OwnedTensor::on(g, DType::f32, {V, C});
  // d_out read once; d_table rows read-modified-written in f32 (at most N rows).
  bench("embedding bwd", nc * es + 8.0 * nc + 4.0 * N, 0, [&] { embedding_backward(dtable, y, ids); });
  bench("linear fwd NxCxC", 0, 2.0 * nc * C, [&] { linear_forward(y, x, wsq); });
  bench("linear bwd NxCxC", 0, 4.0 * nc * C, [&] { linear_backward(dx, dwsq, dy, x, wsq, GradMode::overwrite); });
  bench("linear fwd NxCxF", 0, 2.0 * nf * C, [&] { linear_forward(hup, x, wup); });

  // The attention shapes (by default BENCHMARKS.md's op table's, 1B and 3B): cuDNN, then our flash
  // kernel with its default (fused) backward, with the mma.sync kernels, with the deterministic
  // backward, and the SIMT kernels. A family that cannot take a shape (a cap, a head dim) gives an
  // "unsupported" row saying why.
  for (const int64_t T : o.attention_tokens) {
    if (T <= 0) continue;
    for (const HeadShape& a : attention_shapes)
      for (const char* impl : {"cudnn", "flash", "flash-mma", "flash-det", "flash-simt"})
        bench_attention(rows, dt, T, a.H, a.Hkv, a.D, o.repeat, impl, o.attention_softcap);
  }
  for (const auto& [c, S] : chunk_shapes) bench_chunk_attention(rows, dt, c, S, H, o.kv_heads, D, o.repeat);
  for (const auto& [lo, li] : linear_shapes) bench_linear(rows, dt, N, lo, li, o.repeat);
  for (Row& r : lm_rows) rows.push_back(std::move(r));

  const double copy_gbs = rows[0].bytes / (rows[0].ms * 1e-3) / 1e9;
  size_t name_w = 20;
  for (const Row& r : rows) name_w = std::max(name_w, r.op.size());
  out << fmt::format("bench-ops: {} tokens, hidden {}, ffn {}, {} heads x {}, dtype {}, median of {} (CUDA events)\n",
                     N, C, F, H, D, o.dtype, o.repeat);
  out << fmt::format("{:<{}} {:>9} {:>10} {:>10} {:>10}  {}\n", "op", name_w, "ms", "GB/s", "% copy", "TFLOP/s",
                     "note");
  nlohmann::json j = nlohmann::json::array();
  for (const Row& r : rows) {
    const bool timed = r.status == "ok" && r.ms > 0;
    const double gbs = timed && r.bytes > 0 ? r.bytes / (r.ms * 1e-3) / 1e9 : 0;
    const double tflops = timed && r.flops > 0 ? r.flops / (r.ms * 1e-3) / 1e12 : 0;
    out << fmt::format("{:<{}} {:>9} {:>10} {:>10} {:>10}  {}\n", r.op, name_w,
                       timed ? fmt::format("{:.4f}", r.ms) : "-", gbs > 0 ? fmt::format("{:.0f}", gbs) : "",
                       gbs > 0 ? fmt::format("{:.0f}%", 100 * gbs / copy_gbs) : "",
                       tflops > 0 ? fmt::format("{:.0f}", tflops) : "", r.note);
    nlohmann::json row = {{"op", r.op}, {"ms", r.ms}, {"gb_s", gbs}, {"tflop_s", tflops},
                          {"copy_share", gbs / copy_gbs}};
    if (!r.extra.empty() || r.status != "ok") {
      row["status"] = r.status;
      row["note"] = r.note;
      row.update(r.extra);
    }
    j.push_back(std::move(row));
  }
  if (!o.json.empty()) std::ofstream(o.json) << j.dump(2) << "\n";
}

}  // namespace cw
