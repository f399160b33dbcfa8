// synk.comm under jax.jit on the CPU: one XLA FFI target, "synk_comm", through which every
// synk.comm operation of a compiled function runs (synk/comm/autograd/jax_primitive.py
// lowers to it). It hands XLA's buffers, in place, to the Python function whose address the
// lowering gave (``run``), with the operation's number there (``index``); a token in and
// out orders the operations. Built against the vendored headers of XLA's FFI API 0.1
// (csrc/xla/ffi/api, from jaxlib 0.8.0), which every JAX from 0.6 accepts.
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The Python side (a ctypes CFUNCTYPE, synk/comm/autograd/xla_handler.py): 0 once it ran,
// else it raised, kept the exception (synk raises it in place of XLA's error) and wrote its
// text, ended by a zero byte, into ``message``.
using Run = int32_t (*)(int64_t index, void* const* inputs, void* const* outputs,
                        char* message);
constexpr size_t kMessage = 4096;  // (xla_handler._MESSAGE)

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
  char message[kMessage];
  message[0] = '\0';
  if (reinterpret_cast<Run>(run)(index, inputs.data(), outputs.data(), message) != 0) {
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
                                  .Attr<int64_t>("run"));
