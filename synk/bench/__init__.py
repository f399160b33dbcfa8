"""``python -m synk.bench``: synk next to the alternatives, on this machine, in one run, every
figure a median over repetitions with the ratio to its baseline measured in the same run (the
method: docs/performance.md; the options: ``python -m synk.bench --help``).
"""
