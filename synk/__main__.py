"""``python -m synk info`` (what synk finds on this machine) and ``python -m synk selftest``
(check the GPU code path here and print a report to paste into an issue)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m synk", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="versions, CUDA devices, NCCL, MPI, shared memory")
    selftest = commands.add_parser(
        "selftest", help="run the GPU checks and a short timing, and print a report (where "
                         "no GPU is found, on the CUDA simulator, which the report says it "
                         "chose)")
    selftest.add_argument("--no-pytest", action="store_true",
                          help="skip the source checkout's pytest -m gpu run")
    selftest.add_argument("--no-frameworks", action="store_true",
                          help="skip the torch and JAX checks")
    args = parser.parse_args(argv)
    if args.command == "info":
        from ._devices.report import info_lines

        print("\n".join(info_lines()))
        return 0
    from ._selftest import main as selftest_main

    return selftest_main(run_pytest=not args.no_pytest, frameworks=not args.no_frameworks)


if __name__ == "__main__":
    sys.exit(main())
