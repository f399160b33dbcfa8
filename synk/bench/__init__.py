"""``python -m synk.bench``: synk next to the alternatives, on this machine, in one run.

Every figure is a median over repetitions, with the ratio to its baseline measured in the
same run. See docs/performance.md for the method and ``python -m synk.bench --help``.
"""
