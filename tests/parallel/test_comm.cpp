// The threads backend of parallel/comm.h: every collective at group sizes 1-4 and odd lengths, f32 and
// f64, bitwise against a serial rank-ordered sum (so bitwise identical across ranks), whatever the
// threads' timing; asynchronous calls in flight together; and the failures that must not deadlock: a
// rank that throws, a rank that returns early, and ranks whose calls disagree.
//
// The checks run on the main thread after run_thread_ranks returns: the ranks only record results.
#include "engine/random.h"
#include "parallel/comm.h"
#include "tests/support.h"

#include <chrono>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

using namespace cw;

namespace {

constexpr int kMaxGroup = 4;
const int64_t kLengths[] = {1, 7, 1001};  // one element, and odd lengths that no vector width divides

// Rank r's input: random values of varied magnitude (so the order of summation shows in the bits).
OwnedTensor rank_input(DType dtype, int64_t n, int rank, uint64_t seed) {
  OwnedTensor t = OwnedTensor::of_shape(dtype, std::vector<int64_t>{n});
  fill_normal(t, seed, static_cast<uint64_t>(rank), 0.0, 1.0 + 1000.0 * rank);
  return t;
}

// The reference: x0 + x1 + ... + x(n-1) left to right, element by element, in the input's dtype.
template <class T> OwnedTensor serial_sum(const std::vector<OwnedTensor>& parts, int64_t begin, int64_t n) {
  OwnedTensor s = OwnedTensor::of_shape(parts[0].tensor.dtype, std::vector<int64_t>{n});
  for (int64_t i = 0; i < n; ++i) {
    T acc = parts[0].tensor.ptr<T>()[begin + i];
    for (size_t r = 1; r < parts.size(); ++r) acc += parts[r].tensor.ptr<T>()[begin + i];
    s.tensor.ptr<T>()[i] = acc;
  }
  return s;
}

OwnedTensor serial_sum(const std::vector<OwnedTensor>& parts, int64_t begin, int64_t n) {
  return parts[0].tensor.dtype == DType::f64 ? serial_sum<double>(parts, begin, n) : serial_sum<float>(parts, begin, n);
}

bool same_bytes(const Tensor& a, const void* b) { return a.bytes() == 0 || std::memcmp(a.data, b, a.bytes()) == 0; }

// A short random pause so the ranks arrive in different orders from run to run.
void jitter(int rank, int call) { std::this_thread::sleep_for(std::chrono::microseconds(((rank * 7 + call * 13) % 5) * 200)); }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("comm threads: all_reduce, reduce_scatter, all_gather, broadcast are rank-ordered and bitwise equal") {
  for (DType dtype : {DType::f64, DType::f32})
    for (int size = 1; size <= kMaxGroup; ++size)
      for (int64_t n : kLengths) {
        CAPTURE(dtype_name(dtype));
        CAPTURE(size);
        CAPTURE(n);
        const uint64_t seed = 100 + static_cast<uint64_t>(size * 10 + n);
        std::vector<OwnedTensor> inputs, shard_inputs;
        for (int r = 0; r < size; ++r) {
          inputs.push_back(rank_input(dtype, n, r, seed));
          shard_inputs.push_back(rank_input(dtype, n * size, r, seed + 1));
        }
        std::vector<OwnedTensor> reduced(static_cast<size_t>(size)), scattered(static_cast<size_t>(size)),
            gathered(static_cast<size_t>(size)), broadcast(static_cast<size_t>(size));
        run_thread_ranks(size, [&](Communicator& comm) {
          const int r = comm.rank();
          REQUIRE(comm.size() == size);
          reduced[r] = rank_input(dtype, n, r, seed);
          jitter(r, 0);
          comm.all_reduce(reduced[r])->wait();

          scattered[r] = OwnedTensor::of_shape(dtype, std::vector<int64_t>{n});
          jitter(r, 1);
          comm.reduce_scatter(scattered[r], shard_inputs[r])->wait();

          gathered[r] = OwnedTensor::of_shape(dtype, std::vector<int64_t>{n * size});
          jitter(r, 2);
          comm.all_gather(gathered[r], inputs[r])->wait();

          broadcast[r] = rank_input(dtype, n, r, seed);
          comm.broadcast(broadcast[r], size - 1)->wait();
          comm.barrier();
        });
        const OwnedTensor sum = serial_sum(inputs, 0, n);
        for (int r = 0; r < size; ++r) {
          CAPTURE(r);
          CHECK(same_bytes(reduced[r], sum.tensor.data));
          const OwnedTensor shard = serial_sum(shard_inputs, r * n, n);
          CHECK(same_bytes(scattered[r], shard.tensor.data));
          for (int q = 0; q < size; ++q)
            CHECK(same_bytes(gathered[r].tensor.slice(0, q * n, n), inputs[q].tensor.data));
          CHECK(same_bytes(broadcast[r], inputs[size - 1].tensor.data));
        }
      }
}

TEST_CASE("comm threads: several collectives in flight, waited in reverse, and in-place reduce_scatter/all_gather") {
  const int size = 3;
  const int64_t n = 5;
  std::vector<OwnedTensor> a_in, b_in;
  for (int r = 0; r < size; ++r) {
    a_in.push_back(rank_input(DType::f64, n, r, 1));
    b_in.push_back(rank_input(DType::f64, n * size, r, 2));
  }
  std::vector<OwnedTensor> a(size), b(size), c(size);
  run_thread_ranks(size, [&](Communicator& comm) {
    const int r = comm.rank();
    a[r] = rank_input(DType::f64, n, r, 1);
    b[r] = rank_input(DType::f64, n * size, r, 2);
    // In place, as ZeRO uses them: the shard is the rank's own slice of the full buffer.
    auto w1 = comm.all_reduce(a[r]);
    auto w2 = comm.reduce_scatter(b[r].tensor.slice(0, r * n, n), b[r]);
    jitter(r, 3);
    w2->wait();
    w1->wait();
    c[r] = OwnedTensor::of_shape(DType::f64, std::vector<int64_t>{n * size});
    copy_convert(c[r].tensor.slice(0, r * n, n), b[r].tensor.slice(0, r * n, n));
    comm.all_gather(c[r], c[r].tensor.slice(0, r * n, n))->wait();
  });
  const OwnedTensor a_sum = serial_sum(a_in, 0, n);
  const OwnedTensor b_sum = serial_sum(b_in, 0, n * size);
  for (int r = 0; r < size; ++r) {
    CHECK(same_bytes(a[r], a_sum.tensor.data));
    CHECK(same_bytes(c[r], b_sum.tensor.data));
  }
}

TEST_CASE("comm threads: a rank that throws releases the others, and its error is the one rethrown") {
  std::vector<std::string> released(3);
  const std::string err = error_of([&] {
    run_thread_ranks(3, [&](Communicator& comm) {
      OwnedTensor t = rank_input(DType::f64, 4, comm.rank(), 3);
      comm.all_reduce(t)->wait();
      if (comm.rank() == 1) fail("rank one's own failure");
      try {
        comm.all_reduce(t)->wait();  // rank 1 never joins this one
      } catch (const Error& e) {
        released[comm.rank()] = e.what();
        throw;
      }
    });
  });
  CHECK(contains(err, "rank one's own failure"));
  for (int r : {0, 2}) {
    CAPTURE(released[r]);
    CHECK(contains(released[r], "rank 1 failed: rank one's own failure"));
  }
}

TEST_CASE("comm threads: a rank that returns while others wait, and ranks whose calls disagree, fail with a clear error") {
  std::string err = error_of([] {
    run_thread_ranks(2, [](Communicator& comm) {
      if (comm.rank() == 0) return;
      OwnedTensor t(DType::f32, {3});
      comm.all_reduce(t)->wait();
    });
  });
  CAPTURE(err);
  CHECK(contains(err, "rank 0 returned after 0 collectives, but rank 1 issued collective #0 (all_reduce f32 [3])"));

  err = error_of([] {
    run_thread_ranks(3, [](Communicator& comm) {
      OwnedTensor t(DType::f64, {comm.rank() == 2 ? 4 : 3});
      comm.all_reduce(t)->wait();
    });
  });
  CAPTURE(err);
  CHECK(contains(err, "collective #0: rank 0 issued all_reduce f64 [3] but rank 2 issued all_reduce f64 [4]"));

  err = error_of([] {
    run_thread_ranks(2, [](Communicator& comm) {
      OwnedTensor t(comm.rank() == 0 ? DType::f64 : DType::f32, {3});
      comm.broadcast(t, 0)->wait();
    });
  });
  CAPTURE(err);
  CHECK(contains(err, "rank 0 issued broadcast f64 [3] from rank 0 but rank 1 issued broadcast f32 [3] from rank 0"));

  err = error_of([] {
    run_thread_ranks(2, [](Communicator& comm) {
      OwnedTensor t(DType::f64, {4});
      if (comm.rank() == 0) comm.barrier();
      else comm.all_reduce(t)->wait();
    });
  });
  CAPTURE(err);
  CHECK(contains(err, "rank 0 issued barrier but rank 1 issued all_reduce f64 [4]"));

  // Checked on the calling rank before anything is posted.
  err = error_of([] {
    run_thread_ranks(2, [](Communicator& comm) {
      OwnedTensor in(DType::f64, {5}), out(DType::f64, {2});
      comm.reduce_scatter(out, in)->wait();
    });
  });
  CAPTURE(err);
  CHECK(contains(err, "reduce_scatter: in must hold size x out's elements"));
  err = error_of([] {
    run_thread_ranks(1, [](Communicator& comm) {
      OwnedTensor t(DType::i32, {2});
      comm.all_reduce(t)->wait();
    });
  });
  CHECK(contains(err, "the threads backend sums f64 or f32"));
  CHECK(contains(error_of([] { run_thread_ranks(0, [](Communicator&) {}); }), "at least one rank"));
}
