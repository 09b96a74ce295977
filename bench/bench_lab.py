"""The lab's acceptance runs: fixed scenarios (broken vs fixed, N repeats) or drawn ones.

    .venv/bin/python bench/bench_lab.py                          # tailguard lab all --repeat 5
    .venv/bin/python bench/bench_lab.py --repeat 1 churn
    .venv/bin/python bench/bench_lab.py random --runs 30 --seed 7  # tailguard lab random

Prints each run's tail side by side (p50/p99/max, share within SLA, new connections per request,
the doctor's verdict) and the confusion matrix; exits with the lab's code (0: acceptance met).
Heavy (minutes, both cores): `make bench`, never `make test`; on a shared machine run it under
`flock -x /tmp/tg-cpu.lock`, one seed at a time.
"""

from __future__ import annotations

import argparse
import sys

from tailguard.cli import main


def run() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("scenario", nargs="?", default="all")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--runs", type=int, default=30, help="random: drawn runs")
    p.add_argument("--seed", type=int, default=1, help="random: the draw's seed")
    p.add_argument("--out", default=".tailguard/lab")
    a = p.parse_args()
    if a.scenario == "random":
        out = f"{a.out}/random-{a.seed}"
        return main(["lab", "random", "--runs", str(a.runs), "--seed", str(a.seed), "--out", out,
                     "--json", f"{out}/results.json"])  # fmt: skip
    return main(["lab", a.scenario, "--repeat", str(a.repeat), "--out", a.out,
                 "--json", f"{a.out}/results.json"])  # fmt: skip


if __name__ == "__main__":
    sys.exit(run())
