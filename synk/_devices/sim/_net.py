"""How the simulated NCCL's ranks meet when they share no ``/dev/shm``: over TCP, as NCCL's
bootstrap and socket transport do (github.com/NVIDIA/nccl, tag v2.30.7-1)::

    get_unique_id: the id carries the address of a root (new_id_tail, Root)
    each rank --HELLO: where it listens--> root --TABLE: every rank's address--> each rank
    each pair of ranks: one connection (mesh), the communicator's words on it (_netboard)
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING

from ... import _settings
from ..._wire.interfaces import interface_addresses, tune
from . import _nccl_rules as rules
from ._errors import SimulatedHang, nccl_error, ncclInvalidUsage, ncclRemoteError

if TYPE_CHECKING:
    from ._board import Board

# The 128-byte id: b"SYNKSIM1", the segment prefix (NUL-padded to byte 112), then the
# root's IPv4 address and port, the maker's /dev/shm identity and random bytes.
ADDRESS_AT, SHM_AT, RANDOM_AT = 112, 118, 122
NO_ROOT = b"\0" * 6

# frames: kind (1 byte), 3 spare, a number (int32), the payload's length (uint64)
HEAD = struct.Struct("<BxxxiQ")
HELLO, TABLE, REFUSE, DONE, PEER = 1, 2, 3, 4, 5
_TOKEN = 16
_ENTRY = struct.Struct("<4sHxxq")  # a rank in the table: address, port, its host


# ---------------------------------------------------------------- where this process is

_identity: list = []


def shm_identity() -> bytes:
    """4 bytes telling apart the places whose processes share one ``/dev/shm`` and one pid
    namespace (the shared-memory board's liveness checks read process ids): the machine's
    boot, the tmpfs mounted there and the pid namespace."""
    if not _identity:
        parts = []
        with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        for path in ("/dev/shm", "/proc/self/ns/pid"):
            try:
                st = os.stat(path)
                parts.append(f"{st.st_dev}:{st.st_ino}")
            except OSError:
                parts.append("?")
        _identity.append(hashlib.sha1("|".join(parts).encode()).digest()[:4])
    return _identity[0]


_interface: list = []


def _matches(name: str, spec: str) -> bool:
    """NCCL's prefix list (``matchIfList`` in src/misc/utils.cc, ``^`` and ``=`` as in
    ``ncclOsFindInterfaces``)."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    prefixes = [p.split(":")[0] for p in spec.split(",") if p.split(":")[0]]
    hit = not prefixes or any(name == p if exact else name.startswith(p) for p in prefixes)
    return hit != exclude


def bootstrap_interface() -> tuple[str, str]:
    """(name, IPv4 address) of the interface NCCL would bootstrap on, chosen once per process as
    by ``ncclFindInterfaces`` (src/misc/socket.cc lines 190-232; src/os/linux.cc
    ``ncclOsFindInterfaces``: running ones only): ``NCCL_SOCKET_IFNAME``'s prefixes (``^``
    excludes, ``=`` matches exactly), else ``ib``, else any but ``docker``/``lo``/``virbr``,
    else those in that order; none is ncclInvalidUsage, "Bootstrap : no socket interface
    found" (src/bootstrap.cc line 126). IPv4 only."""
    if not _interface:
        running = [(name, address) for name, address, up in interface_addresses() if up]
        spec = os.environ.get("NCCL_SOCKET_IFNAME", "")
        orders = [spec] if len(spec) > 1 else ["ib", "^docker,lo,virbr", "docker", "lo", "virbr"]
        for order in orders:
            found = [pair for pair in running if _matches(pair[0], order)]
            if found:
                _interface.append(found[0])
                break
        else:
            chosen = f" matching NCCL_SOCKET_IFNAME={spec!r}" if len(spec) > 1 else ""
            raise nccl_error(ncclInvalidUsage, f"Bootstrap : no socket interface found{chosen} "
                             f"(running IPv4 interfaces: {running})")
    return _interface[0]


def forget_interface() -> None:
    """Forget the chosen interface (tests standing in for a fresh process)."""
    _interface.clear()


# ---------------------------------------------------------------- the id

def id_fields(comm_id: bytes) -> tuple[str, int, bytes, bytes]:
    """(root address, root port, maker's shm identity, token) of a simulator's id."""
    address = comm_id[ADDRESS_AT:ADDRESS_AT + 6]
    host, port = socket.inet_ntoa(address[:4]), struct.unpack(">H", address[4:])[0]
    return host, port, comm_id[SHM_AT:SHM_AT + 4], token(comm_id)


def token(comm_id: bytes) -> bytes:
    """What a connection shows to prove it belongs to the communicator of ``comm_id``."""
    return hashlib.sha256(b"synk-sim-nccl" + comm_id).digest()[:_TOKEN]


def on_this_board(comm_id: bytes, params: dict) -> bool:
    """Whether this process meets its peers on the shared-memory board, which stands for NCCL's
    transports within a node (P2P, SHM): it shares the id maker's /dev/shm, and NCCL_P2P_DISABLE
    and NCCL_SHM_DISABLE are not both 1 ("NCCL will use the network ... when SHM is disabled",
    docs env.rst lines 797-855). A rank off the board calls the root, which then moves the whole
    communicator to TCP (``Root``)."""
    if params.get("NCCL_P2P_DISABLE") == 1 and params.get("NCCL_SHM_DISABLE") == 1:
        return False
    return comm_id[SHM_AT:SHM_AT + 4] == shm_identity()


# ---------------------------------------------------------------- frames

def send(sock: socket.socket, kind: int, number: int, payload=b"") -> None:
    """One frame (``payload``: bytes or a buffer)."""
    head = HEAD.pack(kind, number, len(payload))
    if len(payload) < 65536:
        sock.sendall(head + bytes(payload))
    else:
        sock.sendall(head)
        sock.sendall(payload)


def receive(sock: socket.socket, deadline: float, limit: int = 1 << 20) -> tuple[int, int, bytes]:
    """The next frame (kind, number, payload), by ``deadline``; ConnectionError on EOF or
    a frame longer than ``limit``."""
    kind, number, size = HEAD.unpack(_exactly(sock, HEAD.size, deadline))
    if size > limit:
        raise ConnectionError(f"a frame of {size} bytes")
    return kind, number, _exactly(sock, size, deadline)


def _exactly(sock: socket.socket, size: int, deadline: float) -> bytes:
    chunks, left = [], size
    while left:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except TimeoutError:
            raise TimeoutError("no answer by the deadline") from None
        if not chunk:
            raise ConnectionError("the connection was closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def listener(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((address, 0))
    sock.listen(128)
    return sock


# ---------------------------------------------------------------- the root

_ROOTS: dict = {}  # prefix -> Root of an id this process made


def new_id_tail(prefix: str) -> tuple[bytes, Root | None]:
    """The 16 bytes after the prefix: the address of a root started for ``prefix``, this
    process's /dev/shm identity, randomness; no root where no socket can listen (a sandbox: the
    ranks meet on the board only). NCCL puts the bootstrap interface's address in the id and
    starts a root there per id (src/bootstrap.cc ``bootstrapGetUniqueId``, lines 430-460;
    ``bootstrapCreateRoot``, lines 405-428)."""
    _, address = bootstrap_interface()
    root: Root | None
    try:
        root = Root(prefix, listener(address))
    except OSError:
        root, where = None, NO_ROOT
    else:
        host, port = root.sock.getsockname()
        where = socket.inet_aton(host) + struct.pack(">H", port)
    return where + shm_identity() + secrets.token_bytes(6), root


class Root:
    """The bootstrap root of one id (NCCL's ``bootstrapRoot`` thread): gathers the ranks
    that call it, marks the shared-memory board so that the ranks waiting there call it too,
    sends every rank the table once all have, and ends. It ends as well when the ranks met
    on the board (rank 0 says so), when the board went without a call, or after the hang
    timeout with nothing to do. NCCL's root accepts one connection per rank, then answers;
    a rank that checks in twice is refused, "rank %d of %d ranks has already checked in"
    (src/bootstrap.cc ``bootstrapRoot``, lines 288-403)."""

    def __init__(self, prefix: str, sock: socket.socket) -> None:
        self.prefix, self.sock = prefix, sock
        self.token = b""  # the id's, set by start() before the thread runs
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = threading.Event()
        self._callers: dict = {}  # rank -> (socket, table entry)
        self._nranks = 0
        self._board: Board | None = None
        self._thread = threading.Thread(target=self._run, name="synk-sim-nccl-root",
                                        daemon=True)

    def start(self, comm_id: bytes) -> None:
        self.token = token(comm_id)
        _ROOTS[self.prefix] = self
        self._thread.start()

    def finish(self) -> None:
        """End the root (the ranks met on the board, or this process gave up)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(5)

    # -- its thread
    def _run(self) -> None:
        idle_until = time.monotonic() + _settings.sim_hang_timeout()
        selector = selectors.DefaultSelector()
        selector.register(self.sock, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        board_seen = False
        try:
            while not self._stop.is_set():
                if selector.select(0.01) and not self._stop.is_set():
                    with contextlib.suppress(OSError):
                        conn, _ = self.sock.accept()
                        if self._caller(conn):
                            return
                        idle_until = time.monotonic() + _settings.sim_hang_timeout()
                exists = os.path.exists(f"/dev/shm/{self.prefix}board")
                if exists:
                    board_seen = True
                elif board_seen and not self._callers:
                    return  # the ranks met on the board (or gave up there)
                if time.monotonic() > idle_until:
                    self._refuse_all("the bootstrap root heard from no rank for "
                                     f"{_settings.sim_hang_timeout():g} s (SYNK_SIM_HANG_TIMEOUT)")
                    return
            self._refuse_all("the process that made the unique id gave up its communicator")
        finally:
            selector.close()
            self.sock.close()
            self._wake_r.close()
            self._wake_w.close()
            if self._board is not None:
                self._board.unlink()
                self._board.close()
            if _ROOTS.get(self.prefix) is self:
                del _ROOTS[self.prefix]

    def _caller(self, conn: socket.socket) -> bool:
        """Read one caller's first frame; True once the root's work is done."""
        try:
            tune(conn)
            kind, number, payload = receive(conn, time.monotonic() + 5.0)
            if len(payload) < _TOKEN or not hmac.compare_digest(payload[:_TOKEN], self.token):
                conn.close()
                return False
        except (OSError, ConnectionError, TimeoutError):
            conn.close()
            return False
        if kind == DONE:
            conn.close()
            return True
        if kind != HELLO:
            conn.close()
            return False
        nranks = struct.unpack_from("<i", payload, _TOKEN)[0]
        entry = payload[_TOKEN + 4:]
        if self._nranks and nranks != self._nranks:
            self._refuse(conn, f"rank {number} was told the communicator has {nranks} ranks, "
                               f"another rank {self._nranks}")
            return False
        if number in self._callers or not 0 <= number < nranks:
            self._refuse(conn, f"Bootstrap Root : rank {number} of {nranks} ranks has already "
                               "checked in" if number in self._callers else
                               f"rank {number} of a {nranks}-rank communicator")
            return False
        self._nranks = nranks
        self._callers[number] = (conn, entry)
        self._mark_board(nranks)
        if len(self._callers) < nranks:
            return False
        table = b"".join(self._callers[r][1] for r in range(nranks))
        for caller, _ in self._callers.values():
            with contextlib.suppress(OSError):
                send(caller, TABLE, nranks, table)
            caller.close()
        self._callers.clear()
        return True

    def _mark_board(self, nranks: int) -> None:
        """Make the ranks waiting on the shared-memory board call the root too."""
        if self._board is not None:
            return
        from ._board import Board

        try:
            self._board = Board(self.prefix, nranks, time.monotonic() + 5.0)
        except Exception:  # a board of another size: the ranks will say so
            return
        self._board.mark_network()

    def _refuse(self, conn: socket.socket, why: str) -> None:
        with contextlib.suppress(OSError):
            send(conn, REFUSE, 0, why.encode())
        conn.close()

    def _refuse_all(self, why: str) -> None:
        for conn, _ in self._callers.values():
            self._refuse(conn, why)
        self._callers.clear()


def shm_met(comm_id: bytes, prefix: str) -> None:
    """Rank 0 tells the id's root that the ranks met on the shared-memory board, so that
    it ends (best effort: a root that is gone has nothing to end)."""
    root = _ROOTS.get(prefix)
    if root is not None:
        root.finish()
        return
    host, port, _, tok = id_fields(comm_id)
    if port == 0:
        return
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1.0) as s:
        send(s, DONE, 0, tok)


def give_up(prefix: str) -> None:
    """This process's root of ``prefix`` (if any) stops: its communicator failed here."""
    root = _ROOTS.get(prefix)
    if root is not None:
        root.finish()


# ---------------------------------------------------------------- a rank's side

def mesh(comm_id: bytes, nranks: int, rank: int, deadline: float) -> dict:
    """This rank's TCP connection to every other rank, by ``deadline``: it tells the root
    where it listens, gets the table, connects to the ranks below it and accepts the ranks
    above it. Each pair of ranks connects once, as NCCL's socket transport connects per
    peer (src/transport/net_socket.cc ``ncclNetSocketConnect``/``Accept``); every
    connection opens with a proof of the id (``token``), as NCCL's sockets open with the
    id's magic and drop a mismatch (src/misc/socket.cc lines 328-365)."""
    root_host, root_port, _, tok = id_fields(comm_id)
    _, address = bootstrap_interface()
    own = listener(address)
    try:
        table = _call_root(root_host, root_port, tok, nranks, rank, own, deadline)
        peers: dict = {}
        try:
            for peer in range(rank):
                host, port = table[peer]
                sock = _connect(host, port, deadline, rank, f"rank {peer}")
                send(sock, PEER, rank, tok)
                peers[peer] = sock
            while len(peers) < nranks - 1:
                peer, sock = _accept(own, tok, deadline, rank, nranks, peers)
                peers[peer] = sock
        except BaseException:
            for sock in peers.values():
                sock.close()
            raise
        return peers
    finally:
        own.close()


def _call_root(host: str, port: int, tok: bytes, nranks: int, rank: int, own: socket.socket,
               deadline: float) -> list:
    if port == 0:
        raise nccl_error(ncclRemoteError, _unreachable(rank, host, port, "the process that "
                         "made the unique id could not listen for other hosts"))
    sock = _connect(host, port, deadline, rank, "the bootstrap root")
    try:
        mine_host, mine_port = own.getsockname()
        entry = _ENTRY.pack(socket.inet_aton(mine_host), mine_port, rules.host_hash())
        send(sock, HELLO, rank, tok + struct.pack("<i", nranks) + entry)
        try:
            kind, number, payload = receive(sock, deadline)
        except TimeoutError:
            raise SimulatedHang(
                f"NcclCommunicator() would hang forever on a GPU: rank {rank} told the "
                f"communicator's bootstrap root at {host}:{port} where it is, and not every "
                f"rank of {nranks} has (after {_settings.sim_hang_timeout():g} s, "
                "SYNK_SIM_HANG_TIMEOUT). The root lives in the process that called "
                "get_unique_id(): it must be running, and every rank must be started") from None
        except ConnectionError as err:
            raise nccl_error(ncclRemoteError, f"rank {rank}: the bootstrap root at "
                             f"{host}:{port} went away ({err})") from None
    finally:
        sock.close()
    if kind == REFUSE:
        raise nccl_error(ncclInvalidUsage, f"rank {rank}: {payload.decode()}")
    if kind != TABLE or len(payload) != _ENTRY.size * nranks:
        raise nccl_error(ncclRemoteError, f"rank {rank}: a bad answer from the bootstrap root")
    table = []
    for r in range(nranks):
        address, port_r, _ = _ENTRY.unpack_from(payload, r * _ENTRY.size)
        table.append((socket.inet_ntoa(address), port_r))
    return table


def _connect(host: str, port: int, deadline: float, rank: int, what: str) -> socket.socket:
    """A connection to ``host:port``; a refusal is retried for a second, then it is
    ncclRemoteError: a rank that cannot reach the root's address is a layout the simulator
    cannot join. NCCL retries ``NCCL_SOCKET_RETRY_CNT`` (34) times, sleeping longer each
    time (about a minute), then fails with ncclRemoteError (src/os/linux.cc lines
    277-300)."""
    give_up = min(deadline, time.monotonic() + 1.0)
    while True:
        try:
            sock = socket.create_connection((host, port),
                                            timeout=max(0.1, deadline - time.monotonic()))
        except (ConnectionRefusedError, OSError) as err:
            if time.monotonic() < give_up and isinstance(err, ConnectionRefusedError):
                time.sleep(0.05)
                continue
            why = f"{type(err).__name__}: {err}"
            if what != "the bootstrap root":
                raise nccl_error(ncclRemoteError, f"rank {rank} cannot connect to {what} at "
                                 f"{host}:{port} ({why}): that rank died or its host cannot "
                                 "be reached") from None
            raise nccl_error(ncclRemoteError, _unreachable(rank, host, port, why)) from None
        tune(sock)
        return sock


def _unreachable(rank: int, host: str, port: int, why: str) -> str:
    name, _ = _interface[0] if _interface else ("?", "")
    chosen = os.environ.get("NCCL_SOCKET_IFNAME")
    how = (f"NCCL_SOCKET_IFNAME={chosen!r} here" if chosen
           else f"this host's bootstrap interface is {name}")
    return (f"rank {rank} on host {socket.gethostname()!r} cannot reach the bootstrap root "
            f"at {host}:{port} ({why}). That address comes from the unique id: the process "
            "that made it listens there, on the interface NCCL_SOCKET_IFNAME (or NCCL's "
            f"default order) chose on its host ({how}). Ranks that share no /dev/shm meet "
            "over TCP, as NCCL's socket transport does, so this layout cannot be simulated "
            "until the hosts can reach each other at that address: unset "
            "NCCL_SOCKET_IFNAME, or name an interface the hosts share (on a GPU, NCCL "
            "would retry for about a minute and fail with ncclRemoteError)")


def _accept(own: socket.socket, tok: bytes, deadline: float, rank: int, nranks: int,
            peers: dict) -> tuple[int, socket.socket]:
    while True:
        own.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock, _ = own.accept()
        except TimeoutError:
            missing = [r for r in range(nranks) if r != rank and r not in peers]
            raise SimulatedHang(
                f"NcclCommunicator() would hang forever on a GPU: ranks {missing} never "
                f"connected to rank {rank} (after {_settings.sim_hang_timeout():g} s, "
                "SYNK_SIM_HANG_TIMEOUT)") from None
        try:
            tune(sock)
            kind, peer, payload = receive(sock, min(deadline, time.monotonic() + 5.0))
        except (OSError, ConnectionError, TimeoutError):
            sock.close()
            continue
        if (kind != PEER or not hmac.compare_digest(payload, tok) or not rank < peer < nranks
                or peer in peers):
            sock.close()  # not one of this communicator's ranks (NCCL drops a bad magic)
            continue
        sock.settimeout(None)
        return peer, sock
