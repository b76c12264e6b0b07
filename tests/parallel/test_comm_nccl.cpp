// parallel/comm_nccl.h on the GPU machine: the whole path from launcher variables to collectives
// (world size 1 on one GPU, split included; a launched gradcheck --zero 3 on that world, its
// collectives NCCL's, against one process), a rank that never joins (rank 0 fails in the bootstrap,
// within its timeout), and, where 2 GPUs are visible, real sums across two ranks (integer-valued
// data, so every sum is exact in bf16 and compared bit for bit), split groups, and a collective one
// rank never issues (the watchdog fails the other within the collective timeout, naming it).
#include "parallel/comm_nccl.h"
#include "parallel/context_parallel.h"

#include "tests/gpu_support.h"
#include "tests/parallel/net_support.h"
#include "tools/gradcheck.h"

#include <doctest/doctest.h>

#include <chrono>
#include <latch>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace cw;
using test::fetch;
using test::free_tcp_port;
using test::same_bits;

namespace {

// How much later than its timeout a failure may arrive: NCCL's own start-up and teardown and the
// watchdog's poll interval, never the order of the timeout itself.
constexpr double kLateSeconds = 5.0;

bool nccl_ready() { return test::gpu_ready() && nccl_available(); }
bool two_gpus_ready() { return nccl_ready() && gpu::device_count() >= 2; }

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return Seconds(Clock::now() - t).count(); }

NcclOptions test_options(double collective_timeout_s = 60, double bootstrap_timeout_s = 60) {
  NcclOptions o;
  o.bootstrap_timeout = Seconds(bootstrap_timeout_s);
  o.collective_timeout = Seconds(collective_timeout_s);
  o.exit_on_failure = false;  // a failure must reach the test as an error, not end the process
  return o;
}

// A host f64 tensor of small integers (exact in bf16, and so is every sum of two).
OwnedTensor small_integers(int64_t n, uint64_t seed) {
  OwnedTensor t = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{n});
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> value(-8, 8);
  for (int64_t i = 0; i < n; ++i) t.tensor.ptr<double>()[i] = value(rng);
  return t;
}

// `host` (f64) converted to `dtype` on GPU `device`.
OwnedTensor upload(const Tensor& host, DType dtype, int device) {
  OwnedTensor d = OwnedTensor::on(Device::gpu(device), dtype, {host.numel()});
  gpu::copy_convert(d, host);
  return d;
}

// A device tensor of n NaNs (elements a collective fails to write stay NaN).
OwnedTensor poisoned(DType dtype, int64_t n, int device) {
  OwnedTensor d = OwnedTensor::on(Device::gpu(device), dtype, {n});
  gpu::fill(d, std::numeric_limits<double>::quiet_NaN());
  return d;
}

void expect_bits(const Tensor& device_result, const Tensor& expected, const std::string& what) {
  INFO(what);
  CHECK(same_bits(fetch(device_result), expected));
}

}  // namespace

TEST_CASE("nccl: world size 1 from launcher variables, every collective on fresh random f32, bf16 and f64 data" *
          doctest::skip(!nccl_ready())) {
  const int port = free_tcp_port();
  const LaunchInfo info = read_launch_info(environment_from(
      {{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}}));
  std::unique_ptr<Communicator> comm = make_nccl_communicator(info, 0, test_options());
  CHECK(comm->rank() == 0);
  CHECK(comm->size() == 1);
  CHECK(comm->backend() == "nccl");
  CHECK(comm->device() == Device::gpu(0));

  const uint64_t seed = std::random_device()();
  CAPTURE(seed);
  const int64_t n = 4097;  // odd: no vector-width luck
  for (const DType dt : {DType::f32, DType::bf16, DType::f64}) {
    CAPTURE(std::string(dtype_name(dt)));
    // all_reduce over one rank: the identity.
    test::GpuInput x = test::make_gpu_input(dt, {n}, seed, 1);
    comm->all_reduce(x.dev)->wait();
    expect_bits(x.dev, x.ref, "all_reduce");

    // all_gather and reduce_scatter over one rank: copies into a poisoned output.
    test::GpuInput in = test::make_gpu_input(dt, {n}, seed, 2);
    OwnedTensor gathered = poisoned(dt, n, 0);
    comm->all_gather(gathered, in.dev)->wait();
    expect_bits(gathered, in.ref, "all_gather");
    OwnedTensor scattered = poisoned(dt, n, 0);
    comm->reduce_scatter(scattered, in.dev)->wait();
    expect_bits(scattered, in.ref, "reduce_scatter");

    // In place in NCCL's form: out is in's (or in is out's) slice at this rank.
    test::GpuInput y = test::make_gpu_input(dt, {n}, seed, 3);
    comm->reduce_scatter(y.dev, y.dev)->wait();
    comm->all_gather(y.dev, y.dev)->wait();
    expect_bits(y.dev, y.ref, "in-place reduce_scatter and all_gather");

    // all_to_all over one rank: its one block, copied into a poisoned output.
    test::GpuInput blocks = test::make_gpu_input(dt, {n}, seed, 5);
    OwnedTensor exchanged = poisoned(dt, n, 0);
    comm->all_to_all(exchanged, blocks.dev)->wait();
    expect_bits(exchanged, blocks.ref, "all_to_all");

    test::GpuInput b = test::make_gpu_input(dt, {n}, seed, 4);
    comm->broadcast(b.dev, 0)->wait();
    expect_bits(b.dev, b.ref, "broadcast");

    test::GpuInput to_root = test::make_gpu_input(dt, {n}, seed, 6);
    comm->reduce(to_root.dev, 0)->wait();
    expect_bits(to_root.dev, to_root.ref, "reduce");
  }
  // Zero elements: nothing to move, and nothing goes wrong.
  OwnedTensor empty = OwnedTensor::on(Device::gpu(0), DType::f32, {0});
  comm->all_reduce(empty)->wait();
  comm->all_gather(empty, empty)->wait();
  comm->barrier();

  // Operand errors, each one clear line before anything is issued.
  OwnedTensor f32 = OwnedTensor::on(Device::gpu(0), DType::f32, {8});
  OwnedTensor f32_small = OwnedTensor::on(Device::gpu(0), DType::f32, {7});
  OwnedTensor bf16 = OwnedTensor::on(Device::gpu(0), DType::bf16, {8});
  OwnedTensor i32 = OwnedTensor::on(Device::gpu(0), DType::i32, {8});
  OwnedTensor host = OwnedTensor::of_shape(DType::f32, std::vector<int64_t>{8});
  CHECK_THROWS_WITH_AS(comm->all_reduce(i32), doctest::Contains("sums f32, bf16 and f64 tensors, not i32"), Error);
  CHECK_THROWS_WITH_AS(comm->all_reduce(host), doctest::Contains("all_reduce: t is on cpu"), Error);
  CHECK_THROWS_WITH_AS(comm->reduce_scatter(f32_small, f32), doctest::Contains("out has 7 elements, in 8"), Error);
  CHECK_THROWS_WITH_AS(comm->all_gather(f32, bf16), doctest::Contains("out is f32, in is bf16"), Error);
  CHECK_THROWS_WITH_AS(comm->broadcast(f32, 1), doctest::Contains("root 1 is not a rank of 1"), Error);
  CHECK_THROWS_WITH_AS(comm->reduce(f32, 1), doctest::Contains("reduce: root 1 is not a rank of 1"), Error);
  const Tensor shifted = f32.tensor.slice(0, 1, 7), head = f32.tensor.slice(0, 0, 7);
  CHECK_THROWS_WITH_AS(comm->all_gather(shifted, head), doctest::Contains("out and in overlap"), Error);
  CHECK_THROWS_WITH_AS(comm->all_to_all(f32, f32), doctest::Contains("all_to_all: out and in overlap"), Error);
  CHECK_THROWS_WITH_AS(comm->all_to_all(f32_small, f32), doctest::Contains("out has 7 elements, in 8"), Error);
  // The communicator still works after refusing them.
  comm->barrier();

  // split with one rank (what a DP x TP grid makes at world size 1): a communicator of its own, and
  // none for a negative color; the parent goes on working beside it.
  const std::unique_ptr<Communicator> own = comm->split(0, 0);
  REQUIRE(own != nullptr);
  CHECK(own->rank() == 0);
  CHECK(own->size() == 1);
  CHECK(own->device() == Device::gpu(0));
  test::GpuInput z = test::make_gpu_input(DType::f32, {n}, seed, 5);
  own->all_reduce(z.dev)->wait();
  comm->all_reduce(z.dev)->wait();
  expect_bits(z.dev, z.ref, "all_reduce on the split communicator and its parent");
  own->barrier();
  CHECK(comm->split(-1, 0) == nullptr);
  comm->barrier();
}

TEST_CASE("nccl: a launched gradcheck --zero 3 in a world of one rank: the NCCL path against one process (f32)" *
          doctest::skip(!nccl_ready())) {
  // What a launched gradcheck runs on each of its processes (tools/gradcheck.h): ZeRO 3's block
  // all-gathers, gradient reduce-scatters and the shards' gathers for the comparison through NCCL,
  // the result handed over through --gather-dir, against one process on the GPU at the launched
  // check's default tolerance.
  std::unique_ptr<Communicator> comm =
      make_nccl_communicator(test::local_rank_info(0, 1, free_tcp_port()), 0, test_options());
  const test::TempDir dir("nccl-zero3-gradcheck");
  GradcheckOptions o;
  o.model = "tiny-tp";
  o.seq = 16;
  o.batch = 2;
  o.dtype = "f32";
  o.schedule.kind = ScheduleKind::seco;
  o.schedule.chunk = 4;
  o.parallel.dp = 1;
  o.parallel.zero = 3;
  o.gather_dir = dir.path.string();
  std::ostringstream out;
  const int code = run_gradcheck(o, out, comm.get());
  INFO(out.str());
  CHECK(code == 0);
  CHECK(out.str().find("processes through NCCL") != std::string::npos);
  CHECK(out.str().find("zero 3: first step, rank 0:") != std::string::npos);
  CHECK(out.str().find("zero 3 against zero 0 after 3 steps") != std::string::npos);
  CHECK(std::filesystem::exists(dir.path / "zero3" / "rank-0.safetensors"));
  comm->barrier();  // the communicator still works after the check
}

TEST_CASE("nccl: a world of 2 whose rank 1 never joins fails rank 0 within the bootstrap timeout" *
          doctest::skip(!nccl_ready())) {
  const int port = free_tcp_port();
  const LaunchInfo info = test::local_rank_info(0, 2, port);
  const double timeout = 2;
  const auto start = Clock::now();
  const std::string expected = "rank 0: rank 1 of 2 did not connect to 127.0.0.1:" + std::to_string(port);
  CHECK_THROWS_WITH_AS(make_nccl_communicator(info, 0, test_options(60, timeout)),
                       doctest::Contains(expected.c_str()), Error);
  const double elapsed = seconds_since(start);
  CHECK(elapsed >= timeout);
  CHECK(elapsed < timeout + kLateSeconds);
}

TEST_CASE("nccl: two ranks on 2 GPUs sum, scatter, gather, exchange and broadcast exactly, and exchange tokens for heads (skipped with fewer GPUs)" *
          doctest::skip(!two_gpus_ready())) {
  const int port = free_tcp_port();
  const uint64_t seed = std::random_device()();
  CAPTURE(seed);
  const int64_t n = 1001;
  // Both ranks' inputs, on the host, so each rank can build the expected results.
  const auto input = [&](int rank, int which, int64_t count) { return small_integers(count, seed + 16 * rank + which); };
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        auto comm = make_nccl_communicator(test::local_rank_info(r, 2, port), r, test_options());
        for (const DType dt : {DType::f32, DType::bf16, DType::f64}) {
          const std::string tag = CW_FORMAT("rank {} {}: ", r, dtype_name(dt));
          // all_reduce: x0 + x1.
          OwnedTensor x = upload(input(r, 0, n), dt, r);
          comm->all_reduce(x)->wait();
          OwnedTensor sum = input(0, 0, n);
          const OwnedTensor x1 = input(1, 0, n);
          for (int64_t i = 0; i < n; ++i) sum.tensor.ptr<double>()[i] += x1.tensor.ptr<double>()[i];
          if (!same_bits(fetch(x), sum)) errors[r] += tag + "all_reduce differs; ";

          // reduce_scatter: in [2n] per rank; rank r gets the sum of slices [r n, +n).
          OwnedTensor in = upload(input(r, 1, 2 * n), dt, r);
          OwnedTensor out = poisoned(dt, n, r);
          comm->reduce_scatter(out, in)->wait();
          const OwnedTensor in0 = input(0, 1, 2 * n), in1 = input(1, 1, 2 * n);
          OwnedTensor part = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{n});
          for (int64_t i = 0; i < n; ++i)
            part.tensor.ptr<double>()[i] = in0.tensor.ptr<double>()[r * n + i] + in1.tensor.ptr<double>()[r * n + i];
          if (!same_bits(fetch(out), part)) errors[r] += tag + "reduce_scatter differs; ";

          // all_gather: [in0, in1].
          OwnedTensor piece = upload(input(r, 2, n), dt, r);
          OwnedTensor gathered = poisoned(dt, 2 * n, r);
          comm->all_gather(gathered, piece)->wait();
          OwnedTensor both = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{2 * n});
          for (int q = 0; q < 2; ++q) {
            const OwnedTensor p = input(q, 2, n);
            for (int64_t i = 0; i < n; ++i) both.tensor.ptr<double>()[q * n + i] = p.tensor.ptr<double>()[i];
          }
          if (!same_bits(fetch(gathered), both)) errors[r] += tag + "all_gather differs; ";

          // all_to_all: in [2n] per rank; rank r gets [rank 0's block r, rank 1's block r].
          OwnedTensor blocks = upload(input(r, 6, 2 * n), dt, r);
          OwnedTensor exchanged = poisoned(dt, 2 * n, r);
          comm->all_to_all(exchanged, blocks)->wait();
          OwnedTensor mine = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{2 * n});
          for (int q = 0; q < 2; ++q) {
            const OwnedTensor p = input(q, 6, 2 * n);
            for (int64_t i = 0; i < n; ++i) mine.tensor.ptr<double>()[q * n + i] = p.tensor.ptr<double>()[r * n + i];
          }
          if (!same_bits(fetch(exchanged), mine)) errors[r] += tag + "all_to_all differs; ";

          // broadcast from rank 1.
          OwnedTensor b = upload(input(r, 3, n), dt, r);
          comm->broadcast(b, 1)->wait();
          if (!same_bits(fetch(b), input(1, 3, n))) errors[r] += tag + "broadcast differs; ";

          // reduce to rank 1 (in place): x0 + x1 there; rank 0's buffer is unspecified afterwards.
          OwnedTensor to_root = upload(input(r, 0, n), dt, r);
          comm->reduce(to_root, 1)->wait();
          if (r == 1 && !same_bits(fetch(to_root), sum)) errors[r] += tag + "reduce differs; ";
        }
        // split: one group ranked by a descending key (the ranks swap places), and a group each.
        const std::unique_ptr<Communicator> reversed = comm->split(0, 1 - r), alone = comm->split(r, 0);
        if (reversed->rank() != 1 - r || reversed->size() != 2) errors[r] += "split: reversed ranks wrong; ";
        if (alone->rank() != 0 || alone->size() != 1) errors[r] += "split: a group of one is wrong; ";
        OwnedTensor piece = upload(input(r, 4, n), DType::f32, r);
        OwnedTensor gathered = poisoned(DType::f32, 2 * n, r);
        reversed->all_gather(gathered, piece)->wait();
        OwnedTensor swapped = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{2 * n});
        for (int q = 0; q < 2; ++q) {
          const OwnedTensor p = input(1 - q, 4, n);
          for (int64_t i = 0; i < n; ++i) swapped.tensor.ptr<double>()[q * n + i] = p.tensor.ptr<double>()[i];
        }
        if (!same_bits(fetch(gathered), swapped)) errors[r] += "split: all_gather in key order differs; ";
        OwnedTensor own = upload(input(r, 5, n), DType::f32, r);
        alone->all_reduce(own)->wait();
        if (!same_bits(fetch(own), input(r, 5, n))) errors[r] += "split: a group of one's all_reduce differs; ";

        // Context parallelism's exchange (parallel/context_parallel.h) on the device: each rank's 3
        // tokens of 4 heads become both ranks' 6 tokens of 2 heads; one K/V head goes to both ranks,
        // and its gradient comes back summed over the two.
        const int64_t B = 2, tn = 3, G = 4, D = 5;
        const auto tokens_of = [&](int q, int which, int64_t heads) { return input(q, 7 + which, B * tn * heads * D); };
        OwnedTensor x = upload(tokens_of(r, 0, G), DType::f32, r);
        OwnedTensor y = poisoned(DType::f32, B * 2 * tn * 2 * D, r);
        cp_to_heads_forward(*comm, x.tensor.view({B, tn, G, D}), y.tensor.view({B, 2 * tn, 2, D}));
        OwnedTensor want = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{B * 2 * tn * 2 * D});
        for (int q = 0; q < 2; ++q) {
          const OwnedTensor xq = tokens_of(q, 0, G);
          for (int64_t b = 0; b < B; ++b)
            for (int64_t i = 0; i < tn; ++i)
              for (int64_t h = 0; h < 2; ++h)
                for (int64_t d = 0; d < D; ++d)
                  want.tensor.ptr<double>()[((b * 2 * tn + q * tn + i) * 2 + h) * D + d] =
                      xq.tensor.ptr<double>()[((b * tn + i) * G + 2 * r + h) * D + d];
        }
        if (!same_bits(fetch(y), want)) errors[r] += "cp_to_heads_forward differs; ";
        OwnedTensor d_y = upload(input(r, 9, B * 2 * tn * D), DType::f32, r);  // the one K/V head's gradient
        OwnedTensor d_x = poisoned(DType::f32, B * tn * D, r);
        cp_to_heads_backward(*comm, d_y.tensor.view({B, 2 * tn, 1, D}), d_x.tensor.view({B, tn, 1, D}));
        OwnedTensor summed = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{B * tn * D});
        const OwnedTensor d_y0 = input(0, 9, B * 2 * tn * D), d_y1 = input(1, 9, B * 2 * tn * D);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t i = 0; i < tn * D; ++i) {
            const int64_t at = (b * 2 * tn + r * tn) * D + i;
            summed.tensor.ptr<double>()[b * tn * D + i] = d_y0.tensor.ptr<double>()[at] + d_y1.tensor.ptr<double>()[at];
          }
        if (!same_bits(fetch(d_x), summed)) errors[r] += "cp_to_heads_backward's replica sum differs; ";
        comm->barrier();
      } catch (const std::exception& e) {
        errors[r] += e.what();
      }
    });
  }
  for (std::thread& t : ranks) t.join();
  CHECK(errors[0] == "");
  CHECK(errors[1] == "");
}

TEST_CASE("nccl: a collective one rank never issues times out on the other, naming it (skipped with fewer than 2 GPUs)" *
          doctest::skip(!two_gpus_ready())) {
  const int port = free_tcp_port();
  const double timeout = 2;
  std::latch rank0_done(1);
  std::string rank0_error, rank1_error;
  double rank0_seconds = 0;
  std::thread rank1([&] {
    try {
      auto comm = make_nccl_communicator(test::local_rank_info(1, 2, port), 1, test_options(timeout));
      rank0_done.wait();  // issues nothing: rank 0's all_reduce has no partner
    } catch (const std::exception& e) {
      rank1_error = e.what();
      rank0_done.wait();
    }
  });
  try {
    auto comm = make_nccl_communicator(test::local_rank_info(0, 2, port), 0, test_options(timeout));
    OwnedTensor x = OwnedTensor::on(Device::gpu(0), DType::f32, {1000});
    gpu::fill(x, 1.0);
    const auto start = Clock::now();
    try {
      comm->all_reduce(x)->wait();
      comm->barrier();  // the host waits here, until the watchdog fires
    } catch (const Error& e) {
      rank0_error = e.what();
    }
    rank0_seconds = seconds_since(start);
    CHECK_THROWS_WITH_AS(comm->barrier(), doctest::Contains("all_reduce of 1000 x f32"), Error);  // and stays failed
  } catch (const std::exception& e) {
    rank0_error = std::string("unexpected: ") + e.what();
  }
  rank0_done.count_down();
  rank1.join();
  INFO(rank0_error);
  CHECK(rank0_error.find("all_reduce of 1000 x f32 on rank 0 of 2 (GPU 0) did not finish within 2 s") != std::string::npos);
  CHECK(rank0_seconds >= timeout);
  CHECK(rank0_seconds < timeout + kLateSeconds);
  CHECK(rank1_error == "");
}
