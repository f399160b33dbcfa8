"""The workers a launch started, as the group holds them: their processes (or, under MPI,
stand-ins for processes on other hosts), control channels, death descriptors and control
rings. The launch fills a ``Workers`` as it starts them; the group's messaging reads and
writes the channels, the watchdog watches the deaths, and the group stops them."""
from __future__ import annotations

import contextlib
import os
from typing import Any

from .channel import Channel


class Workers:
    """rank -> process, channel, death fd (a pidfd, None where unsupported) and ring."""

    def __init__(self) -> None:
        self.procs: dict[int, Any] = {}  # subprocess.Popen, or mpi_launch.RemoteRank
        self.channels: dict[int, Channel] = {}
        self.death_fds: dict[int, int | None] = {}
        self.rings: dict[int, Any] = {}  # rank -> its control ring.Ring (on this host)

    def add(self, rank: int, proc, channel: Channel, death_fd: int | None) -> None:
        """A worker started (or connected)."""
        self.procs[rank] = proc
        self.channels[rank] = channel
        self.death_fds[rank] = death_fd

    def use_ring(self, rank: int, ring) -> None:
        """Messages to and from ``rank`` go through ``ring`` from now on."""
        self.rings[rank] = ring
        self.channels[rank].use_ring(ring)

    def exited(self) -> str | None:
        """Why not every worker is running, or None: the first that exited."""
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                return f"rank {rank} exited"
        return None

    def kill(self) -> None:
        """SIGKILL every worker still running (the running call then sees the deaths)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()

    def reap(self) -> None:
        """Kill and wait for every worker, then close their channels, rings and deaths."""
        self.kill()
        for proc in self.procs.values():
            proc.wait()
        for channel in self.channels.values():
            channel.close()
        for ring in self.rings.values():
            ring.close()
        self.rings.clear()
        for fd in self.death_fds.values():
            if fd is not None:
                os.close(fd)
        self.death_fds.clear()
