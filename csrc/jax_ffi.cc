// synk.comm under jax.jit on the CPU: one XLA FFI target, "synk_comm", through which every
// synk.comm operation of a compiled function runs (synk/comm/autograd/jax_primitive.py
// lowers to it, synk/comm/autograd/xla_handler.py registers it). A token in and out orders
// the operations. Built against the vendored headers of XLA's FFI API 0.1 (csrc/xla/ffi/api,
// from jaxlib 0.8.0), which every JAX from 0.6 accepts.
//
//   Python's BEGIN (``run``) --0: it ran the operation whole, in Python
//                            --a board's descriptor: this rank posted the allreduce on the
//                              board (synk/comm/host/shm_board.py); here: wait for the
//                              peers' posts, combine them in rank order into XLA's output,
//                              mark the slot read, then Python's END
//                            --past the spin budget, or headers that differ: Python's
//                              FINISH takes the collective over (its waits, its errors)
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The Python side (a ctypes CFUNCTYPE, xla_handler._from_xla) writes into ``result``: for
// BEGIN, 0 (done), the address of a board descriptor (the fast path), or -1; for END and
// FINISH, 0 or -1. On -1 it kept the exception (synk raises it in place of XLA's error) and
// wrote its text, ended by a zero byte, into ``message``. ``result`` starts at -1: an
// exception that escapes the Python function (an interrupt landing as it starts, which
// ctypes only reports) leaves it so, and ctypes' own return value would be undefined.
using Run = void (*)(int64_t index, int64_t stage, void* const* inputs, void* const* outputs,
                     char* message, int64_t* result);
constexpr char kEscaped[] = "synk.comm: the call into Python was interrupted";
enum Stage : int64_t { kBegin = 0, kEnd = 1, kFinish = 2 };
constexpr size_t kMessage = 4096;  // (xla_handler._MESSAGE)

// A board descriptor (xla_handler's _WORD ... _FIELDS): int64 words.
enum Field {
  kWord,      // the collective's word (call << 24 | seq), this rank's post of it made
  kBase,      // the board's address
  kRank,
  kSize,
  kSlots,     // slots per rank (shm_board.SLOTS)
  kLine,      // bytes of a slot's counters (posted at 0, done at 8)
  kStep,      // bytes of a slot: its header (kHead bytes), then the array
  kHead,      // bytes of a slot before its array
  kHeadLen,   // the header's bytes that every rank's must match
  kBudgetNs,  // how long to poll the peers' posts before FINISH takes over
  kSeqBits,
  kOp,        // the operation (xla_handler.OPS): 0 sum, 1 prod
  kType,      // the dtype (xla_handler.TYPES): 0 float32, 1 float64, 2 int32, 3 int64
  kCount,     // the array's elements
  kFields
};

struct Board {
  const int64_t* d;
  char* base() const { return reinterpret_cast<char*>(d[kBase]); }
  std::atomic<uint64_t>* counter(int64_t rank, int64_t slot, int which) const {
    auto* line = base() + (rank * d[kSlots] + slot) * d[kLine];
    return reinterpret_cast<std::atomic<uint64_t>*>(line + 8 * which);
  }
  char* slot(int64_t rank, int64_t j) const {
    return base() + d[kSlots] * d[kSize] * d[kLine] + (rank * d[kSlots] + j) * d[kStep];
  }
};

// Whether every peer has posted this collective (a later word: it left the call) within
// the budget, with the same header as this rank's.
bool Gathered(const Board& b, int64_t j, uint64_t word) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::nanoseconds(b.d[kBudgetNs]);
  const int64_t me = b.d[kRank];
  for (int64_t p = 0; p < b.d[kSize]; ++p) {
    if (p == me) continue;
    uint64_t seen;
    int looks = 0;
    while ((seen = b.counter(p, j, 0)->load(std::memory_order_acquire)) != word) {
      if (seen > word) return false;
      if (++looks % 64 == 0 && std::chrono::steady_clock::now() > deadline) return false;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
    if (std::memcmp(b.slot(p, j), b.slot(me, j), b.d[kHeadLen]) != 0) return false;
  }
  return true;
}

template <typename T, typename Fold>
void Combine(const Board& b, int64_t j, void* out, Fold fold) {
  const int64_t n = b.d[kCount];
  T* y = static_cast<T*>(out);
  const T* first = reinterpret_cast<const T*>(b.slot(0, j) + b.d[kHead]);
  std::memmove(y, first, n * sizeof(T));
  for (int64_t p = 1; p < b.d[kSize]; ++p) {  // in rank order, as numpy folds them
    const T* x = reinterpret_cast<const T*>(b.slot(p, j) + b.d[kHead]);
    for (int64_t i = 0; i < n; ++i) y[i] = fold(y[i], x[i]);
  }
}

// Integers wrap as numpy's do (unsigned arithmetic: no undefined overflow).
template <typename T, typename U>
void CombineOp(const Board& b, int64_t j, void* out) {
  if (b.d[kOp] == 0) {
    Combine<T>(b, j, out, [](T a, T x) { return static_cast<T>(static_cast<U>(a) + static_cast<U>(x)); });
  } else {
    Combine<T>(b, j, out, [](T a, T x) { return static_cast<T>(static_cast<U>(a) * static_cast<U>(x)); });
  }
}

void Combined(const Board& b, int64_t j, void* out) {
  switch (b.d[kType]) {
    case 0: return CombineOp<float, float>(b, j, out);
    case 1: return CombineOp<double, double>(b, j, out);
    case 2: return CombineOp<int32_t, uint32_t>(b, j, out);
    default: return CombineOp<int64_t, uint64_t>(b, j, out);
  }
}

ffi::Error Comm(ffi::Token, ffi::RemainingArgs args, ffi::Result<ffi::Token>,
                ffi::RemainingRets rets, int64_t index, int64_t run) {
  std::vector<void*> inputs(args.size()), outputs(rets.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return buffer.error();
    inputs[i] = buffer->untyped_data();
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buffer = rets.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return buffer.error();
    outputs[i] = (*buffer)->untyped_data();
  }
  auto call = [&](Stage stage, char* message) {
    int64_t result = -1;
    std::memcpy(message, kEscaped, sizeof(kEscaped));
    reinterpret_cast<Run>(run)(index, stage, inputs.data(), outputs.data(), message, &result);
    return result;
  };
  char message[kMessage];
  int64_t got = call(kBegin, message);
  if (got > 0) {
    const Board b{reinterpret_cast<const int64_t*>(got)};
    const uint64_t word = static_cast<uint64_t>(b.d[kWord]);
    const int64_t j = static_cast<int64_t>(word & ((uint64_t{1} << b.d[kSeqBits]) - 1)) % b.d[kSlots];
    Stage next = kFinish;
    if (Gathered(b, j, word)) {
      Combined(b, j, outputs[0]);
      b.counter(b.d[kRank], j, 1)->store(word, std::memory_order_release);
      next = kEnd;
    }
    got = call(next, message);
  }
  if (got < 0) return ffi::Error(ffi::ErrorCode::kInternal, message);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SynkComm, Comm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .RemainingArgs()
                                  .Ret<ffi::Token>()
                                  .RemainingRets()
                                  .Attr<int64_t>("index")
                                  .Attr<int64_t>("run"));
