"""How far the bf16 linear on AMX tiles is from what this machine's tiles can do, side by side in
one run: the ceilings bench/amx_probe.c measures, oneDNN's 2048^3 product (the prefill bound
of engine_step.py --prefill-peak) and our kernel (model/kernels/gemv_bf16.c) on the model M's
largest prefill matmul, [1024 x 1024] x [1024 x 5632].

    flock -x /tmp/tg-cpu.lock .venv/bin/python bench/amx_probe.py [--threads 2]

The probe's rows, each TFLOP/s over --threads cores (bf16 operands near 1: AMX's rate depends
on the data, ~10% between zeros and these):
  tiles, no loads       4 independent C tiles, operands already in tiles: the TMUL's rate
  tiles, loads from L1  the same with every A and B tile reloaded from a 32 KiB buffer
  loop: x and W fixed   gemv_bf16.c's loop (2 x 2 C tiles over x blocks of 32 rows and panels
                        of 32 columns, x's tiles loaded with tileloaddt1, k in chunks of 512
                        (the kernel's for K <= 2,048) with the sums stored and reloaded
                        between chunks, 16 blocks a group), every block and panel the same
                        memory: what the chunking's round trips cost
  loop: x streams       every panel the same, x blocks read from L2 as the kernel does
  loop: W streams       every block the same, the weight panels read from memory
  loop: both stream     the kernel's loop without its x copy and bf16 store
Then oneDNN's 2048^3 and our kernel at 1,024 rows over 8 distinct weights, and each ceiling /
the kernel. Skips (exit 0, saying why) on a CPU without AMX or without a C compiler.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_engine import matmul_flops
from tailguard.model.kernels import load_bf16_kernel

HERE = Path(__file__).parent
SHAPE = (5632, 1024)  # w13 of the model M: N, K
LOOP_ROWS = [
    ("loop: x and W fixed", 3),
    ("loop: x streams", 2),
    ("loop: W streams", 1),
    ("loop: both stream", 0),
]


def cpu_has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags and " amx_tile" in flags


def probe(exe: Path, threads: int, *args: str) -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND="true")
    out = subprocess.run(
        [str(exe), *args], env=env, capture_output=True, text=True, check=True, timeout=300
    ).stdout
    return [float(v) for v in out.split()[1:]]


def kernel_tflops(threads: int) -> float:
    kernel = load_bf16_kernel()
    if kernel is None or not kernel.amx:
        return float("nan")
    n, k = SHAPE
    g = torch.Generator().manual_seed(0)
    weights = [kernel.pack(torch.randn(n, k, generator=g).bfloat16()) for _ in range(8)]
    x = torch.randn(1024, k, generator=g).bfloat16()
    best = float("inf")
    for _ in range(4):
        t0 = time.perf_counter()
        for w in weights:
            kernel.linear(x, w, threads)
        best = min(best, (time.perf_counter() - t0) / len(weights))
    return 2 * 1024 * n * k / best / 1e12


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not cpu_has_amx():
        print("amx_probe: this CPU has no AMX tiles (amx_tile, amx_bf16); nothing to measure")
        return 0
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("amx_probe: no C compiler (cc / gcc); skipped")
        return 0
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "amx_probe"
        src = HERE / "amx_probe.c"
        subprocess.run(
            [cc, "-O2", "-march=native", "-fopenmp", str(src), "-o", str(exe)], check=True
        )
        tiles, l1 = probe(exe, args.threads, "peak")
        n, k = SHAPE
        rows = [("tiles, no loads", tiles), ("tiles, loads from L1", l1)]
        for name, mode in LOOP_ROWS:
            rows.append(
                (
                    name,
                    probe(exe, args.threads, "loop", str(n), str(k), "512", "16", str(mode | 4))[0],
                )
            )
    onednn = matmul_flops(torch.bfloat16) / 1e12
    ours = kernel_tflops(args.threads)
    print(f"AMX bf16 on {args.threads} thread(s), TFLOP/s:")
    for name, v in rows:
        print(f"  {name:<22} {v:6.2f}  ({v / ours:.2f}x our kernel)")
    print(f"  {'oneDNN 2048^3':<22} {onednn:6.2f}  ({onednn / ours:.2f}x our kernel)")
    print(f"  {'our kernel, M=1024':<22} {ours:6.2f}  (w13 of M: [1024 x {k}] x [{k} x {n}])")
    print(
        f"our kernel at {ours / rows[1][1]:.0%} of the tiles' rate from L1 and "
        f"{ours / onednn:.2f}x oneDNN's 2048^3"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
