"""Contract tests: the CUDA simulator and synk's CUDA code against the real CuPy and NCCL
wheels (they install and import without a GPU: pip install -e ".[test,gpu]").

One list, ``synk._devices.cuda_api.NAMES``, says which CuPy names synk uses. Every one must
exist in the real library with the argument list the simulator gives it, the constants must
have the same values, the simulator must expose no other public name, and the device layer
and the NCCL transport must reach CuPy through listed names only.

It reaches synk's internals (``synk._testing``) because its subject is synk's own tables of
CuPy's and NCCL's names, which no public handle shows.
"""
import ast
import inspect
import pathlib
import re
import types

import numpy as np
import pytest

cupy = pytest.importorskip(
    "cupy", reason='the contract tests against the real CuPy and NCCL wheels skip without '
                   'them (the GPU tests run on the simulator): pip install -e ".[gpu]" '
                   '(about 490 MB, no GPU needed) to run them')

import synk  # noqa: E402

# No public handle: synk's own list of the CuPy and NCCL names it uses, and the simulator's
# tables of CuPy's names, which these tests hold against the installed wheels.
from synk import _testing  # noqa: E402
from synk._testing import cuda_api, discovery, sim_errors as _errors  # noqa: E402
from synk.simulator import cupy as sim_cupy  # noqa: E402

NAMES = [(ns, name) for ns, names in cuda_api.NAMES.items() for name in names]
NCCL = [pair for pair in NAMES if pair[0].startswith("cupy.cuda.nccl")]


def _nccl_available() -> bool:
    try:
        return bool(cuda_api.nccl_module(cupy).available)
    except ImportError:
        return False


needs_nccl = pytest.mark.skipif(not _nccl_available(),
                                reason="CuPy found no NCCL runtime (pip install nvidia-nccl-cu12)")


def _params_from_doc(obj) -> list | None:
    """A compiled function's parameters from its first docstring line, as
    [(name, default text or None, star)], C types dropped."""
    first = (getattr(obj, "__doc__", None) or "").strip().split("\n")[0]
    match = re.match(r"^[\w.]+\((.*)\)(\s*->.*)?$", first)
    if not match:
        return None
    params = []
    for raw in filter(None, (p.strip() for p in match.group(1).split(","))):
        if raw == "*":
            continue
        left, _, default = raw.partition("=")
        name = left.split()[-1]
        star = len(name) - len(name.lstrip("*"))
        params.append((name.lstrip("*"), default.strip() or None, star))
    return params


def _params(obj) -> list | None:
    """[(name, default text or None, star)] for a callable, or None if unknown."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        if isinstance(obj, type):
            return _params_from_doc(obj)
        return _params_from_doc(obj)
    out = []
    for p in sig.parameters.values():
        star = {p.VAR_POSITIONAL: 1, p.VAR_KEYWORD: 2}.get(p.kind, 0)
        default = (None if p.default is p.empty else p.default.__name__
                   if isinstance(p.default, type) else repr(p.default))
        out.append((p.name, default, star))
    return out


def _real_params(obj) -> list | None:
    if isinstance(obj, type):
        params = _params_from_doc(obj)  # compiled classes document their constructor
        if params is not None:
            return params
        try:
            return _params(obj)
        except Exception:
            return None
    params = _params(obj)
    if params is not None and any(name in ("args", "kwargs") for name, _, star in params if star):
        return _params_from_doc(obj) or params  # a wrapper: the doc tells the real list
    return params


@pytest.mark.parametrize("ns, name", NAMES, ids=[f"{ns}.{name}" for ns, name in NAMES])
def test_name_exists_in_cupy_and_the_simulator_with_the_same_arguments(ns, name):
    if ns.startswith("cupy.cuda.nccl") and not _nccl_available():
        pytest.skip("CuPy found no NCCL runtime")
    real = getattr(cuda_api.resolve(cupy, ns), name)
    mirror = getattr(cuda_api.resolve(sim_cupy, ns), name)
    if ns == "cupy" and name in cuda_api.SHARED_WITH_NUMPY:
        assert mirror is real or (isinstance(real, float) and mirror == real or
                                  (np.isnan(real) and np.isnan(mirror)))
        return
    if name in cuda_api.UFUNCS:
        if hasattr(real, "nin"):
            assert mirror.nin == real.nin
        assert callable(mirror)
        return
    if isinstance(real, types.ModuleType):
        assert isinstance(mirror, types.ModuleType)
        return
    if isinstance(real, (int, float, bool)) and not callable(real):
        assert mirror == real, f"{ns}.{name}: real {real!r}, simulator {mirror!r}"
        return
    descriptor = inspect.getattr_static(cuda_api.resolve(cupy, ns), name, None)
    if isinstance(descriptor, (property, types.GetSetDescriptorType, types.MemberDescriptorType)):
        static = inspect.getattr_static(cuda_api.resolve(sim_cupy, ns), name)
        assert isinstance(static, property), f"{ns}.{name} is an attribute in CuPy"
        return
    if not callable(real):  # e.g. Stream.null: an instance of the class
        assert type(mirror).__name__ == type(real).__name__
        return
    if isinstance(real, type) and issubclass(real, BaseException):
        assert issubclass(mirror, BaseException) and mirror.__name__ == real.__name__
        assert _params(mirror.__init__)[1:] == (_params_from_doc(real.__init__) or [])[1:]
        return
    want = _real_params(real)
    got = _params(mirror)
    if want is None:
        pytest.fail(f"cannot read the argument list of {ns}.{name} in CuPy")
    assert [(n, d, s) for n, d, s in got] == [(n, d, s) for n, d, s in want], (
        f"{ns}.{name}: CuPy has {want}, the simulator {got}")


@needs_nccl
def test_nccl_constants_and_error_messages_match():
    real, mirror = cuda_api.nccl_module(cupy), sim_cupy.cuda.nccl
    for name in dir(real):
        if name.startswith("NCCL_"):
            assert getattr(mirror, name) == getattr(real, name), name
    for status in _errors.NCCL_ERRORS:
        assert str(mirror.NcclError(status)) == str(real.NcclError(status))
    from synk._testing import nccl_comm as transport

    assert transport.tables(real) == transport.tables(mirror)


def test_cuda_error_codes_and_messages_match():
    real = cupy.cuda.runtime.CUDARuntimeError
    for status in _errors.CUDA_ERRORS:
        assert str(sim_cupy.cuda.runtime.CUDARuntimeError(status)) == str(real(status))
    assert real(712).status == 712
    assert str(real(712)).startswith("cudaErrorHostMemoryAlreadyRegistered")
    assert str(real(713)).startswith("cudaErrorHostMemoryNotRegistered")
    for code, name in ((712, "HostMemoryAlreadyRegistered"), (713, "HostMemoryNotRegistered")):
        constant = getattr(cupy.cuda.runtime, f"error{name}", None)
        if constant is not None:  # not exposed by CuPy 14; checked if a later one does
            assert constant == code


@needs_nccl
def test_nccl_errors_7_and_8_are_key_errors_in_cupy_14_and_the_simulator():
    """CuPy 14.2's NcclError looks its status up in a table of codes 0-6 (ERROR2 in
    cupy_backends/cuda/libs/nccl.pyx): 7 (ncclInProgress) and 8 raise KeyError instead,
    which synk's NCCL calls turn into CollectiveError."""
    real = cuda_api.nccl_module(cupy).NcclError
    for status in (7, 8):
        for cls in (real, sim_cupy.cuda.nccl.NcclError):
            with pytest.raises(KeyError):
                cls(status)


@needs_nccl
def test_the_simulators_nccl_is_the_installed_ones_version():
    """The simulator's NCCL (its rules follow the version) is the installed wheel's."""
    real = cuda_api.nccl_module(cupy).get_version()
    assert sim_cupy.cuda.nccl.get_version() == real
    assert real >= 23007, f"the simulator's rules were read from NCCL <= 2.32; {real} is older"


def test_event_and_stream_queries_return_statuses(monkeypatch):
    """``runtime.eventQuery`` / ``streamQuery`` return the cudaError_t (CuPy 14's Event.done
    and Stream.done compare it with 0); they exist with one argument in both."""
    for name in ("eventQuery", "streamQuery"):
        real = getattr(cupy.cuda.runtime, name)
        assert _real_params(real) == _params(getattr(sim_cupy.cuda.runtime, name))
    assert str(cupy.cuda.runtime.CUDARuntimeError(600)).startswith("cudaErrorNotReady")
    # the simulator's Event.done and Stream.done read the status as CuPy's do
    monkeypatch.setenv("SYNK_SIMULATE_GPUS", "1")
    runtime = sim_cupy.cuda.runtime
    event, stream = sim_cupy.cuda.Event(), sim_cupy.cuda.Stream()
    for status, done in ((0, True), (600, False), (700, False)):  # ready, not ready, sticky
        with monkeypatch.context() as patch:
            patch.setattr(runtime, "eventQuery", lambda ptr, status=status: status)
            patch.setattr(runtime, "streamQuery", lambda ptr, status=status: status)
            assert event.done is done and stream.done is done, status


@needs_nccl
def test_unique_id_round_trips():
    from synk._testing import ID_BYTES, check_id, make_id

    try:
        uid = make_id(cupy)
    except cuda_api.nccl_module(cupy).NcclError:  # some NCCL builds need a driver for this
        uid = make_id(sim_cupy)
    assert isinstance(uid, bytes) and len(uid) == ID_BYTES == 128
    assert check_id(bytes.fromhex(uid.hex())) == uid  # as it travels to the other ranks
    with pytest.raises(ValueError, match="128 bytes"):
        check_id(uid[:-1])
    with pytest.raises(ValueError):  # CuPy itself refuses an id of the wrong length
        cuda_api.nccl_module(cupy).NcclCommunicator(2, uid[:64], 0)


def _public(obj) -> set:
    if isinstance(obj, types.ModuleType):
        names = getattr(obj, "__all__", None)
        if names is None:
            names = [n for n in vars(obj) if not isinstance(vars(obj)[n], types.ModuleType)
                     or n in ("cuda", "random", "linalg", "runtime", "nccl")]
        return {n for n in names if not n.startswith("_")}
    return {n for n in vars(obj) if not n.startswith("_")}


def test_simulator_exposes_no_name_the_list_lacks():
    """(Beyond the names synk uses, the simulator defines what it models for user code,
    ``MODELLED``, checked below; every other CuPy name is served by ``_generic``.)"""
    from synk._testing import sim_names as _names

    for ns, names in cuda_api.NAMES.items():
        modelled = (set(sim_cupy.MODELLED) if ns == "cupy" else  # (the array's methods:
                    _names.NAMES[ns] if ns == "cupy.ndarray" else set())  # CuPy's, below)
        extra = _public(cuda_api.resolve(sim_cupy, ns)) - set(names) - modelled
        assert not extra, f"the simulator's {ns} has names CuPy's list does not: {sorted(extra)}"
    sim_modules = {m for m in dir(sim_cupy) if isinstance(getattr(sim_cupy, m), types.ModuleType)
                   and not m.startswith("_")}
    assert sim_modules <= {"cuda", "random", "linalg", "fft"}


# -- user CuPy code: the simulator's tables of CuPy's names, and what it models ---------------

_NUMPY_PLACES = [("", np), ("exceptions.", np.exceptions), ("linalg.", np.linalg),
                 ("fft.", np.fft), ("random.", np.random)]


def _numpy_path(obj):
    for prefix, module in _NUMPY_PLACES:
        for name in dir(module):
            if not name.startswith("_") and getattr(module, name) is obj:
                return prefix + name
    return None


def _argument_list(obj):
    """A callable's argument list as the simulator's tables spell it (no annotations)."""
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return None
    parts, star = [], False
    for i, p in enumerate(params):
        if p.kind == p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind == p.VAR_POSITIONAL:
            parts.append("*" + p.name)
            star = True
        elif p.kind == p.VAR_KEYWORD:
            parts.append("**" + p.name)
        elif p.default is p.empty:
            parts.append(p.name)
        else:
            default = p.default.__name__ if isinstance(p.default, type) else repr(p.default)
            parts.append(f"{p.name}={default}")
        if p.kind == p.POSITIONAL_ONLY and (i + 1 == len(params)
                                            or params[i + 1].kind != p.POSITIONAL_ONLY):
            parts.append("/")
    return "(" + ", ".join(parts) + ")"


def _wheel_tables() -> dict:
    """The installed CuPy's names, by what each is (the form of sim/cupy/_names.py)."""
    spaces = {"cupy": cupy, "cupy.random": cupy.random, "cupy.linalg": cupy.linalg,
              "cupy.fft": cupy.fft, "cupy.ndarray": cupy.ndarray,
              "cupy.random.RandomState": cupy.random.RandomState}
    tables: dict = {"NAMES": {}, "NUMPY_OBJECTS": {}, "SIGNATURES": {}, "UFUNCS": {},
                    "CONSTANTS": {}}
    for ns, obj in spaces.items():
        names = sorted(n for n in dir(obj) if not n.startswith("_") and n != "annotations")
        tables["NAMES"][ns] = frozenset(names)
        is_class = isinstance(obj, type)
        for name in names:
            value = getattr(obj, name)
            if isinstance(value, types.ModuleType) or is_class:
                continue
            found = (_numpy_path(value) if not isinstance(value, (int, float, bool, str))
                     else None)
            if found is not None:
                tables["NUMPY_OBJECTS"].setdefault(ns, {})[name] = found
            elif type(value).__name__ == "ufunc":
                tables["UFUNCS"].setdefault(ns, set()).add(name)
            elif isinstance(value, float):
                tables["CONSTANTS"][name] = value
            elif callable(value) and not isinstance(value, type):
                signature = _argument_list(value)
                if signature is not None:
                    tables["SIGNATURES"].setdefault(ns, {})[name] = signature
    return tables


def test_cupy_tables_are_the_wheels():
    """Every CuPy name the simulator knows, and what each one is (numpy's object, a
    constant, a ufunc, a function with its argument list), is the installed wheel's: user
    code gets CuPy's names and argument lists, an AttributeError for a name CuPy lacks."""
    from synk._testing import sim_names as _names

    wheel = _wheel_tables()
    assert _names.CUPY_VERSION == cupy.__version__
    for ns, names in wheel["NAMES"].items():
        assert _names.NAMES[ns] == names, (ns, sorted(names ^ _names.NAMES[ns]))
    assert _names.NUMPY_OBJECTS == wheel["NUMPY_OBJECTS"]
    assert {ns: set(v) for ns, v in _names.UFUNCS.items()} == wheel["UFUNCS"]
    assert _names.SIGNATURES == wheel["SIGNATURES"]
    assert {k: repr(v) for k, v in _names.CONSTANTS.items()} == {
        k: repr(v) for k, v in wheel["CONSTANTS"].items()}


def test_served_functions_have_cupys_argument_lists():
    """Each CuPy function the simulator serves from numpy takes CuPy's arguments."""
    namespaces = {"cupy": sim_cupy, "cupy.random": sim_cupy.random,
                  "cupy.linalg": sim_cupy.linalg, "cupy.fft": sim_cupy.fft}
    checked = 0
    for ns, signatures in _wheel_tables()["SIGNATURES"].items():
        if ns not in namespaces:
            continue
        real = cuda_api.resolve(cupy, ns)
        for name in signatures:
            if name in cuda_api.NAMES.get(ns, ()):
                continue  # defined by the simulator itself: checked above
            mirror = getattr(namespaces[ns], name)
            if type(mirror).__name__ == "NotModelledName":
                continue
            assert _params(mirror) == _params(getattr(real, name)), f"{ns}.{name}"
            checked += 1
    assert checked > 230


def test_modelled_names_have_cupys_argument_lists():
    for name in ("ElementwiseKernel", "ReductionKernel", "vectorize", "fuse", "is_available"):
        want = _real_params(getattr(cupy, name))
        assert want is not None and _params(getattr(sim_cupy, name)) == want, name
    for name in ("RandomState", "default_rng", "get_random_state", "set_random_state",
                 "reset_states"):
        want = _real_params(getattr(cupy.random, name))
        assert _params(getattr(sim_cupy.random, name)) == want, name
    for name in ("r_", "c_", "mgrid", "ogrid"):
        assert callable(getattr(sim_cupy, name).__getitem__) and hasattr(cupy, name)


def test_the_renamed_arguments_are_the_reviewed_ones():
    """A served function passes CuPy's arguments to numpy's by position only where numpy's
    parameter there has the same name, or one of ``_generic.RENAMED`` (reviewed: the same
    meaning); elsewhere by keyword. A new difference of names fails here."""
    from synk._testing import sim_generic as _generic

    found: dict = {}
    for ns in ("cupy", "cupy.random", "cupy.linalg", "cupy.fft"):
        module = cuda_api.resolve(sim_cupy, ns)
        for name in _wheel_tables()["SIGNATURES"].get(ns, {}):
            spec = getattr(getattr(module, name), "__globals__", {}).get("_spec")
            if spec is None:
                continue
            theirs = _generic._numpy_params(spec.np_func) or []
            for i, (pname, how, _) in enumerate(spec.plan):
                if (how == "pos" and i < len(theirs) and theirs[i].name != pname
                        and theirs[i].kind in (theirs[i].POSITIONAL_ONLY,
                                               theirs[i].POSITIONAL_OR_KEYWORD)):
                    found.setdefault(name, {})[pname] = theirs[i].name
    assert found == _generic.RENAMED


_ROOTS = {"xp": "cupy", "cuda": "cupy.cuda", "runtime": "cupy.cuda.runtime",
          "nccl": "cupy.cuda.nccl", "_comm": "cupy.cuda.nccl.NcclCommunicator",
          "comm": "cupy.cuda.nccl.NcclCommunicator", "stream": "cupy.cuda.Stream",
          "_event": "cupy.cuda.Event", "event": "cupy.cuda.Event",
          "_device": "cupy.cuda.Device", "copy_stream": "cupy.cuda.Stream",
          "copy": "cupy.cuda.Stream", "before": "cupy.cuda.Event", "done": "cupy.cuda.Event",
          "_done": "cupy.cuda.Event", "_stream": "cupy.cuda.Stream", "out": "cupy.ndarray",
          "flat_out": "cupy.ndarray", "comm_stream": "cupy.cuda.Stream",
          "ready": "cupy.cuda.Event"}


def _chain(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


@pytest.mark.parametrize("module, at_least", [
    ("synk/_devices/cuda.py", 10), ("synk/comm/nccl/nccl_comm.py", 10),
    ("synk/_devices/report.py", 4), ("synk/_devices/cuda_host.py", 4), ("synk/bench/gpu.py", 6),
    ("synk/comm/nccl/nccl_guard.py", 4), ("synk/comm/nccl/nccl_setup.py", 10),
])
def test_cuda_code_uses_listed_names_only(module, at_least):
    """Every attribute reached from a CuPy object (``xp.``, ``self.xp.cuda.``, ``nccl.``,
    the communicator, the stream, the event) is in the list, so it exists in CuPy."""
    source = pathlib.Path(synk.__file__).parent.parent / module
    tree = ast.parse(source.read_text())
    checked = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or isinstance(getattr(node, "parent", None),
                                                             ast.Attribute):
            continue
        parts = _chain(node)
        if parts[:1] == ["self"]:
            parts = parts[1:]
        if not parts or parts[0] not in _ROOTS:
            continue
        ns = _ROOTS[parts[0]]
        for name in parts[1:]:
            if name.startswith("__"):
                break
            if ns in ("cupy.cuda.Stream", "cupy.cuda.Event", "cupy.cuda.Device") and name in (
                    "ptr", "__enter__", "__exit__"):
                break  # documented instance attribute / context manager protocol
            assert name in cuda_api.NAMES.get(ns, ()), f"{module}: {ns}.{name} is not listed"
            checked += 1
            child = f"{ns}.{name}"
            if child not in cuda_api.NAMES:
                break
            ns = child
    assert checked >= at_least


def test_auto_falls_back_to_cpu_and_gpu_explains_here(monkeypatch):
    monkeypatch.delenv("SYNK_SIMULATE_GPUS", raising=False)
    discovery._probed.clear()
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        count = 0
    if count:
        pytest.skip("this machine has a CUDA device")
    try:
        assert _testing.devices.resolve_backend("auto") == "cpu"
        with pytest.raises(_testing.devices.GpuUnavailableError,
                           match="CuPy found no CUDA driver|no CUDA device visible"):
            _testing.devices.resolve_backend("gpu")
    finally:
        discovery._probed.clear()


def test_simulated_arrays_refuse_conversion_as_cupys_do(monkeypatch):
    """The message the simulator gives is the one in CuPy's source."""
    monkeypatch.setenv("SYNK_SIMULATE_GPUS", "1")
    with pytest.raises(TypeError) as info:
        np.asarray(sim_cupy.zeros(3))
    assert "Implicit conversion to a NumPy array is not allowed." in str(info.value)
    assert "Please use `.get()` to construct a NumPy array explicitly." in str(info.value)


_DTYPES = ["?", "i1", "u2", "i4", "u8", "f2", "f4", "f8", "c8", "c16", "i4,f8", "V8", "U3",
           "S2", "O", "M8[s]", "m8[ns]", "g", "G", ">f8", ">i2", "i4,O", ("i4", (2,))]


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_the_dtypes_cupy_refuses_are_the_simulators_and_synks(dtype, monkeypatch):
    """CuPy's own check of a new array's dtype (cupy/_core/_dtype.pyx, a cpdef callable
    without a GPU) against synk's rule (``device_dtypes``) and the simulator's cupy.empty:
    the same dtypes refused, with the same message."""
    from cupy._core import _dtype

    from synk._testing import device_dtypes

    try:
        _dtype.get_dtype_with_itemsize(np.dtype(dtype), True)
        real = None
    except ValueError as err:
        real = str(err)
    assert device_dtypes.refusal(dtype) == real
    monkeypatch.setenv("SYNK_SIMULATE_GPUS", "1")
    if real is None:
        assert sim_cupy.empty(2, dtype).dtype == np.dtype(dtype)
    else:
        with pytest.raises(ValueError) as info:
            sim_cupy.empty(2, dtype)
        assert str(info.value) == real
