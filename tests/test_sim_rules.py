"""The CUDA simulator's rules where real CUDA, CuPy and NCCL are unforgiving, each checked
against the source it follows (cited per test): the null stream's ordering, the memory
pool's reuse, sticky errors, NCCL's first-use connections, its unchecked pointers and its
empty collectives. (CuPy's own test cases are in test_sim_cupy_cases.py; NCCL's rules for
ranks sharing a GPU, between processes, in test_simulator_insides.py.)"""
import gc
import mmap
import threading
import time

import numpy as np
import pytest
from conftest import two_sim_comms

from synk import simulator as sim
from synk.simulator import cupy as cp

nccl, runtime = cp.cuda.nccl, cp.cuda.runtime

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("two_sim_devices_nccl_afresh")]


# ---------------------------------------------------------------- streams

def test_work_on_the_null_stream_is_unordered_with_non_blocking_streams():
    """CUDA Runtime API, "Stream synchronization behavior": the legacy default stream
    synchronises with blocking streams only; a stream made with cudaStreamNonBlocking "may
    run concurrently with work in stream 0"."""
    mine = cp.cuda.Stream(non_blocking=True)
    with mine:
        x = cp.arange(8.0)
    with pytest.raises(sim.RaceError, match="null stream"):
        x + 1  # the null stream is current here (the with block popped back to it)
    blocking = cp.cuda.Stream()  # a blocking stream: the null stream waits for it
    with blocking:
        y = cp.arange(8.0)
    assert (y + 1).get().tolist() == list(range(1, 9))


def test_leaving_any_with_block_forgets_a_stream_made_current_by_use():
    """cupy/cuda/stream.pyx: ``use()`` does not push; leaving a ``with`` pops back to the top
    of the stack, based on Stream.null: work after it lands on the null stream."""
    mine = cp.cuda.Stream(non_blocking=True).use()
    with cp.cuda.Stream(non_blocking=True):
        pass
    assert cp.cuda.get_current_stream() == cp.cuda.Stream.null
    with mine:
        x = cp.ones(4)
    with pytest.raises(sim.RaceError):
        x * 2


def test_views_launch_no_kernel_and_race_with_nothing():
    """A reshape, transpose or basic slice of a contiguous array is a view in CuPy: nothing is
    queued on any stream (only copies are kernels)."""
    mine = cp.cuda.Stream(non_blocking=True)
    with mine:
        x = cp.arange(12.0)
    views = [x.reshape(3, 4), x.reshape(3, 4).T, x[2:6], x.view(cp.int64), x.ravel()]
    assert all(v._alloc is x._alloc for v in views)
    with pytest.raises(sim.RaceError):
        x.reshape(3, 4).T.copy()  # a copy is a kernel: on the null stream, racing


def test_device_synchronize_waits_for_the_work_of_streams_destroyed_since():
    """CUDA Runtime API: cudaStreamDestroy returns at once, the stream's resources go "once
    the device has completed all work in stream"; cudaDeviceSynchronize "blocks until the
    device has completed all preceding requested tasks": afterwards nothing races with
    what a destroyed stream wrote, and its queued copies have run."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x = cp.arange(4.0)
    pinned = np.frombuffer(cp.cuda.alloc_pinned_memory(32), np.float64, 4)
    pinned[:] = 7.0
    y = cp.empty(4)
    with stream:
        y.set(pinned)  # queued (a DMA from page-locked memory)
    del stream
    gc.collect()
    with pytest.raises(sim.RaceError):
        x + 1  # (nothing orders the null stream after it yet)
    runtime.deviceSynchronize()
    assert (x + 1).get().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert y.get().tolist() == [7.0] * 4
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        z = cp.arange(3.0)
    del stream
    gc.collect()
    cp.cuda.Device(0).synchronize()  # Device.synchronize is cudaDeviceSynchronize
    assert (z * 2).get().tolist() == [0.0, 2.0, 4.0]


def test_read_only_host_memory_registers_only_with_the_read_only_flag():
    """CUDA Runtime API, cudaHostRegister, cudaHostRegisterReadOnly (8): "On platforms
    without cudaDevAttrPageableMemoryAccessUsesHostPageTables, this flag is required in
    order to register memory mapped to the CPU as read-only" (x86 with a discrete GPU).
    numpy's writeable flag is not the pages' protection."""
    mapping = mmap.mmap(-1, 2 * mmap.PAGESIZE, prot=mmap.PROT_READ)
    ptr = np.frombuffer(mapping, np.uint8).__array_interface__["data"][0]
    with pytest.raises(runtime.CUDARuntimeError, match="cudaHostRegisterReadOnly") as err:
        runtime.hostRegister(ptr, len(mapping), 0)
    assert err.value.status == 1  # cudaErrorInvalidValue
    assert cp.cuda.runtime.getDeviceProperties(0)["pageableMemoryAccessUsesHostPageTables"] == 0
    runtime.hostRegister(ptr, len(mapping), 8)
    runtime.hostUnregister(ptr)
    frozen = np.zeros(mmap.PAGESIZE, np.uint8)
    frozen.flags.writeable = False  # (its pages are writable)
    runtime.hostRegister(frozen.ctypes.data, frozen.nbytes, 0)
    runtime.hostUnregister(frozen.ctypes.data)


# ---------------------------------------------------------------- the memory pool

def test_a_freed_block_is_reused_at_once_on_its_stream_and_racing_work_is_reported():
    """cupy/cuda/memory.pyx: a block freed is put back in the free list of the stream it was
    allocated on, with no event; the next allocation there gets it, even while another
    stream (NCCL's) still reads it."""
    compute, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with compute:
        tmp = cp.arange(256.0)
        ptr = tmp.data.ptr
        ready = compute.record()
    other.wait_event(ready)
    with other:
        total = tmp.sum()  # read on the other stream
    del tmp
    gc.collect()
    with compute:
        again = cp.empty(256)
        assert again.data.ptr == ptr  # the same block, at once
        with pytest.raises(sim.RaceError, match="freed while work on"):
            again.fill(1.0)  # written while the other stream may still read it
    other.synchronize()  # the host saw it finish: from now on it is safe
    with compute:
        again.fill(1.0)
        assert float(total.get(stream=other)) == sum(range(256))


def test_blocks_are_reused_per_device_and_stream():
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        a = cp.empty(100)
        ptr = a.data.ptr
    del a
    gc.collect()
    assert cp.empty(100).data.ptr != ptr  # the null stream's arena: another block
    with cp.cuda.Device(1):
        assert cp.empty(100).data.ptr != ptr
    with stream:
        assert cp.empty(100).data.ptr == ptr
    assert cp.empty(0).data.ptr == 0  # malloc(0): MemoryPointer(Memory(0), 0)


# ---------------------------------------------------------------- events and sticky errors

def test_a_sticky_error_never_lets_a_query_succeed_and_later_calls_raise_it():
    """cupy/cuda/stream.pyx: ``Event.done`` is ``eventQuery(ptr) == 0``; eventQuery returns
    the status and never raises (cupy_backends/cuda/api/runtime.pyx). After an illegal
    address (700) the context is corrupted: every later call returns 700, a query of an
    event never recorded included, and making an event (cudaEventCreateWithFlags)."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x = cp.ones(4)
        event = stream.record()
    assert event.done and runtime.eventQuery(event.ptr) == 0
    fresh = cp.cuda.Event()  # never recorded: done (nothing to wait for)
    assert fresh.done
    sim.inject_cuda_error(700)
    assert runtime.eventQuery(event.ptr) == 700 and not event.done
    assert runtime.streamQuery(stream.ptr) == 700 and not stream.done
    assert not fresh.done and runtime.eventQuery(fresh.ptr) == 700  # never cudaSuccess again
    for call in (lambda: x + 1, lambda: cp.ones(3), stream.synchronize, event.synchronize,
                 lambda: x.get(), lambda: stream.record(), fresh.synchronize, cp.cuda.Event,
                 lambda: x.set(np.ones(4)), lambda: cp.asarray(np.ones(2)),
                 lambda: runtime.streamSynchronize(stream.ptr),
                 lambda: runtime.eventSynchronize(event.ptr), runtime.deviceSynchronize):
        with pytest.raises(runtime.CUDARuntimeError) as err:
            call()
        assert err.value.status == 700
    with cp.cuda.Device(1):  # another device's context is untouched
        assert float(cp.ones(3).sum()) == 3.0


def test_a_kernel_given_a_bad_pointer_faults_after_the_call_and_queries_never_raise():
    """NCCL checks pointers only with NCCL_CHECK_POINTERS=1 (src/init.cc): the call returns,
    the kernel faults when it runs (an illegal address, a sticky 700), later than the call:
    calls made in between succeed. From then on Event.done and Stream.done are False
    (``eventQuery(ptr) == 0``, cupy/cuda/stream.pyx) and never raise; the other calls raise
    700."""
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    stream = cp.cuda.Stream(non_blocking=True)
    before = stream.record()
    comm.allReduce(0x1234, 0x1234, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
    after = stream.record()  # the kernel has not run yet: this succeeds
    fresh = cp.cuda.Event()
    assert before.done
    for _ in range(3):
        assert after.done is False and stream.done is False  # (the kernel ran, and faulted)
        assert fresh.done is False
        assert runtime.eventQuery(after.ptr) == 700 and runtime.streamQuery(stream.ptr) == 700
    with pytest.raises(runtime.CUDARuntimeError) as err:
        stream.record()
    assert err.value.status == 700
    comm.abort()


def test_a_kernel_reading_a_misaligned_element_corrupts_the_context():
    """CUDA C++ Programming Guide, "Device Memory Accesses": global memory is read and
    written in words of 1, 2, 4, 8 or 16 bytes, naturally aligned; a kernel that reads an
    element at another address fails with cudaErrorMisalignedAddress (716), which "leaves
    the process in an inconsistent state" (CUDA Runtime API): a sticky error. CuPy's views
    check no alignment, so the view itself succeeds (seen on an H200 with CuPy 14.2)."""
    raw = cp.zeros(64, cp.uint8)
    assert float(raw[8:24].view(cp.float64).sum()) == 0.0  # aligned: fine
    assert int(raw[3:7].sum()) == 0  # bytes are aligned anywhere
    bad = raw[4:20].view(cp.float64)  # a view launches nothing: no error yet
    for call in (bad.sum, lambda: cp.ones(3)):
        with pytest.raises(runtime.CUDARuntimeError) as err:
            call()
        assert err.value.status == 716


def test_set_from_pageable_memory_syncs_its_stream_and_reads_the_source_before_it_returns(
        monkeypatch):
    """CUDA Runtime API, "API synchronization behavior": "For transfers from pageable host
    memory to device memory, a stream sync is performed before the copy is initiated. The
    function will return once the pageable buffer has been copied to the staging memory"
    (CuPy's ndarray.set is copy_from_host_async, cupy/_core/core.pyx): set() waits for the
    stream's earlier work (here an NCCL allreduce, until its peer calls it), and the caller
    may overwrite the source at once; the device gets what the buffer held at the call. From
    page-locked memory the copy waits for nothing and reads the buffer when the stream gets
    to it (a DMA)."""
    monkeypatch.setenv("NCCL_RUNTIME_CONNECT", "0")  # (the allreduce call does not block)
    comms = two_sim_comms()
    cp.cuda.Device(0).use()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x = cp.ones(4, cp.float32)
        d, p = cp.zeros(4), cp.zeros(4)
    comms[0].allReduce(x.data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
    host = np.arange(4.0)
    pinned = np.frombuffer(cp.cuda.alloc_pinned_memory(32), np.float64, 4)
    pinned[:] = np.arange(4.0)
    started = time.monotonic()
    with stream:
        p.set(pinned)  # returns at once: queued behind the allreduce
    assert time.monotonic() - started < 1.0
    pinned[:] = 7.0  # before the stream got to the copy: the device gets 7
    assert runtime.streamQuery(stream.ptr) == 600

    def peer():
        time.sleep(0.3)
        cp.cuda.Device(1).use()
        y = cp.ones(4, cp.float32)
        comms[1].allReduce(y.data.ptr, y.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)
        cp.cuda.Stream.null.synchronize()

    thread = threading.Thread(target=peer)
    thread.start()
    try:
        with stream:
            d.set(host)  # the stream sync waits for the allreduce, and so for rank 1
        assert time.monotonic() - started >= 0.3
        host[:] = -1.0
        stream.synchronize()
        assert d.get(stream=stream).tolist() == [0.0, 1.0, 2.0, 3.0]
        assert p.get(stream=stream).tolist() == [7.0] * 4
        assert x.get(stream=stream).tolist() == [2.0] * 4
    finally:
        thread.join()
        for comm in comms:
            comm.destroy()


@pytest.mark.parametrize("where", ["null", "stream"])
def test_after_set_from_pageable_memory_what_its_stream_did_before_is_done(where):
    """The stream sync of a copy from pageable memory (CUDA Runtime API, "API synchronization
    behavior", above) finishes the work launched before it: memory that work used may be
    freed, handed back by CuPy's pool and written from any stream. The copy itself ("the DMA
    to final destination may not have completed") is ordered on its stream only: its
    destination, freed and written from another stream, still races; and so does what a
    copy from page-locked memory follows, which syncs nothing."""
    current = cp.cuda.Stream.null if where == "null" else cp.cuda.Stream(non_blocking=True)
    other = cp.cuda.Stream(non_blocking=True)
    pinned = np.frombuffer(cp.cuda.alloc_pinned_memory(2048), np.float64, 256)
    for source, races in ((np.ones(256), False), (pinned, True)):
        with current:
            used = cp.arange(256.0)
            total = used * 2  # work on the stream that uses the block
            ptr = used.data.ptr
            d = cp.empty(256)
            d.set(source)
            del used
            gc.collect()
            again = cp.empty(256)
            assert again.data.ptr == ptr  # (CuPy's pool: the same block, at once)
        with other:
            if races:
                with pytest.raises(sim.RaceError, match="freed while work on"):
                    again.fill(1.0)
            else:
                again.fill(1.0)  # the stream sync finished what used it
        with current:
            dptr = d.data.ptr
            del d
            gc.collect()
            reused = cp.empty(256)
            assert reused.data.ptr == dptr
        with other, pytest.raises(sim.RaceError, match="freed while work on"):
            reused.fill(2.0)  # the copy into it may still be landing
        runtime.deviceSynchronize()
        with current:
            assert float(total.sum()) == 2 * sum(range(256))
        del again, reused, total


# ---------------------------------------------------------------- NCCL

def _allreduce(comm, device: int, out: dict) -> None:
    cp.cuda.Device(device).use()
    x = cp.ones(4, cp.float32)
    try:
        comm.allReduce(x.data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                       cp.cuda.Stream.null.ptr)
        cp.cuda.Stream.null.synchronize()
        out["value"] = x.get().tolist()
    except BaseException as err:  # reported to the test
        out["error"] = err


def test_the_first_collective_blocks_its_thread_until_the_peers_call_it_too():
    """NCCL >= 2.22 (NCCL_RUNTIME_CONNECT=1, docs/userguide env.rst; src/enqueue.cc): the
    first collective of an algorithm connects inside the call; the thread waits, in C, with
    no timeout, for the peers. An abort from another thread does not reliably free it:
    "the thread can possibly get stuck inside NCCL calls ... might hang forever"
    (usage/communicators.rst, Fault Tolerance): it stays blocked (a SimulatedHang, saying
    so, after the simulator's hang timeout)."""
    comms = two_sim_comms()
    out: dict = {}
    blocked = threading.Thread(target=_allreduce, args=(comms[0], 0, out))
    blocked.start()
    time.sleep(0.5)
    assert blocked.is_alive() and not out  # inside allReduce, waiting for rank 1
    comms[0].abort()  # from another thread
    time.sleep(0.5)
    assert blocked.is_alive() and not out  # still inside
    blocked.join(10)
    assert isinstance(out["error"], sim.SimulatedHang), out
    assert "aborted from another thread meanwhile" in str(out["error"])
    comms[1].destroy()
    # the peers calling it too: the first call connects, and the collective runs
    comms = two_sim_comms()
    outs = [{}, {}]
    threads = [threading.Thread(target=_allreduce, args=(comms[r], r, outs[r])) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert outs[0]["value"] == outs[1]["value"] == [2.0] * 4
    for comm in comms:
        comm.destroy()


def _sized_allreduce(comm, nbytes: int):
    x = cp.ones(nbytes // 4, cp.float32)
    comm.allReduce(x.data.ptr, x.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                   cp.cuda.Stream.null.ptr)
    cp.cuda.Stream.null.synchronize()
    return float(x[:1].get()[0])


@pytest.mark.parametrize("nbytes", [128 << 10, 4 << 20], ids=["ring", "nvls"])
def test_each_algorithm_connects_at_its_first_use(nbytes):
    """src/enqueue.cc ``ncclPrepareTasks`` (v2.30.7-1 line 495): with NCCL_RUNTIME_CONNECT=1
    a collective connects the algorithm NCCL picks for it (by size, src/graph/tuning.cc) at
    that algorithm's first use. A one-element warm-up connects only what small operations
    pick: a large allreduce on one rank still blocks its thread until the peer calls it."""
    comms = two_sim_comms()
    assert _on_both(comms, lambda c, r: _sized_allreduce(c, 4)) == [2.0, 2.0]  # warm-up
    out: dict = {}

    def alone():
        cp.cuda.Device(0).use()
        x = cp.ones(nbytes // 4, cp.float32)
        comms[0].allReduce(x.data.ptr, x.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                           cp.cuda.Stream.null.ptr)
        out["launched"] = x  # (the call returned: only queued)

    blocked = threading.Thread(target=alone)
    blocked.start()
    time.sleep(0.5)
    assert blocked.is_alive() and not out  # connecting its algorithm, inside the call
    cp.cuda.Device(1).use()
    assert _sized_allreduce(comms[1], nbytes) == 2.0  # the peer connects it too
    blocked.join(10)
    cp.cuda.Device(0).use()
    cp.cuda.Stream.null.synchronize()
    assert float(out["launched"][:1].get()[0]) == 2.0
    for comm in comms:
        comm.destroy()


def test_with_runtime_connect_off_every_algorithm_connects_at_set_up(monkeypatch):
    """src/init.cc v2.30.7-1 lines 1552-1580: NCCL_RUNTIME_CONNECT=0 connects ring, tree,
    PAT, NVLS in ncclCommInitRank: an operation of any size is only queued by the call."""
    monkeypatch.setenv("NCCL_RUNTIME_CONNECT", "0")
    comms = two_sim_comms()
    cp.cuda.Device(0).use()
    for x in [cp.ones(nbytes // 4, cp.float32) for nbytes in (4, 128 << 10, 4 << 20)]:
        comms[0].allReduce(x.data.ptr, x.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                           cp.cuda.Stream.null.ptr)  # returns at once
    assert runtime.streamQuery(0) == 600  # queued: rank 1 never called them
    for comm in comms:
        comm.abort()


def _on_both(comms, run) -> list:
    """``run(comm, rank)`` on both ranks of ``comms`` at once (each in a thread on its
    device); their results."""
    outs: list = [None, None]

    def one(r):
        cp.cuda.Device(r).use()
        try:
            outs[r] = run(comms[r], r)
        except BaseException as err:  # reported to the test
            outs[r] = err

    threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return outs


def test_max_and_min_of_floats_drop_nan_as_nccls_fmaxf():
    """src/device/reduce_kernel.h (FuncMinMax, v2.30.7-1 lines 422-446): floats reduce with
    fmaxf/fminf, doubles fmax/fmin, halves __hmax/__hmin: IEEE maxNum, a NaN loses to any
    number (two NaNs give NaN). Integers compare exactly."""
    comms = two_sim_comms()
    rows = {0: [np.nan, 1.0, np.nan, -np.inf], 1: [2.0, np.nan, np.nan, 5.0]}

    def run(comm, r):
        got = {}
        for name, op in (("max", nccl.NCCL_MAX), ("min", nccl.NCCL_MIN)):
            for dtype, code in ((np.float16, nccl.NCCL_FLOAT16), (np.float32, nccl.NCCL_FLOAT32),
                                (np.float64, nccl.NCCL_FLOAT64)):
                x = cp.asarray(np.array(rows[r], dtype))
                comm.allReduce(x.data.ptr, x.data.ptr, 4, code, op, cp.cuda.Stream.null.ptr)
                got[name, dtype] = x.get()
        return got

    outs = _on_both(comms, run)
    for r in (0, 1):
        for dtype in (np.float16, np.float32, np.float64):
            np.testing.assert_array_equal(outs[r]["max", dtype], [2, 1, np.nan, 5])
            np.testing.assert_array_equal(outs[r]["min", dtype], [2, 1, np.nan, -np.inf])
    for comm in comms:
        comm.destroy()


def test_a_blocked_first_use_ends_as_a_simulated_hang(monkeypatch):
    monkeypatch.setenv("SYNK_SIM_HANG_TIMEOUT", "1")
    comms = two_sim_comms()
    out: dict = {}
    _allreduce(comms[0], 0, out)
    assert isinstance(out["error"], sim.SimulatedHang)
    assert "would block forever inside NCCL" in str(out["error"])
    for comm in comms:
        comm.abort()


def test_empty_collectives_are_discarded_and_pointers_are_not_checked(monkeypatch):
    """src/enqueue.cc: "Empty collectives can be discarded" (after the root, type and op
    checks); src/init.cc: pointers are checked only with NCCL_CHECK_POINTERS=1, else a bad
    one is an illegal address in NCCL's kernel: a sticky CUDA error."""
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    null = cp.cuda.Stream.null.ptr
    comm.allReduce(0, 0, 0, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, null)
    comm.broadcast(0, 0, 0, nccl.NCCL_INT8, 0, null)
    with pytest.raises(nccl.NcclError) as err:
        comm.broadcast(0, 0, 0, nccl.NCCL_INT8, 3, null)  # the root is checked all the same
    assert err.value.status == 4
    comm.allReduce(0x1234, 0x1234, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, null)  # accepted
    assert runtime.streamQuery(null) == 700  # ... and the kernel faulted
    comm.abort()


def test_pointers_are_checked_with_nccl_check_pointers(monkeypatch):
    monkeypatch.setenv("NCCL_CHECK_POINTERS", "1")
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    with pytest.raises(nccl.NcclError) as err:
        comm.allReduce(0x1234, 0x1234, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)
    assert err.value.status == 4
    comm.destroy()


def _rank_1_calls(comms, call) -> None:
    cp.cuda.Device(1).use()
    try:
        call(comms[1])
    finally:
        cp.cuda.Device(0).use()


def test_a_peer_on_the_same_host_that_aborts_goes_unnoticed(monkeypatch):
    """ncclCommGetAsyncError reads the communicator's and its proxy thread's results only
    (src/init.cc v2.30.7-1 line 3453); within a node no transport watches the peers, and the
    proxy only logs a peer's closed connection ("Connection closed by localRank",
    src/proxy.cc line 1879): the survivor's collective never completes, and no NcclError
    says why. Waiting on it would hang forever on a GPU: the simulator says so."""
    monkeypatch.setenv("NCCL_RUNTIME_CONNECT", "0")
    comms = two_sim_comms()
    _rank_1_calls(comms, lambda comm: comm.abort())
    x = cp.ones(4, cp.float32)
    comms[0].allReduce(x.data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)
    done = cp.cuda.Event()
    done.record()
    for _ in range(3):
        comms[0].check_async_error()  # nothing to report
        assert runtime.eventQuery(done.ptr) == 600 and not done.done
        time.sleep(0.06)
    with pytest.raises(sim.SimulatedHang, match="rank 1 aborted the communicator") as err:
        cp.cuda.Stream.null.synchronize()
    assert "ncclCommGetAsyncError reports nothing" in str(err.value)
    comms[0].abort()


@pytest.mark.parametrize("disagreement", ["count", "op", "datatype", "send count"])
def test_ranks_that_disagree_get_no_nccl_status(monkeypatch, disagreement):
    """"Collective operations have to be called for each rank ... using the same count and
    the same datatype ... Failure to do so will result in undefined behavior, including
    hangs, crashes, or data corruption" (docs/userguide/source/usage/collectives.rst
    v2.30.7-1 lines 5-6; a send and its recv "with the same count and data type",
    usage/p2p.rst): NCCL returns no status. The simulator reports it as its own
    SimulatorError, which a program cannot take for an NcclError it handles."""
    monkeypatch.setenv("NCCL_RUNTIME_CONNECT", "0")
    comms = two_sim_comms()

    def call(comm, r):
        x = cp.ones(8, cp.float32)
        count = 4 + (disagreement == "count" and r == 1)
        op = nccl.NCCL_MAX if disagreement == "op" and r == 1 else nccl.NCCL_SUM
        datatype = (nccl.NCCL_INT32 if disagreement == "datatype" and r == 1
                    else nccl.NCCL_FLOAT32)
        if disagreement == "send count":
            if r == 0:
                comm.send(x.data.ptr, 4, nccl.NCCL_FLOAT32, 1, 0)
            else:
                comm.recv(x.data.ptr, 3, nccl.NCCL_FLOAT32, 0, 0)
        else:
            comm.allReduce(x.data.ptr, x.data.ptr, count, datatype, op, 0)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            comm.check_async_error()
            time.sleep(0.01)
        return "no error"

    outs = _on_both(comms, call)
    for r in (0, 1):
        assert type(outs[r]) is sim.SimulatorError, outs[r]
        assert not isinstance(outs[r], nccl.NcclError)
        assert "would hang or give wrong numbers (undefined behaviour)" in str(outs[r])
    for comm in comms:
        comm.abort()


def test_freeing_a_communicator_another_thread_is_inside_is_reported():
    """ncclCommAbort and ncclCommDestroy free the communicator (docs/userguide comms.rst);
    NCCL requires that no thread is inside a call on it (usage/communicators.rst, "Fault
    Tolerance"), except one blocked connecting, which only an abort frees."""
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    inside = comm._inside("ncclAllReduce")
    entered, leave = threading.Event(), threading.Event()

    def call():
        with inside:
            entered.set()
            leave.wait(5)

    t = threading.Thread(target=call)
    t.start()
    entered.wait(5)
    with pytest.raises(sim.SimulatorError, match="would use freed memory"):
        comm.abort()
    leave.set()
    t.join()
