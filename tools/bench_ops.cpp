#include "tools/bench_ops.h"

#include "engine/cuda/runtime.h"
#include "engine/ops/embedding.h"
#include "engine/ops/linear.h"
#include "engine/ops/residual.h"
#include "engine/ops/rmsnorm.h"
#include "engine/ops/rope.h"
#include "engine/ops/swiglu.h"
#include "engine/random.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <ostream>

namespace cw {

namespace {
// A device tensor of random values (drawn on the host in f32, converted on upload).
OwnedTensor random_on_gpu(DType dt, std::initializer_list<int64_t> shape, uint64_t stream, double mean = 0.0) {
  OwnedTensor host(DType::f32, shape);
  fill_normal(host, 77, stream, mean, 1.0);
  OwnedTensor dev = OwnedTensor::on(Device::gpu(0), dt, shape);
  copy_convert(dev, host);
  return dev;
}
}  // namespace

void run_bench_ops(const BenchOpsOptions& o, std::ostream& out) {
  if (!gpu::available()) fail("bench-ops needs a GPU", "run it on the GPU machine (tools/gpu-check)");
  const DType dt = parse_dtype(o.dtype);
  const int64_t N = o.tokens, C = o.hidden, F = o.ffn, H = o.heads, D = o.head_dim, V = o.vocab;
  const double es = static_cast<double>(dtype_size(dt));
  const Device g = Device::gpu(0);
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

  struct Row {
    std::string op;
    double ms, bytes, flops;
  };
  std::vector<Row> rows;
  auto bench = [&](const std::string& name, double bytes, double flops, const std::function<void()>& fn) {
    rows.push_back({name, gpu::median_ms(fn, 0, 3, o.repeat), bytes, flops});
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

  const double copy_gbs = rows[0].bytes / (rows[0].ms * 1e-3) / 1e9;
  out << fmt::format("bench-ops: {} tokens, hidden {}, ffn {}, {} heads x {}, dtype {}, median of {} (CUDA events)\n",
                     N, C, F, H, D, o.dtype, o.repeat);
  out << fmt::format("{:<20} {:>9} {:>10} {:>10} {:>10}\n", "op", "ms", "GB/s", "% copy", "TFLOP/s");
  nlohmann::json j = nlohmann::json::array();
  for (const Row& r : rows) {
    const double gbs = r.bytes > 0 ? r.bytes / (r.ms * 1e-3) / 1e9 : 0;
    const double tflops = r.flops > 0 ? r.flops / (r.ms * 1e-3) / 1e12 : 0;
    out << fmt::format("{:<20} {:>9.4f} {:>10} {:>10} {:>10}\n", r.op, r.ms, gbs > 0 ? fmt::format("{:.0f}", gbs) : "",
                       gbs > 0 ? fmt::format("{:.0f}%", 100 * gbs / copy_gbs) : "",
                       tflops > 0 ? fmt::format("{:.0f}", tflops) : "");
    j.push_back({{"op", r.op}, {"ms", r.ms}, {"gb_s", gbs}, {"tflop_s", tflops}, {"copy_share", gbs / copy_gbs}});
  }
  if (!o.json.empty()) std::ofstream(o.json) << j.dump(2) << "\n";
}

}  // namespace cw
