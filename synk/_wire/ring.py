"""Small messages between two processes through shared memory: a pair of single-producer,
single-consumer rings (``Lane``), one per direction, in one segment; no system call is made on
either side, and a message costs two copies and two 8-byte stores::

    writer   copies a record (header: length, kind; payload) into free space, stores head
    reader   polls head, copies the record out, stores tail
"""
from __future__ import annotations

import platform
import struct
import threading
import zlib

from . import shm as _shm

DATA, SOCKET, WRAP = 1, 2, 3  # record kinds: a message; "the next message is on the socket"
_HEAD_AT, _TAIL_AT, _SLEEP_AT = 0, 64, 128  # byte offsets of the counters in a lane
_DATA_AT = 192  # the ring's bytes start here
_HEAD_AT_W, _TAIL_AT_W = _HEAD_AT // 8, _TAIL_AT // 8  # as indices of 8-byte words
_REC = struct.Struct("<II")  # record header: payload length, kind
_CHECK = struct.Struct("<IIQ")  # checked lanes: CRC-32, padding, sequence number
# x86-64's total store order: the payload's stores become visible before the ``head`` store
# that follows them, and a reader's loads are not reordered with each other, so a reader that
# sees a new ``head`` sees the whole record; the reader stores ``tail`` only after its copy,
# and a store is never moved before an earlier load, so the writer never overwrites a record
# being read. Elsewhere lanes are ``checked`` (``Lane._valid``).
ORDERED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
# seconds a sleeping reader waits before looking again: where the fence of ``set_sleeping``
# is not enough (weaker machines), a lost wake-up costs at most this, never a hang
SLEEP_SLICE = 0.05 if ORDERED else 0.005

CONTROL_RING = 256 << 10  # bytes per direction of a worker's control ring
MESH_RING = 128 << 10  # the least bytes per direction of a synk.comm ring between two ranks
# The most, for the small groups whose rings then stay within _MESH_RINGS_BUDGET bytes in all
# (1 MiB on 2 ranks, 512 KiB on 3; the least from 5 ranks, as before): the larger the ring,
# the larger the messages that take it rather than a shared-memory segment of their own
# (``shm_mesh``), which for 64 KiB to 128 KiB costs twice what the ring does. Every segment's memory
# is reserved, and Docker's /dev/shm is 64 MiB: the budget is small.
_MESH_RING_MOST = 1 << 20
_MESH_RINGS_BUDGET = 4 << 20


def mesh_ring_bytes(size: int) -> int:
    """Bytes per direction of the synk.comm ring between two ranks of a group of ``size``:
    a power of two from ``MESH_RING`` to 1 MiB, so that all the group's rings stay within
    4 MiB where they can."""
    capacity = _MESH_RING_MOST
    while capacity > MESH_RING and size * (size - 1) * capacity > _MESH_RINGS_BUDGET:
        capacity //= 2
    return capacity

_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier: a Python lock taken and given back (a locked instruction on
    x86, which orders every earlier load and store before every later one)."""
    _fence_lock.acquire()
    _fence_lock.release()




class Lane:
    """One direction of a ring: ``capacity`` bytes (a multiple of 8) at ``offset`` of ``buf``. The
    writer uses ``put`` and ``reader_sleeping``, the reader ``get``, ``pending`` and
    ``set_sleeping``; each side one thread at a time. Two counters, each written by one side:
    ``head`` (published) and ``tail`` (consumed; the writer rereads it only when short of room). A
    record (8-byte header, payload padded to 8) never straddles the end: a ``WRAP`` record fills the
    rest. The counters sit on their own 64-byte lines, through a ``memoryview`` cast to ``Q``: one
    aligned 8-byte move in CPython, so never seen half-written."""

    def __init__(self, buf: memoryview, offset: int, capacity: int, checked: bool) -> None:
        self.at = offset  # (where it starts in ``buf``: csrc/jax_ffi.cc reads and writes
        # unchecked lanes too, as this class does)
        self._words = buf[offset:offset + _DATA_AT].cast("Q")
        self._data = buf[offset + _DATA_AT:offset + _DATA_AT + capacity]
        self.capacity = capacity
        self.checked = checked
        self._extra = _CHECK.size if checked else 0
        # records start at multiples of this, so a wrap record's header always fits
        self._grain = 32 if checked else 8
        # the largest payload one record may carry: the rest of the space stays for a wrap
        self.max_payload = capacity // 2 - _REC.size - self._extra
        self._head = self._words[_HEAD_AT // 8]  # the writer's copy of what it published
        # the reader's tail as the writer last read it: room is only looked at again when
        # this says there is too little (one cache line fewer to fetch per message)
        self._seen = self._words[_TAIL_AT // 8]
        self._tail = self._words[_TAIL_AT // 8]  # the reader's copy of what it consumed
        self._sent = 0  # records written (checked lanes number them)
        self._got = 0  # records read

    def _size(self, n: int) -> int:
        """Bytes a record with an ``n``-byte payload takes in the ring."""
        g = self._grain
        return (_REC.size + self._extra + n + g - 1) // g * g

    # -- writer -------------------------------------------------------------------------
    def put(self, parts, kind: int = DATA) -> bool:
        """Publish one record whose payload is ``parts`` (bytes-likes of unsigned bytes,
        joined; at most ``max_payload`` bytes in all); False (nothing written) when the
        ring has no room for it now."""
        if self.checked:
            return self._put(parts, kind)
        n = 0
        for part in parts:
            n += len(part)
        need = (15 + n) & ~7  # (the header, the payload, padded to 8 bytes)
        head = self._head
        cap = self.capacity
        pos = head % cap
        if need > cap - pos or cap - (head - self._seen) < need:
            return self._put(parts, kind)  # a wrap first, or room to check again
        data = self._data
        at = pos + 8
        for part in parts:
            end = at + len(part)
            data[at:end] = part
            at = end
        _REC.pack_into(data, pos, n, kind)
        self._head = head = head + need
        self._words[_HEAD_AT_W] = head  # publish
        return True

    def _put(self, parts, kind: int) -> bool:
        n = sum(map(len, parts))
        need = self._size(n)
        cap = self.capacity
        head = self._head
        pos = head % cap
        wrap = cap - pos if need > cap - pos else 0
        self._seen = self._words[_TAIL_AT_W]
        if cap - (head - self._seen) < wrap + need:
            return False
        data = self._data
        if wrap:
            self._write_header(pos, 0, WRAP)
            head += wrap
            pos = 0
        start = at = pos + _REC.size + self._extra
        for part in parts:
            data[at:at + len(part)] = part
            at += len(part)
        self._write_header(pos, n, kind, data[start:start + n] if self.checked else None)
        self._head = head + need
        self._words[_HEAD_AT // 8] = self._head  # publish
        return True

    def _write_header(self, pos: int, n: int, kind: int, payload=None) -> None:
        if self.checked:
            seq = self._sent
            self._sent += 1
            crc = zlib.crc32(payload if payload is not None else b"",
                             zlib.crc32(struct.pack("<IIQ", n, kind, seq)))
            _CHECK.pack_into(self._data, pos + _REC.size, crc, 0, seq)
        _REC.pack_into(self._data, pos, n, kind)

    def reader_sleeping(self) -> bool:
        """After a ``put``: whether the reader may be asleep and needs a wake-up (issues the
        fence that pairs with the reader's in ``set_sleeping``)."""
        fence()
        return bool(self._words[_SLEEP_AT // 8])

    # -- reader -------------------------------------------------------------------------
    def pending(self) -> bool:
        """Whether a record has been published and not yet read (one 8-byte load)."""
        return self._words[_HEAD_AT_W] != self._tail

    def get(self):
        """The next record as ``(kind, bytearray)``, or None when there is none (yet)."""
        tail = self._tail
        if self._words[_HEAD_AT_W] == tail:
            return None
        data = self._data
        if not self.checked:
            pos = tail % self.capacity
            n, kind = _REC.unpack_from(data, pos)
            if kind != WRAP:
                payload = bytearray(data[pos + 8:pos + 8 + n])  # (writable, as arrays over it)
                self._tail = tail = tail + ((15 + n) & ~7)
                self._words[_TAIL_AT_W] = tail  # hand the space back
                return kind, payload
        cap, got = self.capacity, self._got
        while True:
            pos = tail % cap
            n, kind = _REC.unpack_from(data, pos)
            if self.checked and not self._valid(pos, n, kind, got):
                return None  # not all of it has arrived yet: look again later
            if kind != WRAP:
                break
            tail += cap - pos
            got += 1
        start = pos + _REC.size + self._extra
        payload = bytearray(data[start:start + n])
        self._tail = tail + self._size(n)
        self._got = got + 1
        self._words[_TAIL_AT // 8] = self._tail  # hand the space back
        return kind, payload

    def _valid(self, pos: int, n: int, kind: int, got: int) -> bool:
        """Whether a checked lane's record at ``pos`` has arrived whole. On weakly ordered machines
        (aarch64) each record carries a CRC-32 of its header, sequence number and payload; the
        reader rereads until it holds. Its ``tail`` store depends on the check (a control
        dependency orders it after the loads on ARMv8), as the writer's payload stores depend on
        its ``tail`` check."""
        if n > self.max_payload or kind not in (DATA, SOCKET, WRAP):
            return False
        crc, _, seq = _CHECK.unpack_from(self._data, pos + _REC.size)
        start = pos + _REC.size + _CHECK.size
        body = self._data[start:start + n] if kind != WRAP else b""
        return seq == got and crc == zlib.crc32(
            body, zlib.crc32(struct.pack("<IIQ", n, kind, seq)))

    def set_sleeping(self, sleeping: bool) -> None:
        """Say whether this reader is about to block on its socket. Setting it issues the
        fence that pairs with the writer's: look at ``pending()`` once more after it. A
        writer stores ``head``, issues a full fence, and sends a wake-up on the socket only
        when it sees ``sleeping`` set (``reader_sleeping``)."""
        self._words[_SLEEP_AT // 8] = int(sleeping)
        if sleeping:
            fence()

    def release(self) -> None:
        """Let go of the views of the segment (before it is unmapped)."""
        self._words.release()
        self._data.release()


class Ring:
    """Two lanes in one segment: ``out`` is written by this side, ``inbox`` read by it.
    Side 0 (the creator) writes lane 0 and reads lane 1; side 1 the reverse."""

    def __init__(self, shm, side: int, capacity: int, checked: bool) -> None:
        self._shm = shm
        lane_bytes = _DATA_AT + capacity
        self._buf = memoryview(shm.buf)
        lanes = [Lane(self._buf, i * lane_bytes, capacity, checked) for i in (0, 1)]
        self.out, self.inbox = lanes[side], lanes[1 - side]

    def close(self) -> None:
        """Unmap the segment (its creator removes its name)."""
        if self._shm is None:
            return
        self.out.release()
        self.inbox.release()
        self._buf.release()
        shm, self._shm = self._shm, None
        _shm.release(shm)


def create(prefix: str, tag: str, capacity: int) -> str:
    """Make a ring segment under ``prefix`` (zeroed: both lanes empty); returns its name.
    The creator keeps no mapping: both sides ``attach``."""
    shm = _shm.create(f"{prefix}{tag}", 2 * (_DATA_AT + capacity), "a synk message ring")
    name = shm.name
    _shm.release(shm)
    return name


def attach(name: str, side: int, capacity: int, checked: bool | None = None) -> Ring:
    """Map ring ``name`` as ``side`` (0 or 1). ``checked``: CRC-check every record (default:
    off on x86, whose store order makes it unneeded; on elsewhere)."""
    checked = (not ORDERED) if checked is None else checked
    return Ring(_shm.attach(name), side, capacity, checked)
