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
//                            --a lane's descriptor: this rank holds the rings to the
//                              destination and from the source (synk/_wire/ring.py); here:
//                              put its message in the one (where Python has not sent it),
//                              wait for the other's next record, and where it is the
//                              message awaited (its number and its header), copy its array
//                              into XLA's output and hand its space back, then Python's END
//                            --past the spin budget, or headers that differ: Python's
//                              FINISH takes the operation over (its waits, its errors)
//
// A sendrecv whose lanes Python lent at its last END (``lease``: its descriptor's address;
// a lane's lease, LeaseWord, taken by compare-and-swap) runs here with no call into Python:
// where the lanes are lent (to this generation of the call: the descriptor's) and the
// messages go through, it is done; where the message awaited is not there in the budget,
// or the reader sleeps, Python's OWED takes the lanes back and finishes it; where the lanes
// are not lent (or the message has no room), Python's BEGIN runs as above.
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
// After a call that failed (-1), kAbandon lets go of what BEGIN holds, where it still does.
// kOwed follows a leased sendrecv that sent its message and did not end (see Leased).
enum Stage : int64_t { kBegin = 0, kEnd = 1, kFinish = 2, kAbandon = 3, kOwed = 4 };
constexpr size_t kMessage = 4096;  // (xla_handler._MESSAGE)

// What a descriptor describes (its first word; xla_handler's BOARD, LANE).
enum Kind : int64_t { kBoard = 0, kLane = 1 };

// A board descriptor (xla_handler's _KIND ... _FIELDS): int64 words.
enum Field {
  kKind,
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

// A lane descriptor (xla_handler's LaneField): int64 words. A lane's counters: head at
// byte 0, tail at 64, the reader's "sleeping" at 128; its records from kDataAt.
enum LaneField {
  kLaneKind,
  kLaneAt,     // the lane from the source: its address
  kDataAt,     // where a lane's records start
  kCapacity,   // a lane's records' bytes
  kTail,       // where its next record starts (then where the one after it does)
  kNumber,     // the awaited message's number (from its source, as shm_mesh numbers them)
  kMetaAt,     // the address of a record's meta bytes (mesh_wire.ring_post's pickle), the
  kMetaLen,    // same for the message sent and the one awaited, and their length
  kBytes,      // the array's bytes
  kLaneBudgetNs,
  kTaken,      // set here once the message is taken
  kOutAt,      // the lane to the destination: its address (0: Python sent the message)
  kOutHead,    // where this rank's record goes (then where the next one will)
  kOutSeen,    // the tail of that lane as last read
  kSentNumber, // the number of this rank's message
  kSent,       // set here once it is sent
  kWake,       // set here where its reader sleeps (Python sends a wake-up)
  kInLease,    // the lease of the lane from the source (LeaseWord), 0: none
  kOutLease,   // the lease of the lane to the destination
  kGeneration, // the generation of the call these words describe (a lease's must match)
  kOutLane,    // the lane to the destination: its address, for a leased sendrecv
  kLaneFields
};

// A lane's lease (xla_handler.Lease): int64 words. Python lends (kFree to kLent) and takes
// back (kLent to kFree, waiting while kBusy); a sendrecv here takes it (kLent to kBusy) and
// gives it back (kBusy to kLent).
enum LeaseWord { kState, kLeaseGeneration, kPosition, kSeen, kMessages, kLeaseWords };
enum LeaseState : int64_t { kFree = 0, kLent = 1, kBusy = 2 };
constexpr uint32_t kData = 1, kWrap = 3;  // record kinds (ring.py's DATA, WRAP)

std::atomic<uint64_t>* Counter(char* lane, int at) {
  return reinterpret_cast<std::atomic<uint64_t>*>(lane + at);
}

// Whether this rank's message (``in``) went into the lane to the destination, as ring.py's
// Lane.put writes a record (8-byte header: payload length, kind; the payload padded to 8
// bytes; a wrap record where it would pass the lane's end), with mesh_wire.ring_post's
// payload: number, meta length, meta, padding to 16, the array. False where it has no room.
bool Sent(int64_t* d, const void* in) {
  char* lane = reinterpret_cast<char*>(d[kOutAt]);
  char* data = lane + d[kDataAt];
  const uint64_t cap = static_cast<uint64_t>(d[kCapacity]);
  const uint64_t meta_len = static_cast<uint64_t>(d[kMetaLen]);
  const uint64_t start = (16 + meta_len + 15) / 16 * 16;
  const uint64_t n = start + static_cast<uint64_t>(d[kBytes]);
  const uint64_t need = (15 + n) & ~uint64_t{7};
  uint64_t head = static_cast<uint64_t>(d[kOutHead]), seen = static_cast<uint64_t>(d[kOutSeen]);
  uint64_t pos = head % cap;
  const uint64_t wrap = need > cap - pos ? cap - pos : 0;
  if (n > cap / 2 - 8) return false;  // (Lane.max_payload)
  if (cap - (head - seen) < wrap + need) {
    seen = Counter(lane, 64)->load(std::memory_order_acquire);
    d[kOutSeen] = static_cast<int64_t>(seen);
    if (cap - (head - seen) < wrap + need) return false;
  }
  if (wrap) {
    const uint32_t header[2] = {0, kWrap};
    std::memcpy(data + pos, header, 8);
    head += wrap;
    pos = 0;
  }
  char* record = data + pos;
  const uint32_t header[2] = {static_cast<uint32_t>(n), kData};
  const uint64_t fields[2] = {static_cast<uint64_t>(d[kSentNumber]), meta_len};
  std::memcpy(record, header, 8);
  std::memcpy(record + 8, fields, 16);
  std::memcpy(record + 24, reinterpret_cast<const char*>(d[kMetaAt]), meta_len);
  std::memset(record + 24 + meta_len, 0, start - 16 - meta_len);
  std::memcpy(record + 8 + start, in, d[kBytes]);
  head += need;
  Counter(lane, 0)->store(head, std::memory_order_release);  // publish
  d[kOutHead] = static_cast<int64_t>(head);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // (pairs with Lane.set_sleeping's)
  d[kWake] = Counter(lane, 128)->load(std::memory_order_relaxed) != 0;
  d[kSent] = 1;
  return true;
}

bool Waited(std::atomic<uint64_t>* head, uint64_t tail,
            std::chrono::steady_clock::time_point deadline) {
  int looks = 0;
  while (head->load(std::memory_order_acquire) == tail) {
    if (++looks % 64 == 0 && std::chrono::steady_clock::now() > deadline) return false;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  return true;
}

// Whether the lane's next record (within the budget) is the awaited message: then its
// array is copied into ``out``, its space handed back (the tail, also in d[kTail]). A
// record read is ring.py's: header (payload length, kind), payload padded to 8 bytes; a
// wrap record fills the lane's end. Python reads whatever is not taken here.
bool Received(int64_t* d, void* out) {
  char* lane = reinterpret_cast<char*>(d[kLaneAt]);
  auto* head = Counter(lane, 0);
  auto* tail_word = Counter(lane, 64);
  const char* data = lane + d[kDataAt];
  const uint64_t cap = static_cast<uint64_t>(d[kCapacity]);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(d[kLaneBudgetNs]);
  uint64_t tail = static_cast<uint64_t>(d[kTail]);
  uint32_t n, kind;
  while (true) {
    if (!Waited(head, tail, deadline)) return false;
    const uint64_t pos = tail % cap;
    std::memcpy(&n, data + pos, 4);
    std::memcpy(&kind, data + pos + 4, 4);
    if (kind != kWrap) break;
    tail += cap - pos;
  }
  const char* record = data + tail % cap + 8;  // mesh_wire's: number, meta length, meta, pad
  uint64_t number, meta_len;
  std::memcpy(&number, record, 8);
  std::memcpy(&meta_len, record + 8, 8);
  const uint64_t start = (16 + meta_len + 15) / 16 * 16;
  if (kind != kData || number != static_cast<uint64_t>(d[kNumber]) ||
      meta_len != static_cast<uint64_t>(d[kMetaLen]) ||
      std::memcmp(record + 16, reinterpret_cast<const char*>(d[kMetaAt]), meta_len) != 0 ||
      n != start + static_cast<uint64_t>(d[kBytes])) {
    return false;
  }
  std::memcpy(out, record + start, d[kBytes]);
  tail += (15 + n) & ~uint64_t{7};
  tail_word->store(tail, std::memory_order_release);
  d[kTail] = static_cast<int64_t>(tail);
  d[kTaken] = 1;
  return true;
}

bool Took(int64_t* lease, int64_t generation) {
  auto* state = reinterpret_cast<std::atomic<int64_t>*>(lease + kState);
  int64_t lent = kLent;
  if (!state->compare_exchange_strong(lent, kBusy, std::memory_order_acquire)) return false;
  if (lease[kLeaseGeneration] == generation) return true;
  state->store(kLent, std::memory_order_release);
  return false;
}

void Gave(int64_t* lease) {
  reinterpret_cast<std::atomic<int64_t>*>(lease + kState)->store(kLent, std::memory_order_release);
}

enum Leasing { kNotLent, kDone, kOwing };

// A sendrecv on lanes lent to it: kNotLent where they are not (or its message has no room:
// nothing done), kDone, or kOwing where Python is to finish it (its message sent; the one
// awaited not taken, or its reader sleeping). The lanes' words: the position of the next
// record (kPosition: the tail from the source, the head to the destination), the tail last
// seen (kSeen), the next number awaited from the source, the last one sent (kMessages).
Leasing Leased(int64_t* d, const void* in, void* out) {
  auto* from = reinterpret_cast<int64_t*>(d[kInLease]);
  auto* to = reinterpret_cast<int64_t*>(d[kOutLease]);
  if (!from || !to || !Took(from, d[kGeneration])) return kNotLent;
  if (!Took(to, d[kGeneration])) {
    Gave(from);
    return kNotLent;
  }
  d[kTail] = from[kPosition];
  d[kNumber] = from[kMessages];
  d[kOutAt] = d[kOutLane];
  d[kOutHead] = to[kPosition];
  d[kOutSeen] = to[kSeen];
  d[kSentNumber] = to[kMessages] + 1;
  d[kSent] = d[kTaken] = 0;
  if (!Sent(d, in)) {
    Gave(to);
    Gave(from);
    return kNotLent;
  }
  to[kPosition] = d[kOutHead];
  to[kSeen] = d[kOutSeen];
  to[kMessages] = d[kSentNumber];
  const bool took = Received(d, out);
  if (took) {
    from[kPosition] = d[kTail];
    from[kMessages] = d[kNumber] + 1;
  }
  Gave(to);
  Gave(from);
  return took && !d[kWake] ? kDone : kOwing;
}

// Whether the board's collective (an allreduce) was combined here.
bool Reduced(const Board& b, void* out) {
  const uint64_t word = static_cast<uint64_t>(b.d[kWord]);
  const int64_t j = static_cast<int64_t>(word & ((uint64_t{1} << b.d[kSeqBits]) - 1)) % b.d[kSlots];
  if (!Gathered(b, j, word)) return false;
  Combined(b, j, out);
  b.counter(b.d[kRank], j, 1)->store(word, std::memory_order_release);
  return true;
}

ffi::Error Comm(ffi::Token, ffi::RemainingArgs args, ffi::Result<ffi::Token>,
                ffi::RemainingRets rets, int64_t index, int64_t run, int64_t lease) {
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
  const Leasing leased = lease ? Leased(reinterpret_cast<int64_t*>(lease), inputs[0], outputs[0])
                               : kNotLent;
  if (leased == kDone) return ffi::Error::Success();
  int64_t got = call(leased == kOwing ? kOwed : kBegin, message);
  if (got > 0) {
    auto* d = reinterpret_cast<int64_t*>(got);
    const bool done = d[0] == kLane ? (!d[kOutAt] || Sent(d, inputs[0])) && Received(d, outputs[0])
                                    : Reduced(Board{d}, outputs[0]);
    got = call(done ? kEnd : kFinish, message);
  }
  if (got < 0) {
    char spare[kMessage];
    call(kAbandon, spare);
    return ffi::Error(ffi::ErrorCode::kInternal, message);
  }
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
                                  .Attr<int64_t>("run")
                                  .Attr<int64_t>("lease"));

// Python's compare-and-swap of a lease's state (xla_handler.Lease): the state it found.
extern "C" int64_t SynkSwap(int64_t* word, int64_t expected, int64_t desired) {
  reinterpret_cast<std::atomic<int64_t>*>(word)->compare_exchange_strong(expected, desired);
  return expected;
}
