"""Seconds from `mirrorsd generate` starting to the first byte of its reply on stdout, as a user waits for it.

    .venv/bin/python scripts/first_token.py [--runs 5] [generate's flags...]

The model must be cached (run generate once first). Prints each run and the median; the median is what
docs/quickstart.md quotes (measure on a quiet machine)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

MIRRORSD = Path(sys.executable).with_name("mirrorsd")


def first_byte(flags: list[str]) -> tuple[float, str]:
    cmd = [str(MIRRORSD), "generate", "Write a Python quicksort.", "--max-new-tokens", "16", *flags]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    seconds = time.perf_counter() - start
    _, err = proc.communicate()
    if proc.returncode:
        sys.exit(f"generate failed ({proc.returncode}): {err.decode()[-500:]}")
    return seconds, err.decode().strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args, flags = parser.parse_known_args()
    times = []
    for i in range(args.runs):
        seconds, stats = first_byte(flags)
        times.append(seconds)
        print(f"run {i + 1}: first byte after {seconds:.2f} s   {stats}")
    print(f"median {statistics.median(times):.2f} s over {len(times)} runs (min {min(times):.2f}, max {max(times):.2f})")


if __name__ == "__main__":
    main()
