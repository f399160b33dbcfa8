"""Command line of ``python -m synk.bench``."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import numpy as np

from . import allreduce, calls, cluster, frameworks, gpu, scaling, scatter, training
from ._timing import parse_size, sizes_between

BENCHES = ("call", "scatter", "allreduce", "training", "scaling", "gpu", "frameworks")


def machine() -> dict:
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if "model name" in line), "")
    except OSError:
        cpu = platform.processor()
    return {"date": datetime.date.today().isoformat(), "cpu": cpu,
            "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "numpy": np.__version__, "platform": platform.platform()}


def table(rows: list[dict]) -> str:
    lines = [f"{'benchmark':<14} {'case':<52} {'median':>10} {'baseline':<20} {'ratio':>7}  extra"]
    for r in rows:
        extra = ", ".join(f"{k}={_fmt(v)}" for k, v in r.items() if k in _EXTRA)
        lines.append(f"{r['bench']:<14} {r['case']:<52} {_seconds(r['median_s']):>10} "
                     f"{r['baseline'][:20]:<20} {r['ratio']:>6.2f}x  {extra}")
    return "\n".join(lines)


_EXTRA = ("gb_per_s", "bus_gb_per_s", "copy_gb_per_s", "overhead_s", "speedup", "efficiency",
          "synk_speedup", "vs_mpi", "vs_noop", "vs_tiny", "vs_polling_off",
          "max_rank_memory_growth", "load")


def _fmt(v):
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    _plot_sizes(axes[0], axes[1], rows)
    scale = [r for r in rows if r["bench"] == "scaling"]
    if scale:
        axes[2].plot(*_xy(scale, "ranks", "speedup"), "o-", label="synk")
        axes[2].plot([1, scale[-1]["ranks"]], [1, scale[-1]["ranks"]], "k--", label="ideal")
    titles = [("scatter: seconds per call", "array bytes"),
              ("allreduce: GB/s", "bytes per rank"), ("scaling: speedup", "ranks")]
    for ax, (title, xlabel) in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _xy(rows: list[dict], x: str, y: str) -> tuple[list, list]:
    """The ``x`` and the ``y`` column of ``rows``."""
    return [r[x] for r in rows], [r[y] for r in rows]


def _plot_sizes(scatter_ax, allreduce_ax, rows: list[dict]) -> None:
    """Plot the scatter times and allreduce rates against the size, with their baselines."""
    draw = {"scatter": (scatter_ax.loglog, "median_s"),
            "allreduce": (allreduce_ax.semilogx, "gb_per_s")}
    by_case: dict = {}
    for r in rows:
        if r["bench"] in draw and "bytes" in r:
            name = r["case"].rsplit(",", 1)[0]
            by_case.setdefault((r["bench"], name), []).append(r)
    for (bench, name), rs in by_case.items():
        line, y = draw[bench]
        line(*_xy(rs, "bytes", y), "o-", label=name)
    base = [r for r in rows if r["bench"] == "scatter" and r["case"].startswith("synk Data")]
    if base:
        scatter_ax.loglog(*_xy(base, "bytes", "baseline_s"), "k--", label="numpy, 1 process")
    copy = [r for r in rows if r["bench"] == "allreduce" and r["case"].startswith("synk,")]
    if copy:
        allreduce_ax.semilogx(*_xy(copy, "bytes", "copy_gb_per_s"), "k--", label="memory copy")


def main(argv=None) -> int:
    cores = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(prog="python -m synk.bench", description=__doc__)
    p.add_argument("--only", default=",".join(BENCHES),
                   help=f"comma-separated subset of {','.join(BENCHES)}")
    p.add_argument("--ranks", type=int, default=max(cores, 2),
                   help="ranks for call, scatter and allreduce; scaling goes 1..ranks "
                        "(default: the CPU cores, at least 2)")
    p.add_argument("--max-size", default="1G",
                   help="largest array for scatter; allreduce stops at 256 MiB or this")
    p.add_argument("--repeat", type=int, default=15, help="repetitions per figure")
    p.add_argument("--calls", type=int, default=2000, help="repetitions for call overhead")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few repetitions")
    p.add_argument("--mpi", action="store_true",
                   help="only the many-host figures: synk under mpiexec with the ranks on two "
                        "pretend hosts, against mpi4py alone (needs the mpi extra)")
    p.add_argument("--no-load", action="store_true",
                   help="skip the call rows with one core kept busy by another process")
    p.add_argument("--out", default="synk-bench.json", help="JSON results file")
    p.add_argument("--plot", default="synk-bench.png", help="plot file (needs matplotlib)")
    args = p.parse_args(argv)
    only = set(args.only.split(","))
    unknown = only - set(BENCHES)
    if unknown:
        p.error(f"unknown benchmarks {sorted(unknown)}; choose from {','.join(BENCHES)}")
    top = parse_size(args.max_size)
    repeat, n_calls, rows_scaling = args.repeat, args.calls, 4000
    if args.quick:
        top, repeat, n_calls, rows_scaling = min(top, 1 << 20), 3, 50, 200
    info = machine()
    print(f"synk.bench on {info['cpu']} ({info['cores']} cores), Python {info['python']}, "
          f"{info['date']}")
    rows, skipped = [], {}
    if args.mpi:
        only = set()
        why = cluster.available()
        if why is None:
            rows += cluster.run(args.ranks, n_calls, sizes_between(4 << 10, min(top, 64 << 20),
                                                                   4), repeat)
            if args.quick:
                rows += cluster.run_combine([min(top, 64 << 10)], repeat, n_calls, [(2, 2)])
            else:
                rows += cluster.run_combine([1 << 20, 16 << 20], repeat, n_calls)
        else:
            skipped["mpi"] = why
    rows += _run_local(args, only, top, repeat, n_calls, rows_scaling, skipped)
    print(table(rows))
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")
    with open(args.out, "w") as f:
        json.dump({"machine": info, "args": vars(args), "skipped": skipped, "results": rows},
                  f, indent=1)
    print(f"results: {args.out}")
    if plot(rows, args.plot):
        print(f"plot: {args.plot}")
    return 0


def _run_local(args, only: set, top: int, repeat: int, n_calls: int, rows_scaling: int,
               skipped: dict) -> list[dict]:
    """The rows of the benchmarks in ``only``; those that cannot run go into ``skipped``."""
    rows: list[dict] = []
    if "call" in only:
        rows += calls.run(args.ranks, n_calls, loaded=not args.no_load)
    if "scatter" in only:
        rows += scatter.run(args.ranks, sizes_between(min(1 << 20, top), top, 4), repeat)
    if "allreduce" in only:
        rows += allreduce.run(args.ranks, sizes_between(4 << 10, min(top, 256 << 20), 4), repeat)
    if "training" in only:
        rows += training.run(args.ranks, max(n_calls // 10, 30), repeat,
                             [min(s, top) for s in training.FUSED_SIZES],
                             rounds=1 if args.quick else training.ROUNDS)
    if "scaling" in only:
        rows += scaling.run(args.ranks, rows_scaling, repeat)
    if "gpu" in only:
        why = gpu.available()
        if why is None:
            rows += gpu.run(sizes_between(1 << 20, top, 16), repeat)
        else:
            skipped["gpu"] = why
    if "frameworks" in only:
        why = frameworks.available()
        if why is None and args.quick and args.only == ",".join(BENCHES):
            why = "--quick: torch's processes take long to start; run --only frameworks"
        if why is None:
            rows += frameworks.run(2, steps=20 if args.quick else frameworks.STEPS,
                                   rounds=1 if args.quick else frameworks.ROUNDS,
                                   loaded=not args.no_load)
        else:
            skipped["frameworks"] = why
    return rows


if __name__ == "__main__":
    sys.exit(main())
