"""`tailguard model synth --preset {embedded,m} --out DIR`: write a benchmark checkpoint."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tailguard.model.synth import PRESETS

    sub = parser.add_subparsers(dest="model_command", metavar="SUBCOMMAND", required=True)
    s = sub.add_parser("synth", help="write a seeded Mistral-architecture checkpoint folder")
    s.add_argument("--preset", choices=sorted(PRESETS), required=True)
    s.add_argument("--out", type=Path, required=True, help="folder to create (absent or empty)")
    s.add_argument("--seed", type=int, default=None, help="weight seed (default: the embedded's)")


def run(args: argparse.Namespace) -> int:
    from tailguard.model.embedded import EMBEDDED_SEED
    from tailguard.model.synth import PRESETS, num_parameters, synth

    t0 = time.perf_counter()
    try:
        out = synth(args.preset, args.out, seed=EMBEDDED_SEED if args.seed is None else args.seed)
    except (FileExistsError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = PRESETS[args.preset]
    print(
        f"wrote {out} (preset {args.preset}: {num_parameters(config) / 1e6:.1f}M parameters, "
        f"{config.torch_dtype}) in {time.perf_counter() - t0:.1f} s"
    )
    return 0
