#include "parallel/context_parallel.h"

#include "engine/error.h"
#include "engine/memory.h"
#include "engine/ops/residual.h"

#include <vector>

namespace cw {
namespace {

// rows x cols elements of t's memory from element `offset`, rows `row_stride` apart: a strided block
// of heads (a GPU copy takes a stride in the first dimension only, which this is).
Tensor block(const Tensor& t, int64_t offset, int64_t rows, int64_t cols, int64_t row_stride) {
  Tensor v = t;
  v.data = static_cast<char*>(t.data) + offset * static_cast<int64_t>(dtype_size(t.dtype));
  v.ndim = 2;
  v.shape = {rows, cols, 0, 0};
  v.stride = {row_stride, 1, 0, 0};
  return v;
}

// The shapes of one exchange between a token-side tensor [B, n, G, D] and a head-side one
// [B, P n, Hr, D], checked.
struct Exchange {
  int64_t B = 0, n = 0, G = 0, D = 0, P = 0, rank = 0;
  HeadRange mine;
  int64_t block_elems() const { return B * n * mine.count * D; }  // one rank's block for one rank
};

Exchange exchange_shapes(const Communicator& comm, const Tensor& tokens, const Tensor& heads, const char* op) {
  CW_CHECK(tokens.ndim == 4 && heads.ndim == 4, "{}: takes [B, n, G, D] tokens and [B, P n, G/P, D] heads, got {} and {}",
           op, tokens.describe(), heads.describe());
  CW_CHECK(tokens.contiguous() && heads.contiguous(), "{}: operands must be contiguous, got {} and {}", op,
           tokens.describe(), heads.describe());
  CW_CHECK(tokens.dtype == heads.dtype, "{}: tokens are {} but heads {}", op, dtype_name(tokens.dtype),
           dtype_name(heads.dtype));
  CW_CHECK(tokens.device == comm.device() && heads.device == comm.device(),
           "{}: operands must be on the communicator's device ({}), got {} and {}", op, device_name(comm.device()),
           tokens.describe(), heads.describe());
  Exchange e;
  e.B = tokens.size(0), e.n = tokens.size(1), e.G = tokens.size(2), e.D = tokens.size(3);
  e.P = comm.size(), e.rank = comm.rank();
  e.mine = cp_heads_of_rank(e.G, e.P, e.rank);
  CW_CHECK(heads.size(0) == e.B && heads.size(1) == e.P * e.n && heads.size(2) == e.mine.count && heads.size(3) == e.D,
           "{}: rank {} of {} holds [{}, {}, {}, {}] heads for {} tokens, got {}", op, e.rank, e.P, e.B, e.P * e.n,
           e.mine.count, e.D, tokens.describe(), heads.describe());
  return e;
}

// tokens [B, n, G, D] (this rank's) -> heads [B, P n, Hr, D] (this rank's heads of every rank's tokens).
void tokens_to_heads(Communicator& comm, const Tensor& tokens, const Tensor& heads, const char* op) {
  const Exchange e = exchange_shapes(comm, tokens, heads, op);
  const int64_t blk = e.block_elems();
  OwnedTensor send = OwnedTensor::on(comm.device(), tokens.dtype, {e.P * blk});
  OwnedTensor recv = OwnedTensor::on(comm.device(), tokens.dtype, {e.P * blk});
  // The B n token rows lie G D apart in `tokens`: rank q's block is their columns of its heads.
  for (int64_t q = 0; q < e.P; ++q) {
    const HeadRange theirs = cp_heads_of_rank(e.G, e.P, q);
    const int64_t cols = theirs.count * e.D;
    copy_convert(block(send, q * blk, e.B * e.n, cols, cols), block(tokens, theirs.first * e.D, e.B * e.n, cols, e.G * e.D));
  }
  comm.all_to_all(recv, send)->wait();
  // Rank s's block: each sequence's run of its n tokens, at tokens [s n, (s+1) n) of that sequence here.
  const int64_t run = e.n * e.mine.count * e.D;
  for (int64_t s = 0; s < e.P; ++s)
    copy_convert(block(heads, s * run, e.B, run, e.P * run), block(recv, s * blk, e.B, run, run));
}

// heads [B, P n, Hr, D] -> tokens [B, n, G, D]: each rank's tokens sent back to it; where ranks hold
// the same heads (replicas), their blocks are added in rank order.
void heads_to_tokens(Communicator& comm, const Tensor& heads, const Tensor& tokens, const char* op) {
  const Exchange e = exchange_shapes(comm, tokens, heads, op);
  const int64_t blk = e.block_elems();
  const int64_t run = e.n * e.mine.count * e.D;
  OwnedTensor send = OwnedTensor::on(comm.device(), tokens.dtype, {e.P * blk});
  OwnedTensor recv = OwnedTensor::on(comm.device(), tokens.dtype, {e.P * blk});
  for (int64_t s = 0; s < e.P; ++s)  // rank s's block: its tokens of this rank's heads, each sequence's run
    copy_convert(block(send, s * blk, e.B, run, run), block(heads, s * run, e.B, run, e.P * run));
  comm.all_to_all(recv, send)->wait();
  // Block q of recv: rank q's heads of this rank's tokens. Replicas are adjacent ranks (first(q) is
  // monotone in q): the first of a run takes the later ones' sums, then goes to its heads' columns.
  for (int64_t q = 0; q < e.P;) {
    const HeadRange heads_q = cp_heads_of_rank(e.G, e.P, q);
    const Tensor sum = block(recv, q * blk, 1, blk, blk).view({blk});
    int64_t next = q + 1;
    for (; next < e.P && cp_heads_of_rank(e.G, e.P, next).first == heads_q.first; ++next)
      accumulate(sum, block(recv, next * blk, 1, blk, blk).view({blk}));
    const int64_t cols = heads_q.count * e.D;
    copy_convert(block(tokens, heads_q.first * e.D, e.B * e.n, cols, e.G * e.D), block(recv, q * blk, e.B * e.n, cols, cols));
    q = next;
  }
}

}  // namespace

HeadRange cp_heads_of_rank(int64_t heads, int64_t ranks, int64_t rank) {
  CW_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "cp_heads_of_rank: rank {} of {}", rank, ranks);
  CW_CHECK(heads >= 1 && (heads % ranks == 0 || ranks % heads == 0),
           "context parallelism over {} ranks: {} heads neither split into {} equal parts nor divide {}", ranks, heads,
           ranks, ranks);
  if (heads >= ranks) return {rank * (heads / ranks), heads / ranks};
  return {rank * heads / ranks, 1};  // a head every ranks / heads ranks hold alike
}

void cp_to_heads_forward(Communicator& comm, const Tensor& x_tokens, const Tensor& y_heads) {
  tokens_to_heads(comm, x_tokens, y_heads, "cp_to_heads_forward");
}
void cp_to_heads_backward(Communicator& comm, const Tensor& d_y_heads, const Tensor& d_x_tokens) {
  heads_to_tokens(comm, d_y_heads, d_x_tokens, "cp_to_heads_backward");
}
void cp_to_tokens_forward(Communicator& comm, const Tensor& x_heads, const Tensor& y_tokens) {
  CW_CHECK(y_tokens.ndim == 4 && y_tokens.size(2) % comm.size() == 0,
           "cp_to_tokens_forward: the {} heads of {} do not split over {} ranks (only K/V heads have replicas)",
           y_tokens.ndim == 4 ? y_tokens.size(2) : 0, y_tokens.describe(), comm.size());
  heads_to_tokens(comm, x_heads, y_tokens, "cp_to_tokens_forward");
}
void cp_to_tokens_backward(Communicator& comm, const Tensor& d_y_tokens, const Tensor& d_x_heads) {
  CW_CHECK(d_y_tokens.ndim == 4 && d_y_tokens.size(2) % comm.size() == 0,
           "cp_to_tokens_backward: the {} heads of {} do not split over {} ranks (only K/V heads have replicas)",
           d_y_tokens.ndim == 4 ? d_y_tokens.size(2) : 0, d_y_tokens.describe(), comm.size());
  tokens_to_heads(comm, d_y_tokens, d_x_heads, "cp_to_tokens_backward");
}

}  // namespace cw
