"""Per-call profiling of a synk function (``Profile``): where each rank's time goes, in four
parts, and the bytes each rank copied between host and device.
"""
from __future__ import annotations

# The four parts of a rank's time, in order; docs/api/calls.md, "Profiling", says what each
# holds on the master and on a worker. The master's parts cover its whole call, so they add
# up to its wall time; a worker's add up to the time it was busy (the rest it was idle).
INPUT, COMPUTE, OUTPUT, COLLECTIVES = "input transfer", "compute", "output gathering", "collectives"
PARTS = (INPUT, COMPUTE, OUTPUT, COLLECTIVES)


class Profile:
    """Where the time of every call of one function went, per rank and part, in seconds.

    A ``Function`` built with ``profile=True`` keeps one in ``f.profile``; every successful
    call adds to it. ``print(f.profile)`` prints ``summary()``. The parts are described
    under [Profiling](api/calls.md#profiling).

    Attributes:
        name: the function's name.
        calls: the number of calls recorded.
        wall: the master's wall time over all calls, in seconds.
        counts: ``{(rank, part): calls that had that part}``.
        moved: ``{rank: {"h2d": bytes, "d2h": bytes, "net": bytes}}`` copied between host
            and device by each rank over all calls (GPU ranks), and, under MPI, the input
            rows the master sent over the network to the host whose leader is ``rank``
            (see ``transfers``).
        PARTS: the four parts, in order: ``"input transfer"``, ``"compute"``,
            ``"output gathering"``, ``"collectives"``.
    """

    PARTS = PARTS

    def __init__(self, name: str) -> None:
        self.name = name
        self.reset()

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self.calls = 0
        self.wall = 0.0  # the master's wall time over all calls
        self.seconds: dict[tuple[int, str], float] = {}  # (rank, part) -> total
        self.counts: dict[tuple[int, str], int] = {}  # (rank, part) -> calls that had it
        self.moved: dict[int, dict[str, int]] = {}  # rank -> bytes h2d and d2h

    def add(self, rank: int, part: str, seconds: float) -> None:
        key = (rank, part)
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        self.counts[key] = self.counts.get(key, 0) + 1

    def add_bytes(self, rank: int, h2d: int, d2h: int) -> None:
        moved = self._moved(rank)
        moved["h2d"] += int(h2d)
        moved["d2h"] += int(d2h)

    def add_sent(self, rank: int, nbytes: int) -> None:
        """Input rows sent to the host whose leader is ``rank`` (under MPI)."""
        self._moved(rank)["net"] += int(nbytes)

    def _moved(self, rank: int) -> dict:
        return self.moved.setdefault(rank, {"h2d": 0, "d2h": 0, "net": 0})

    def transfers(self, rank: int | None = None) -> dict[str, int]:
        """Bytes copied host->device (``"h2d"``) and device->host (``"d2h"``) by ``rank``
        over the calls recorded, or by all ranks together; and ``"net"``: under MPI, the
        rows of inputs the master sent to the host copy that ``rank`` leads (rows a host
        holds already are not sent again)."""
        ranks = self.moved if rank is None else [rank] if rank in self.moved else []
        return {kind: sum(self.moved[r][kind] for r in ranks) for kind in ("h2d", "d2h", "net")}

    def add_call(self, wall: float) -> None:
        self.calls += 1
        self.wall += wall

    def ranks(self) -> list[int]:
        """The ranks recorded, in order."""
        return sorted({rank for rank, _ in self.seconds})

    def total(self, rank: int | None = None, part: str | None = None) -> float:
        """Seconds spent, summed over the ranks and parts not given."""
        return sum(s for (r, p), s in self.seconds.items()
                   if (rank is None or r == rank) and (part is None or p == part))

    def summary(self) -> str:
        """A table in the style of Theano's profiler: per rank and part, the share of the
        master's wall time, the time per call, the total and the number of calls; then
        each part summed over all ranks."""
        if not self.calls:
            return f"synk profile of {self.name}: no calls recorded"
        wall = self.wall or 1e-12
        lines = [
            f"synk profile of {self.name}: {self.calls} calls, {_t(self.wall)} in the master "
            f"({_t(self.wall / self.calls)} per call). Share: of the master's wall time.",
            "",
            f"{'rank':<5} {'part':<17} {'share':>7} {'per call':>10} {'total':>10} {'calls':>6}",
        ]

        def row(rank_label, part, seconds, calls):
            per_call = seconds / calls if calls else 0.0
            lines.append(f"{rank_label:<5} {part:<17} {100 * seconds / wall:6.1f}% "
                         f"{_t(per_call):>10} {_t(seconds):>10} {calls:>6}")

        copies = any(m["h2d"] or m["d2h"] for m in self.moved.values())
        sent = any(m["net"] for m in self.moved.values())
        kinds = ((("h2d", "host->device"), ("d2h", "device->host")) if copies else ()) + (
            (("net", "inputs to host"),) if sent else ())
        for rank in self.ranks():
            for part in PARTS:
                if (rank, part) in self.seconds:
                    row(str(rank), part, self.seconds[(rank, part)], self.counts[(rank, part)])
            busy = self.total(rank)
            if rank:
                row(str(rank), "idle", max(0.0, self.wall - busy), self.calls)
            else:
                row(str(rank), "total", busy, self.calls)
            if kinds:
                moved = self.transfers(rank)
                for kind, label in kinds:
                    lines.append(f"{rank:<5} {label:<17} {'':>7} "
                                 f"{_b(moved[kind] / self.calls):>10} {_b(moved[kind]):>10} "
                                 f"{self.calls:>6}")
        for part in PARTS:
            seconds = self.total(part=part)
            if seconds:
                calls = max(c for (r, p), c in self.counts.items() if p == part)
                row("all", part, seconds, calls)
        return "\n".join(lines)

    __str__ = summary

    def __repr__(self) -> str:
        return f"<synk.Profile of {self.name}: {self.calls} calls>"


def _b(nbytes: float) -> str:
    """Bytes with a unit: "0 B", "512 B", "1.5 kB", "3.2 MB", "1.1 GB"."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"


def _t(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"
