"""The compiled part of synk: its XLA FFI target for ``synk.comm`` under ``jax.jit`` on the
CPU (csrc/jax_ffi.cc; no Python or JAX headers: XLA's FFI headers are vendored in csrc/).
Where no C++ compiler is found the install goes on without it, and jitting a function that
calls synk.comm on the CPU raises a SynkError saying so."""
from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "synk.comm.autograd._jax_ffi", ["csrc/jax_ffi.cc"], include_dirs=["csrc"],
    extra_compile_args=["-std=c++17", "-O2", "-w"], language="c++", optional=True)])
