"""The array kinds at synk's edge (synk._arrays), in one process: a plain numpy program
never imports torch or JAX; torch tensors and JAX arrays go to numpy and back keeping their
dtype (bfloat16 as its 16 bits), without a copy where the framework allows it; dtypes numpy
has no type for are refused, saying what to do. (The round trips read synk's own frames of
the arrays: they are in test_call_insides.py.)"""
import os
import subprocess
import sys


def test_numpy_programs_import_no_framework():
    code = ("import numpy as np, sys, synk\n"
            "synk.fork(2)\n"
            "f = synk.function(lambda x: (x.sum(), [x[:1]]), reduce=('sum', 'gather'))\n"
            "f(np.ones((4, 2)))\n"
            "synk.close()\n"
            "print(sorted(m for m in ('torch', 'jax') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_libraries_imported_during_a_group_get_the_ranks_thread_caps():
    """The master sets the threads' variables as its workers have them while a group runs
    (none set by the user), so torch imported by rank 0's function runs as many OpenMP
    threads as each worker (one per rank's share of the cores), not one per core."""
    code = ("import os, synk\n"
            "synk.fork(2)\n"
            "during = os.environ.get('OMP_NUM_THREADS')\n"
            "synk.close()\n"
            "print(during, os.environ.get('OMP_NUM_THREADS'))\n")
    env = {k: v for k, v in os.environ.items() if not k.endswith(
        ("_NUM_THREADS", "_MAXIMUM_THREADS"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    cores = len(os.sched_getaffinity(0))
    assert out.stdout.split() == [str(max(1, cores // 2)), "None"]
