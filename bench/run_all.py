"""`make bench`: run every side-by-side benchmark in sequence and summarise.

    .venv/bin/python bench/run_all.py [NAME ...]     # e.g. engine frontend overload

Heavy runs (10,000 connections, long loads) live here, not in `make test`. A ~10 s pause
between benchmarks lets TIME_WAIT sockets and kernel queues drain (measurements.md).
Numbers go to docs/benchmarks.md by hand, with the command that produced them.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
# name -> script (and default arguments); order: cheapest first
BENCHES: dict[str, list[str]] = {
    "model": ["model_forward.py"],
    "engine": ["bench_engine.py"],
    "amx": ["amx_probe.py"],  # AMX ceilings vs our linear; says so and exits 0 without AMX
    "vllm": ["bench_vllm.py", "--engine-threads", "2"],  # skips vLLM without /work/vllm-venv
    "app_path": ["bench_app_path.py"],
    "frontend": ["bench_frontend.py"],
    "overload": ["bench_overload.py"],
    "load": ["bench_load.py"],
    "batch": ["bench_batch.py"],
    "goodput": ["bench_goodput.py"],
    "churn": ["bench_churn.py"],
    "lab": ["bench_lab.py"],
}
PAUSE_S = 10


def main(argv: list[str]) -> int:
    names = argv or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {list(BENCHES)}", file=sys.stderr)
        return 2
    results: dict[str, str] = {}
    for i, name in enumerate(names):
        script, *args = BENCHES[name]
        if not (HERE / script).exists():
            results[name] = "missing"
            continue
        if i:
            time.sleep(PAUSE_S)
        print(f"\n===== {name}: {script} {' '.join(args)}", flush=True)
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, str(HERE / script), *args])
        results[name] = f"exit {rc} in {time.monotonic() - t0:.0f} s"
    print("\n===== summary")
    for name, res in results.items():
        print(f"  {name:10s} {res}")
    return 0 if all(r.startswith("exit 0") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
