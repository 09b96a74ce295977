"""The lab's acceptance run: every scenario, broken vs fixed, doctor on both, N repeats.

    .venv/bin/python bench/bench_lab.py                  # tailguard lab all --repeat 5
    .venv/bin/python bench/bench_lab.py --repeat 1 churn

Prints each run's tail side by side (p50/p99/max, share within SLA, new connections per request,
the doctor's verdict) and the confusion matrix; exits with the lab's code (0: acceptance met).
Heavy (minutes, both cores): `make bench`, never `make test`.
"""

from __future__ import annotations

import argparse
import sys

from tailguard.cli import main


def run() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("scenario", nargs="?", default="all")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default=".tailguard/lab")
    a = p.parse_args()
    return main(["lab", a.scenario, "--repeat", str(a.repeat), "--out", a.out,
                 "--json", f"{a.out}/results.json"])  # fmt: skip


if __name__ == "__main__":
    sys.exit(run())
