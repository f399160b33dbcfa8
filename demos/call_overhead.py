"""Round-trip time of a no-op synk call, next to a raw pipe ping-pong to one process.

    python demos/call_overhead.py [ranks] [calls]

Prints medians over many warm calls and the ratio to the baseline measured in the same run.
"""
import sys
import time
from multiprocessing import get_context

import numpy as np

import synk


def _echo(conn):
    while True:
        data = conn.recv_bytes()
        if not data:
            return
        conn.send_bytes(data)


def pipe_pingpong(calls: int) -> float:
    ctx = get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(theirs,))
    proc.start()
    ours.send_bytes(b"x" * 64)  # warm up, as synk_noop does: the child is started by now
    ours.recv_bytes()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        ours.send_bytes(b"x" * 64)
        ours.recv_bytes()
        times.append(time.perf_counter() - t)
    ours.send_bytes(b"")
    proc.join()
    return float(np.median(times))


def synk_noop(ranks: int, calls: int) -> float:
    synk.fork(ranks)
    noop = synk.function(lambda: None, reduce=None)
    noop()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        noop()
        times.append(time.perf_counter() - t)
    synk.close()
    return float(np.median(times))


if __name__ == "__main__":
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
    base = pipe_pingpong(calls)
    ours = synk_noop(ranks, calls)
    print(f"raw pipe ping-pong (1 process)     median {base * 1e6:7.1f} us")
    print(f"synk no-op call ({ranks} ranks)          median {ours * 1e6:7.1f} us"
          f"   ratio {ours / base:.2f}x")
