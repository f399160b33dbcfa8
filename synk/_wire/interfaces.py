"""This machine's network interfaces and their IPv4 addresses (Linux ioctls, best effort)."""
from __future__ import annotations

import fcntl
import socket
import struct

from .. import _settings

_SIOCGIFFLAGS, _SIOCGIFADDR = 0x8913, 0x8915
_IFF_RUNNING = 0x40


def interface_addresses() -> list[tuple[str, str, bool]]:
    """(name, IPv4 address, running) of each interface that has an IPv4 address, in the
    system's order of interfaces."""
    found: list[tuple[str, str, bool]] = []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return found
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            req = struct.pack("256s", name[:15].encode())
            try:
                address = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:
                continue
            try:
                flags = struct.unpack_from("H", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req), 16)[0]
            except OSError:
                flags = _IFF_RUNNING
            found.append((name, address, bool(flags & _IFF_RUNNING)))
    return found


def tune(sock: socket.socket) -> None:
    """No Nagle delay (control messages are small), and a peer that vanished (no FIN, no RST) fails
    the connection within ``SYNK_PEER_TIMEOUT`` s: keepalive probes every second while idle; with
    data unacknowledged (else retransmitted for about 15 minutes), ``TCP_USER_TIMEOUT`` (Linux)."""
    seconds = _settings.peer_timeout()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in ((socket.TCP_KEEPIDLE, 1), (socket.TCP_KEEPINTVL, 1),
                       (socket.TCP_KEEPCNT, max(1, seconds - 1)),
                       (socket.TCP_USER_TIMEOUT, seconds * 1000)):
        sock.setsockopt(socket.IPPROTO_TCP, opt, value)
