"""CuPy 14.2's own test cases (and a few behaviours read off its sources), ported to run
against the CUDA simulator's stand-in for ``cupy``: each test names what it ports."""
import gc
import pickle
import threading

import numpy as np
import pytest

from synk.simulator import cupy

cuda = cupy.cuda
nccl, runtime = cuda.nccl, cuda.runtime

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("two_sim_devices")]

UNIT = 512  # CuPy's allocation unit (cupy/cuda/memory.pyx ALLOCATION_UNIT_SIZE)
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.bool_, np.complex64]


@pytest.fixture
def pool():
    """The default memory pool with no free whole blocks, and no garbage collection while
    the test counts bytes (a collection could free other tests' arrays meanwhile)."""
    gc.collect()
    mempool = cupy.get_default_memory_pool()
    mempool.free_all_blocks()
    gc.disable()
    try:
        yield mempool
    finally:
        gc.enable()
        gc.collect()
        mempool.free_all_blocks()


def shaped_arange(shape, xp, dtype=np.float32, order="C"):
    """cupy/testing/_helper.py shaped_arange: 1..N (bool: evens True; complex: n + nj)."""
    dtype = np.dtype(dtype)
    a = np.arange(1, int(np.prod(shape)) + 1, 1)
    if dtype == "?":
        a = a % 2 == 0
    elif dtype.kind == "c":
        a = a + a * 1j
    return xp.array(a.astype(dtype).reshape(shape), order=order)


def nbytes_array(nbytes):
    """A device array of exactly ``nbytes`` bytes (as CuPy's tests malloc a size)."""
    return cupy.empty(nbytes, dtype=cupy.uint8)


# ============================================================ streams (test_stream.py)

def test_stream_eq():
    # cuda_tests/test_stream.py TestStream.test_eq ('null'; no Stream(ptds=True) here)
    stream = cuda.Stream.null
    stream.use()
    null0 = stream
    null1 = cuda.Stream(True)
    null2 = cuda.Stream(True)
    null4 = cuda.Stream()
    assert null0 == null1
    assert null1 == null2
    assert null2 != null4


def test_stream_hash():
    # cuda_tests/test_stream.py TestStream.test_hash ('null')
    stream = cuda.Stream.null
    stream.use()
    hash(stream)
    hash(cuda.Stream(True))
    hash(cuda.Stream(False))
    mapping = {cuda.Stream(): 1, cuda.Stream(): 2}
    assert len(mapping) == 2


def check_del(null):
    # cuda_tests/test_stream.py TestStream.check_del (ptds=False)
    stream = cuda.Stream(null=null).use()
    assert stream is cuda.get_current_stream()
    stream_ptr = stream.ptr
    x = cupy.array([1, 2, 3])
    del stream
    assert stream_ptr == cuda.get_current_stream().ptr
    cuda.Stream.null.use()
    assert cuda.Stream.null is cuda.get_current_stream()
    del x


def test_stream_del_default():
    # cuda_tests/test_stream.py TestStream.test_del_default
    check_del(null=False)


def test_stream_del():
    # cuda_tests/test_stream.py TestStream.test_del ('null')
    stream = cuda.Stream.null
    stream.use()
    check_del(null=stream == cuda.Stream.null)


def test_stream_with_statement():
    # cuda_tests/test_stream.py TestStream.test_with_statement ('null')
    stream = cuda.Stream.null
    stream.use()
    stream1 = cuda.Stream()
    stream2 = cuda.Stream()
    assert stream == cuda.get_current_stream()
    with stream1:
        assert stream1 == cuda.get_current_stream()
        with stream2:
            assert stream2 == cuda.get_current_stream()
        assert stream1 == cuda.get_current_stream()
    # self.stream is "forgotten"!
    assert cuda.Stream.null == cuda.get_current_stream()


def test_stream_use():
    # cuda_tests/test_stream.py TestStream.test_use ('null')
    stream = cuda.Stream.null
    stream.use()
    stream1 = cuda.Stream().use()
    assert stream1 == cuda.get_current_stream()
    stream.use()
    assert stream == cuda.get_current_stream()


def test_stream_per_device():
    # cuda_tests/test_stream.py TestStream.test_per_device
    with cuda.Device(0):
        stream0 = cuda.Stream()
        with stream0:
            assert stream0 == cuda.get_current_stream()
            with cuda.Device(1):
                assert stream0 != cuda.get_current_stream()
                assert cuda.Stream.null == cuda.get_current_stream()
                assert stream0 == cuda.get_current_stream(0)
            assert stream0 == cuda.get_current_stream()


def test_stream_per_device_failure():
    # cuda_tests/test_stream.py TestStream.test_per_device_failure
    with cuda.Device(0):
        stream0 = cuda.Stream()
    with cuda.Device(1):
        with pytest.raises(RuntimeError):
            with stream0:
                pass
        with pytest.raises(RuntimeError):
            stream0.use()


def test_stream_mix_use_context():
    # cuda_tests/test_stream.py TestStream.test_mix_use_context ('null'; cupy/cupy#5143):
    # leaving a with block makes current what was current when the enclosing one began
    stream = cuda.Stream.null
    stream.use()
    s1 = cuda.Stream()
    s2 = cuda.Stream()
    s3 = cuda.Stream()
    assert cuda.get_current_stream() == stream
    with s1:
        assert cuda.get_current_stream() == s1
        s2.use()
        assert cuda.get_current_stream() == s2
        with s3:
            assert cuda.get_current_stream() == s3
            del s2
        assert cuda.get_current_stream() == s1
    # self.stream is "forgotten"!
    assert cuda.get_current_stream() == cuda.Stream.null


def test_stream_thread():
    # cuda_tests/test_stream.py TestStream.test_stream_thread (its global s1 as a shared slot)
    shared = {"s1": None}

    def f1(barrier, errors):
        tid = barrier.wait()
        try:
            shared["s1"] = cuda.Stream()
            barrier.wait()  # until t2 starts
            shared["s1"].use()
            barrier.wait()  # until t2 uses the stream
            shared["s1"] = None
            gc.collect()
            barrier.wait()  # until t2 decrefs the stream
            assert cuda.get_current_stream() is not None
            cupy.arange(10)
            errors[tid] = False
        except Exception as e:
            errors[tid] = e

    def f2(barrier, errors):
        tid = barrier.wait()
        try:
            barrier.wait()  # until t1 creates the stream
            shared["s1"].use()
            barrier.wait()  # until t1 uses the stream
            shared["s1"] = None
            gc.collect()
            barrier.wait()  # until t1 decrefs the stream
            assert cuda.get_current_stream() is not None
            cupy.arange(10)
            errors[tid] = False
        except Exception as e:
            errors[tid] = e

    barrier = threading.Barrier(2, timeout=30)
    errors = [True, True]
    threads = [
        threading.Thread(target=f1, args=(barrier, errors), daemon=True),
        threading.Thread(target=f2, args=(barrier, errors), daemon=True),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for err in errors:
        assert err is False, err


def test_stream_create_with_flags():
    # cuda_tests/test_stream.py TestStream.test_create_with_flags
    s1 = cuda.Stream()
    s2 = cuda.Stream(non_blocking=True)
    assert s1.is_non_blocking is False
    assert s2.is_non_blocking is True


def test_device_use():
    # cuda_tests/test_device.py TestDeviceSwitch.test_use: use() returns the device
    # (cupy/cuda/device.pyx Device.use: ``return self``)
    dev0, dev1 = cuda.Device(0), cuda.Device(1)
    assert dev1.use() is dev1
    assert 1 == cuda.Device().id
    assert dev0.use() is dev0
    assert 0 == cuda.Device().id


# ============================================================ events and queries (stream.pyx)

def test_event_unrecorded_is_done():
    # cupy/cuda/stream.pyx Event.done: runtime.eventQuery(ptr) == 0 (cudaSuccess); an event
    # never recorded has no work to wait for
    e = cuda.Event()
    assert e.done is True
    assert runtime.eventQuery(e.ptr) == 0


def test_event_query_after_synchronize():
    # cupy/cuda/stream.pyx Event.done / Event.synchronize: eventQuery returns the status
    s = cuda.Stream()
    with s:
        x = cupy.arange(10)
    e = s.record()
    e.synchronize()
    assert runtime.eventQuery(e.ptr) == 0
    assert e.done is True
    del x


def test_stream_query_idle():
    # cupy/cuda/stream.pyx Stream.done: runtime.streamQuery(ptr) == 0 on an idle stream
    s = cuda.Stream()
    assert runtime.streamQuery(s.ptr) == 0
    assert s.done is True
    with s:
        x = cupy.arange(10) * 2
    s.synchronize()
    assert runtime.streamQuery(s.ptr) == 0
    assert s.done is True
    cuda.Stream.null.synchronize()
    assert runtime.streamQuery(cuda.Stream.null.ptr) == 0
    assert cuda.Stream.null.done is True
    del x


def test_event_record_on_a_stream_of_another_device_fails():
    # CUDA C++ Programming Guide, "Stream and Event Behavior": "cudaEventRecord() will fail
    # if the input event and input stream are associated to different devices" (400,
    # cudaErrorInvalidResourceHandle); "cudaStreamWaitEvent() will succeed even if the input
    # stream and input event are associated to different devices". Stream.record() makes
    # its event on the current device (cupy/cuda/stream.pyx): from another device it fails.
    event = cuda.Event()  # device 0's
    with cuda.Device(1):
        other = cuda.Stream(non_blocking=True)
        with pytest.raises(runtime.CUDARuntimeError) as err:
            event.record(other)
        assert err.value.status == 400
        with pytest.raises(runtime.CUDARuntimeError) as err:
            event.record()  # the current stream: device 1's null stream
        assert err.value.status == 400
        with other:
            x = cupy.arange(4.0)
        done = other.record()  # made on device 1: fine
    with pytest.raises(runtime.CUDARuntimeError) as err:
        other.record()  # its new event is device 0's
    assert err.value.status == 400
    mine = cuda.Stream(non_blocking=True)
    mine.wait_event(done)  # across devices: fine
    assert done.done and runtime.eventQuery(done.ptr) == 0  # from another device too
    del x


def test_event_record_defaults_to_current_stream():
    # cupy/cuda/stream.pyx Event.record(stream=None): records on get_current_stream_ptr()
    s1 = cuda.Stream(non_blocking=True)
    s2 = cuda.Stream(non_blocking=True)
    with s1:
        x = cupy.arange(4.0) * 2
        e = cuda.Event()
        e.record()  # on s1, the current stream (not the null stream)
    s2.wait_event(e)
    with s2:
        assert (x + 1).get(stream=s2).tolist() == [1.0, 3.0, 5.0, 7.0]


# ============================================================ memory pool (test_memory.py)

def test_alloc_distinct():
    # cuda_tests/test_memory.py TestSingleDeviceMemoryPool.test_alloc
    p1 = nbytes_array(UNIT * 4)
    p2 = nbytes_array(UNIT * 4)
    p3 = nbytes_array(UNIT * 8)
    assert p1.data.ptr != p2.data.ptr
    assert p1.data.ptr != p3.data.ptr
    assert p2.data.ptr != p3.data.ptr


def test_free_reuses_block():
    # cuda_tests/test_memory.py TestSingleDeviceMemoryPool.test_free
    p1 = nbytes_array(UNIT * 4)
    ptr1 = p1.data.ptr
    del p1
    p2 = nbytes_array(UNIT * 4)
    assert ptr1 == p2.data.ptr


def test_free_stream():
    # cuda_tests/test_memory.py TestSingleDeviceMemoryPool.test_free_stream
    stream = cuda.Stream()
    p1 = nbytes_array(UNIT * 4)
    ptr1 = p1.data.ptr
    del p1
    with stream:
        p2 = nbytes_array(UNIT * 4)
    assert ptr1 != p2.data.ptr


def test_free_different_size(pool):
    # cuda_tests/test_memory.py TestSingleDeviceMemoryPool.test_free_different_size
    with cuda.Stream():
        p1 = nbytes_array(UNIT * 4)
        ptr1 = p1.data.ptr
        del p1
        p2 = nbytes_array(UNIT * 8)
        assert ptr1 != p2.data.ptr


def test_alloc_split(pool):
    # cuda_tests/test_memory.py TestSingleDeviceMemoryPool.test_alloc_split
    with cuda.Stream():
        p = nbytes_array(2048)
        ptr = p.data.ptr
        del p
        head = nbytes_array(1024)
        tail = nbytes_array(1024)
        assert ptr == head.data.ptr
        assert ptr + UNIT * 2 == tail.data.ptr


def test_free_merge(pool):
    # cuda_tests/test_memory.py TestSingleDeviceMemoryPool.test_free_merge
    with cuda.Stream():
        p = nbytes_array(2048)
        ptr = p.data.ptr
        del p

        # merge head into tail
        head = nbytes_array(1024)
        tail = nbytes_array(1024)
        assert ptr == head.data.ptr
        del tail
        del head
        p = nbytes_array(2048)
        assert ptr == p.data.ptr
        del p

        # merge tail into head
        head = nbytes_array(1024)
        tail = nbytes_array(1024)
        assert ptr == head.data.ptr
        del head
        del tail
        p = nbytes_array(2048)
        assert ptr == p.data.ptr
        del p


def test_free_all_blocks_split(pool):
    # cuda_tests/test_memory.py TestSingleDeviceMemoryPool.test_free_all_blocks_split:
    # do not free split blocks
    with cuda.Stream():
        p = nbytes_array(UNIT * 4)
        del p
        head = nbytes_array(UNIT * 2)
        tail = nbytes_array(UNIT * 2)
        tailptr = tail.data.ptr
        del tail
        pool.free_all_blocks()
        p = nbytes_array(UNIT * 2)
        assert tailptr == p.data.ptr
        del head


def test_free_all_blocks_stream(pool):
    # cuda_tests/test_memory.py TestSingleDeviceMemoryPool.test_free_all_blocks_stream
    # (with two fresh streams; after cudaFree a new block may get the old address, so
    # only the block kept by the other stream's arena is checked by pointer)
    s1, s2 = cuda.Stream(), cuda.Stream()
    with s1:
        p1 = nbytes_array(UNIT * 4)
        del p1
    with s2:
        p2 = nbytes_array(UNIT * 4)
        ptr2 = p2.data.ptr
        del p2
    total, n_free = pool.total_bytes(), pool.n_free_blocks()
    pool.free_all_blocks(stream=s1)
    assert pool.total_bytes() == total - UNIT * 4
    assert pool.n_free_blocks() == n_free - 1
    with s2:
        p4 = nbytes_array(UNIT * 4)
        assert ptr2 == p4.data.ptr
        del p4


def test_free_all_blocks_n_free_blocks(pool):
    # cuda_tests/test_memory.py TestMemoryPool.test_free_all_blocks (counts as differences)
    with cuda.Stream():
        n0, total0 = pool.n_free_blocks(), pool.total_bytes()
        mem = nbytes_array(1)
        assert pool.n_free_blocks() == n0
        assert pool.total_bytes() == total0 + UNIT
        del mem
        assert pool.n_free_blocks() == n0 + 1
        pool.free_all_blocks()
        assert pool.n_free_blocks() == n0
        assert pool.total_bytes() == total0


def test_used_bytes(pool):
    # cuda_tests/test_memory.py TestSingleDeviceMemoryPool.test_used_bytes
    with cuda.Stream():
        used = pool.used_bytes()
        p1 = nbytes_array(UNIT * 2)
        assert used + UNIT * 2 == pool.used_bytes()
        p2 = nbytes_array(UNIT * 4)
        assert used + UNIT * 6 == pool.used_bytes()
        del p2
        assert used + UNIT * 2 == pool.used_bytes()
        del p1
        assert used + UNIT * 0 == pool.used_bytes()
        p3 = nbytes_array(UNIT * 1)
        assert used + UNIT * 1 == pool.used_bytes()
        del p3


def test_free_bytes(pool):
    # cuda_tests/test_memory.py TestSingleDeviceMemoryPool.test_free_bytes
    with cuda.Stream():
        free = pool.free_bytes()
        p1 = nbytes_array(UNIT * 2)
        assert free + UNIT * 0 == pool.free_bytes()
        p2 = nbytes_array(UNIT * 4)
        assert free + UNIT * 0 == pool.free_bytes()
        del p2
        assert free + UNIT * 4 == pool.free_bytes()
        del p1
        assert free + UNIT * 6 == pool.free_bytes()
        p3 = nbytes_array(UNIT * 1)
        assert free + UNIT * 5 == pool.free_bytes()
        del p3


def test_total_bytes(pool):
    # cuda_tests/test_memory.py TestSingleDeviceMemoryPool.test_total_bytes
    with cuda.Stream():
        total = pool.total_bytes()
        p1 = nbytes_array(UNIT * 2)
        assert total + UNIT * 2 == pool.total_bytes()
        p2 = nbytes_array(UNIT * 4)
        assert total + UNIT * 6 == pool.total_bytes()
        del p1
        assert total + UNIT * 6 == pool.total_bytes()
        del p2
        assert total + UNIT * 6 == pool.total_bytes()
        p3 = nbytes_array(UNIT * 1)
        assert total + UNIT * 6 == pool.total_bytes()

        assert pool.used_bytes() + pool.free_bytes() == pool.total_bytes()

        del p3

        pool.free_all_blocks()
        assert total == pool.total_bytes()


def test_bytes_stream(pool):
    # cuda_tests/test_memory.py TestSingleDeviceMemoryPool.test_used_bytes_stream,
    # test_free_bytes_stream and test_total_bytes_stream
    s1, s2 = cuda.Stream(), cuda.Stream()
    used, free, total = pool.used_bytes(), pool.free_bytes(), pool.total_bytes()
    with s1:
        p1 = nbytes_array(UNIT * 4)
        del p1
    with s2:
        p2 = nbytes_array(UNIT * 2)
    assert used + UNIT * 2 == pool.used_bytes()
    assert free + UNIT * 4 == pool.free_bytes()
    assert total + UNIT * 6 == pool.total_bytes()
    del p2


def test_set_allocator_sizes(pool):
    # cuda_tests/test_memory.py TestAllocator.test_set_allocator (the default pool)
    with cuda.Stream():
        used = pool.used_bytes()
        arr = cupy.arange(128, dtype=cupy.int64)
        assert 1024 == arr.data.mem.size
        assert used + 1024 == pool.used_bytes()
        del arr


def test_zero_size_alloc(pool):
    # cuda_tests/test_memory.py TestMemoryPool.test_zero_size_alloc: size 0 is not pooled
    # (memory.pyx SingleDeviceMemoryPool._malloc: MemoryPointer(Memory(0), 0), ptr 0)
    used, total = pool.used_bytes(), pool.total_bytes()
    a = cupy.empty(0)
    assert a.data.ptr == 0
    assert pool.used_bytes() == used
    assert pool.total_bytes() == total


def _reuse_between_thread(stream_main, stream_sub):
    # cuda_tests/test_memory.py TestAllocator._reuse_between_thread (the default pool)
    result = {}

    def job(stream):
        cuda.Device().use()
        with stream:
            arr = cupy.arange(16)
        result["ptr"] = arr.data.ptr
        del arr
        result["error"] = False

    # Run in main thread.
    result.update(ptr=-1, error=True)
    job(stream_main)
    assert not result["error"]
    main_ptr = result["ptr"]

    # Run in sub thread.
    result.update(ptr=-1, error=True)
    with cuda.Device():
        t = threading.Thread(target=job, args=(stream_sub,))
        t.daemon = True
        t.start()
        t.join()
    assert not result["error"]
    return main_ptr, result["ptr"]


def test_reuse_between_thread():
    # cuda_tests/test_memory.py TestAllocator.test_reuse_between_thread
    stream = cuda.Stream.null
    main_ptr, sub_ptr = _reuse_between_thread(stream, stream)
    assert main_ptr == sub_ptr


def test_reuse_between_thread_same_stream():
    # cuda_tests/test_memory.py TestAllocator.test_reuse_between_thread_same_stream
    stream = cuda.Stream()
    main_ptr, sub_ptr = _reuse_between_thread(stream, stream)
    assert main_ptr == sub_ptr


def test_reuse_between_thread_different_stream():
    # cuda_tests/test_memory.py TestAllocator.test_reuse_between_thread_different_stream
    stream1 = cuda.Stream()
    stream2 = cuda.Stream()
    main_ptr, sub_ptr = _reuse_between_thread(stream1, stream2)
    assert main_ptr != sub_ptr


# ============================================================ ndarray.get (test_ndarray_get.py)

def check_get(f, stream, order="C", blocking=True):
    # core_tests/test_ndarray_get.py TestArrayGet.check_get
    a_gpu = f(cupy)
    a_cpu = a_gpu.get(stream, order=order, blocking=blocking)
    if stream:
        stream.synchronize()
    b_cpu = f(np)
    np.testing.assert_array_equal(a_cpu, b_cpu)
    if order == "F" or (order == "A" and a_gpu.flags.f_contiguous):
        assert a_cpu.flags.f_contiguous
    else:
        assert a_cpu.flags.c_contiguous


def _contiguous(dtype, order):
    return lambda xp: shaped_arange((3,), xp, dtype, order)


def _non_contiguous(dtype, order):
    return lambda xp: shaped_arange((3, 3), xp, dtype, order)[0::2, 0::2]


@pytest.mark.parametrize("order", ["C", "F", "A"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_get_contiguous_array(dtype, order):
    # core_tests/test_ndarray_get.py TestArrayGet.test_contiguous_array
    check_get(_contiguous(dtype, order), None, order)


@pytest.mark.parametrize("order", ["C", "F", "A"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_get_non_contiguous_array(dtype, order):
    # core_tests/test_ndarray_get.py TestArrayGet.test_non_contiguous_array
    check_get(_non_contiguous(dtype, order), None, order)


@pytest.mark.parametrize("order", ["C", "F", "A"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_get_contiguous_array_stream(dtype, order):
    # core_tests/test_ndarray_get.py TestArrayGet.test_contiguous_array_stream
    check_get(_contiguous(dtype, order), cuda.Stream.null, order)


@pytest.mark.parametrize("order", ["C", "F", "A"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_get_contiguous_array_stream_nonblocking(dtype, order):
    # core_tests/test_ndarray_get.py TestArrayGet.test_contiguous_array_stream_nonblocking
    check_get(_contiguous(dtype, order), cuda.Stream.null, order, False)


@pytest.mark.parametrize("order", ["C", "F", "A"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_get_non_contiguous_array_stream(dtype, order):
    # core_tests/test_ndarray_get.py TestArrayGet.test_non_contiguous_array_stream
    check_get(_non_contiguous(dtype, order), cuda.Stream.null)


@pytest.mark.parametrize("order", ["C", "F", "A"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_get_multigpu(dtype, order):
    # core_tests/test_ndarray_get.py TestArrayGet.test_get_multigpu
    with cuda.Device(1):
        src = shaped_arange((2, 3), cupy, dtype, order)
        src = cupy.asfortranarray(src)
    with cuda.Device(0):
        dst = src.get()
    expected = shaped_arange((2, 3), np, dtype, order)
    np.testing.assert_array_equal(dst, expected)


def check_get_with_out(f, out, stream):
    # core_tests/test_ndarray_get.py TestArrayGetWithOut.check_get
    a_gpu = f(cupy)
    a_cpu = a_gpu.get(stream, out=out)
    if stream:
        stream.synchronize()
    b_cpu = f(np)
    assert a_cpu is out
    np.testing.assert_array_equal(a_cpu, b_cpu)


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_get_out_contiguous_array(dtype, order):
    # core_tests/test_ndarray_get.py TestArrayGetWithOut.test_contiguous_array
    out = np.empty((3,), dtype, order)
    check_get_with_out(_contiguous(dtype, order), out, None)


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_get_out_contiguous_array_cross(dtype, order):
    # core_tests/test_ndarray_get.py TestArrayGetWithOut.test_contiguous_array_cross
    out_order = "C" if order == "F" else "F"
    out = np.empty((3,), dtype, out_order)
    check_get_with_out(_contiguous(dtype, order), out, None)


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_get_out_contiguous_array_with_error(dtype, order):
    # core_tests/test_ndarray_get.py TestArrayGetWithOut.test_contiguous_array_with_error
    out = np.empty((3, 3), dtype)[0:2, 0:2]
    with pytest.raises(RuntimeError):
        a_gpu = shaped_arange((3, 3), cupy, dtype, order)[0:2, 0:2]
        a_gpu.get(out=out)


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_get_out_non_contiguous_array(dtype, order):
    # core_tests/test_ndarray_get.py TestArrayGetWithOut.test_non_contiguous_array
    out = np.empty((2, 2), dtype, order)
    check_get_with_out(_non_contiguous(dtype, order), out, None)


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_get_out_contiguous_array_stream(dtype, order):
    # core_tests/test_ndarray_get.py TestArrayGetWithOut.test_contiguous_array_stream
    out = np.empty((3,), dtype, order)
    check_get_with_out(_contiguous(dtype, order), out, cuda.Stream.null)


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_get_out_non_contiguous_array_stream(dtype, order):
    # core_tests/test_ndarray_get.py TestArrayGetWithOut.test_non_contiguous_array_stream
    out = np.empty((2, 2), dtype, order)
    check_get_with_out(_non_contiguous(dtype, order), out, cuda.Stream.null)


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_get_out_multigpu(dtype, order):
    # core_tests/test_ndarray_get.py TestArrayGetWithOut.test_get_multigpu
    with cuda.Device(1):
        src = shaped_arange((2, 3), cupy, dtype, order)
        src = cupy.asfortranarray(src)
    with cuda.Device(0):
        dst = np.empty((2, 3), dtype, order)
        src.get(out=dst)
    expected = shaped_arange((2, 3), np, dtype, order)
    np.testing.assert_array_equal(dst, expected)


def test_get_out_errors():
    # cupy/_core/core.pyx ndarray.get (v14.2.0 l. 2098): out is checked for type, then
    # dtype (TypeError), then shape (ValueError)
    a = cupy.arange(6, dtype=cupy.float32).reshape(2, 3)
    with pytest.raises(TypeError):
        a.get(out=[[0.0] * 3] * 2)
    with pytest.raises(TypeError):
        a.get(out=np.empty((2, 3), np.float64))
    with pytest.raises(ValueError):
        a.get(out=np.empty((3, 2), np.float32))
    with pytest.raises(TypeError):  # dtype before shape
        a.get(out=np.empty((3, 2), np.float64))


def test_get_size_zero():
    # cupy/_core/core.pyx ndarray.get: size 0 returns numpy.ndarray(shape, dtype)
    got = cupy.empty((0, 3), dtype=cupy.float32).get()
    assert isinstance(got, np.ndarray)
    assert got.shape == (0, 3)
    assert got.dtype == np.float32


def test_set_errors_and_layouts():
    # cupy/_core/core.pyx ndarray.set (v14.2.0 l. 2210): type, then dtype (TypeError), then
    # shape (ValueError); the destination must be contiguous, the source need not be
    d = cupy.zeros((2, 3), dtype=cupy.float32)
    with pytest.raises(TypeError):
        d.set([[1.0] * 3] * 2)
    with pytest.raises(TypeError):
        d.set(np.ones((2, 3), np.float64))
    with pytest.raises(ValueError):
        d.set(np.ones((3, 2), np.float32))
    with pytest.raises(TypeError):  # dtype before shape
        d.set(np.ones((3, 2), np.float64))
    host = np.arange(24, dtype=np.float32).reshape(4, 6)
    source = host[::2, ::2]
    assert not source.flags.c_contiguous and not source.flags.f_contiguous
    d.set(source)
    np.testing.assert_array_equal(d.get(), source)
    big = cupy.zeros((4, 6), dtype=cupy.float32)
    with pytest.raises(RuntimeError, match="Cannot set to non-contiguous array"):
        big[::2, ::2].set(source)


# ============================================================ CuPy's differences from numpy
# (docs/source/user_guide/difference.rst, v14.2.0)

def test_out_of_bounds_integer_array_indices_wrap():
    # difference.rst, "Out-of-bounds indices": "NumPy handles them by raising an error, but
    # CuPy wraps around them" (cupy/_core/_routines_indexing.pyx: _take_kernel_core,
    # _prepare_array_indexing "wrap all out-of-bound indices", the scatter kernels)
    x = cupy.array([0, 1, 2])
    x[[1, 3]] = 10
    assert x.tolist() == [10, 10, 2]  # (the doc's example)
    a = cupy.arange(10.0)
    assert a[cupy.array([11, -12, 3])].tolist() == [1.0, 8.0, 3.0]
    assert a[[11]].tolist() == [1.0] and a[np.array([[10, 21]])].tolist() == [[0.0, 1.0]]
    assert a.take([12, -1]).tolist() == [2.0, 9.0] and float(cupy.take(a, 13)) == 3.0
    m = cupy.arange(12).reshape(3, 4)
    assert m[[3, -4], [5, 1]].tolist() == [1, 9]
    assert m[:, [5, 6]].tolist() == [[1, 2], [5, 6], [9, 10]]
    assert m[..., [4]].tolist() == [[0], [4], [8]]
    assert cupy.take_along_axis(m, cupy.array([[4], [-1], [9]]), 1).tolist() == [[0], [7], [9]]
    with pytest.raises(IndexError):
        a[11]  # an integer scalar is not an array: numpy's IndexError
    b = cupy.zeros(4)
    b[cupy.array([5, -6])] = cupy.array([1.0, 2.0])
    assert b.tolist() == [0.0, 1.0, 2.0, 0.0]
    b = cupy.zeros(4)
    cupy.add.at(b, cupy.array([5, -1]), 1.0)
    b.scatter_add(cupy.array([6]), 1.0)
    assert b.tolist() == [0.0, 1.0, 1.0, 1.0]
    p = cupy.zeros(4)
    p.put([5], 7.0)  # ndarray.put and cupy.put: mode='wrap' by default (core.pyx)
    cupy.put(p, [-5], 8.0)
    assert p.tolist() == [0.0, 7.0, 0.0, 8.0]
    with pytest.raises(IndexError):
        p.put([5], 1.0, mode="raise")


def test_cupy_indices_integer_array_wrap():
    # core_tests/test_ndarray_adv_indexing.py TestArrayAdvancedIndexingGetitemCupyIndices
    # test_adv_getitem_cupy_indices4/5, TestArrayAdvancedIndexingSetitemCupyIndices
    # test_cupy_indices_integer_array_2/3 (with numbered data, not zeros)
    a = cupy.arange(24.0).reshape(2, 3, 4)
    index = cupy.array([4, -5])
    original_index = index.copy()
    np.testing.assert_array_equal(a[index].get(), a.get()[index.get() % 2])
    np.testing.assert_array_equal(a[[1, 0], index].get(), a.get()[[1, 0], index.get() % 3])
    assert index.tolist() == original_index.tolist()
    a = cupy.zeros((2, 3))
    index = cupy.array([3, -5])
    a[:, index] = cupy.array(1.)
    assert a.tolist() == [[1., 1., 0.], [1., 1., 0.]]
    a = cupy.zeros((2, 3))
    a[[1, 1], index] = cupy.array(1.)
    assert a.tolist() == [[0., 0., 0.], [1., 1., 0.]]
    assert index.tolist() == [3, -5]


def test_float_to_integer_casts_saturate():
    # difference.rst, "Cast behavior from float to integer" (its two examples), and PTX's
    # cvt: "For float-to-integer conversions, the result is clamped to the destination
    # range by default"; NaN gives 0
    assert cupy.array([-1], dtype=np.float32).astype(np.uint32).tolist() == [0]
    assert cupy.array([float("inf")], dtype=np.float32).astype(np.int32).tolist() == [2147483647]
    values = cupy.array([-1.0, np.inf, -np.inf, np.nan, 3.7, -3.7, 1e10, -300.0])
    assert values.astype(cupy.int32).tolist() == [-1, 2147483647, -2147483648, 0, 3, -3,
                                                  2147483647, -300]
    assert values.astype(cupy.uint8).tolist() == [0, 255, 0, 0, 3, 0, 255, 0]
    assert values.astype(cupy.int8).tolist() == [-1, 127, -128, 0, 3, -3, 127, -128]
    big = cupy.array([2.0 ** 63, -2.0 ** 64, 2.0 ** 63 - 1024, 2.0 ** 64])
    assert big.astype(cupy.int64).tolist() == [2 ** 63 - 1, -2 ** 63, 2 ** 63 - 1024,
                                               2 ** 63 - 1]
    assert big.astype(cupy.uint64).tolist() == [2 ** 63, 0, 2 ** 63 - 1024, 2 ** 64 - 1]
    assert cupy.asarray(cupy.array([-5.5]), dtype=cupy.uint16).tolist() == [0]
    ints = cupy.zeros(3, cupy.int32)
    ints[...] = cupy.array([1e20, -1e20, np.nan])  # a device array stored: converted so
    assert ints.tolist() == [2147483647, -2147483648, 0]
    cupy.multiply(cupy.array([1e10, -1e10, np.nan]), 1.0, out=ints, casting="unsafe")
    assert ints.tolist() == [2147483647, -2147483648, 0]
    fortran = cupy.asfortranarray(cupy.arange(6.0).reshape(2, 3) - 3)
    converted = fortran.astype(cupy.uint32)
    assert converted.flags.f_contiguous and converted.tolist() == [[0, 0, 0], [0, 1, 2]]


def test_ufuncs_refuse_lists():
    # difference.rst, "Universal Functions only work with CuPy array or scalar": "They do
    # not accept other objects (e.g., lists or numpy.ndarray)"; cupy/_core/_scalar.pyx
    # CScalar: TypeError(f'Unsupported type {type(value)}')
    with pytest.raises(TypeError, match="Unsupported type <class 'list'>"):
        cupy.power([cupy.arange(5)], 2)  # (the doc's example)
    with pytest.raises(TypeError, match="Unsupported type <class 'list'>"):
        cupy.add(cupy.arange(3), [1, 2, 3])
    with pytest.raises(TypeError, match="Unsupported type <class 'list'>"):
        cupy.arange(3) * [1, 2, 3]
    with pytest.raises(TypeError, match="Unsupported type <class 'tuple'>"):
        cupy.sqrt((1.0, 4.0))
    with pytest.raises(TypeError, match="Unsupported type <class 'list'>"):
        cupy.fix([1.5])  # a ufunc in CuPy, a function in numpy
    with pytest.raises(TypeError, match="Unsupported type <class 'numpy.ndarray'>"):
        cupy.add(cupy.arange(3), np.arange(3))
    assert cupy.add(cupy.arange(3), 1).tolist() == [1, 2, 3]  # Python and numpy scalars
    assert cupy.add(cupy.arange(3), np.float32(2)).tolist() == [2.0, 3.0, 4.0]
    assert cupy.fix(cupy.array([1.5, -1.5])).tolist() == [1.0, -1.0]
    # user kernels take their arguments the same way (cupy/_core/_kernel.pyx
    # ElementwiseKernel.__call__ and cupy/_core/_reduction.pyx: _preprocess_args)
    add = cupy.ElementwiseKernel("T x, T y", "T z", "z = x + y", "add_lists")
    with pytest.raises(TypeError, match="Unsupported type <class 'list'>"):
        add(cupy.arange(3.0), [1.0, 2.0, 3.0])
    total = cupy.ReductionKernel("T x", "T y", "x", "a + b", "y = a", "0", "sum_lists")
    with pytest.raises(TypeError, match="Unsupported type <class 'list'>"):
        total([1.0, 2.0])
    assert add(cupy.arange(3.0), 2.0).tolist() == [2.0, 3.0, 4.0]
    assert float(total(cupy.arange(4.0))) == 6.0


# ============================================================ NCCL (test_nccl.py)

# (each as in a fresh process: what this process's NCCL reads of its variables at a first
# communicator is kept for the process, and a later group's rank 0 would run with it)
_fresh_nccl = pytest.mark.usefixtures("two_sim_devices_nccl_afresh")


@_fresh_nccl
def test_nccl_single_proc_ring():
    # cuda_tests/test_nccl.py TestNCCL.test_single_proc_ring
    id = nccl.get_unique_id()
    comm = nccl.NcclCommunicator(1, id, 0)
    assert 0 == comm.rank_id()
    comm.destroy()


@_fresh_nccl
def test_nccl_abort():
    # cuda_tests/test_nccl.py TestNCCL.test_abort
    id = nccl.get_unique_id()
    comm = nccl.NcclCommunicator(1, id, 0)
    comm.abort()


@_fresh_nccl
def test_nccl_check_async_error():
    # cuda_tests/test_nccl.py TestNCCL.test_check_async_error
    id = nccl.get_unique_id()
    comm = nccl.NcclCommunicator(1, id, 0)
    comm.check_async_error()
    comm.destroy()


@_fresh_nccl
def test_nccl_comm_size():
    # cuda_tests/test_nccl.py TestNCCL.test_comm_size
    id = nccl.get_unique_id()
    comm = nccl.NcclCommunicator(1, id, 0)
    assert 1 == comm.size()
    comm.destroy()  # CuPy's __dealloc__ does it there


@_fresh_nccl
def test_nccl_comm_bad_id():
    # cuda_tests/test_nccl.py TestNCCL.test_comm_bad_id
    with pytest.raises(TypeError):
        nccl.NcclCommunicator(1, None, 0)

    with pytest.raises(TypeError):
        nccl.NcclCommunicator(1, (1, 2, 3), 0)

    with pytest.raises(ValueError, match="commId length 10 != 128."):
        nccl.NcclCommunicator(1, b"1234567890", 0)


@_fresh_nccl
def test_nccl_exception_picklable():
    # cuda_tests/test_nccl.py TestExceptionPicklable.test
    e1 = nccl.NcclError(1)
    e2 = pickle.loads(pickle.dumps(e1))
    assert e1.args == e2.args
    assert str(e1) == str(e2)


@pytest.mark.parametrize("status", [7, 8])
@_fresh_nccl
def test_nccl_error_unknown_status(status):
    # cupy_backends/cuda/libs/nccl.pyx NcclError.__init__: ERROR2[status] has codes 0-6 only
    with pytest.raises(KeyError):
        nccl.NcclError(status)


@_fresh_nccl
def test_nccl_empty_all_reduce():
    # NCCL discards empty collectives: count 0 with null buffers is legal
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    try:
        comm.allReduce(0, 0, 0, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, cuda.Stream.null.ptr)
        cuda.Stream.null.synchronize()
        comm.check_async_error()
    finally:
        comm.destroy()


@pytest.mark.parametrize("close", ["abort", "destroy"])
@_fresh_nccl
def test_nccl_closed_comm_raises(close):
    # cupy_backends/cuda/libs/nccl.pyx destroy()/abort() set _comm to NULL; then
    # ncclCommGetAsyncError(NULL) and ncclCommUserRank(NULL) give ncclInvalidArgument (4)
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    getattr(comm, close)()
    with pytest.raises(nccl.NcclError) as err:
        comm.check_async_error()
    assert err.value.status == 4
    with pytest.raises(nccl.NcclError) as err:
        comm.rank_id()
    assert err.value.status == 4
