"""Where an engine step's time goes, in-process: EngineCore.step() on B sequences generating
together (prompt tokens, then decode), the forward timed apart from the rest of the step.

    .venv/bin/python bench/engine_step.py --model ~/.cache/tailguard/bench-m --batch 8 --threads 2
    .venv/bin/python bench/engine_step.py --batch 64 --threads 1          # the embedded model
    .venv/bin/python bench/engine_step.py --model ~/.cache/tailguard/bench-m --ab-kernel --matmuls

Prints the median decode step, forward, and outside-the-forward (output head, argmax, plan,
scheduler update) in ms, and the msgpack encode of each step's outputs + stats;
--temperature T samples (default greedy), --no-row-kernels uses torch's argmax / sampling
instead of model/kernels/rows.c; --old-buckets
runs with the token-bucket floor of 16 that preceded session 19, --profile adds a cProfile of
the steps; --long-prompts N:LEN gives the first N sequences LEN-token prompts (a batch of mixed
contexts, as served traffic has: the decode attention's split over threads shows there).
Set OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=200000 to match the served engine.

--paired-bound reads the bandwidth again after every decode step (an fp32 and an int32 max,
~25 ms) and reports the median of each step's ratio to its own bound: the memory's rate on
these machines moves by up to 1.7x within minutes (session 30), so a bound read once before
the run can flatter or wrong the step.

--prefill-peak times the prefill of --batch x --prompt tokens (every step until each prompt
has its first token) against the FLOPs it needs and bench_engine.py's matmul peak (2048^3
products for 1 s) in the same dtype on the same threads (the compute bound); --rounds N
repeats the prefill N times, each right after a peak read of its own, and prints each pair's
ratio and their median last (the first line's peak, read before the engine starts, stays as
it was for comparison with earlier sessions); --parts adds
where those steps' time goes, by kernel call (bf16 kernels; the linears by shape).
--ab-fused runs op by op (fused_decode=False), then the fused decode stack (model/kernels/
decode.c), and prints both against the bound last; --no-fused-decode runs op by op alone.
--ab-kernel runs the step twice in one run, oneDNN only (small_m_kernel=False) then our
small-M kernel, after measuring the machine's read bandwidth (the fastest of an fp32 sum, an
fp32 max and an int32 max over 512 MB, 1 thread and --threads) and printing the weights-bytes /
bandwidth bound; the decode-step ratio comes last. --matmuls adds the per-matmul micro bench:
the model's four projection shapes and its head at --batch rows in --dtype, our kernel (fp32:
gemv.c, bf16: gemv_bf16.c) vs oneDNN-packed, cycling over distinct weights (>= 640 MB per
shape, over twice the L3 of any machine here) so every weight comes from memory.
No vLLM baseline here (bench_vllm.py); take numbers under `flock -x /tmp/tg-cpu.lock`.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import math
import pstats
import random
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil
import torch

from bench_engine import flops_per_token, matmul_flops
from tailguard.core.request import EngineRequest, SamplingParams
from tailguard.engine.config import EngineConfig
from tailguard.engine.core import EngineCore
from tailguard.engine.protocol import UpdateMsg
from tailguard.model.config import MistralConfig
from tailguard.model.embedded import default_model_dir
from tailguard.model.kernels import (
    Bf16Kernel,
    LinearKernel,
    PrefillAttention,
    RowKernel,
    bf16_kernel_unavailable_reason,
    load_bf16_kernel,
    load_small_m_kernel,
    small_m_unavailable_reason,
)
from tailguard.model.mistral import PackedLinear


def read_bandwidth(threads: int, mbytes: int = 512, repeat: int = 7) -> float:
    """GB/s of the fastest of three reads of `mbytes` MB on `threads` threads (best of
    `repeat` each): an fp32 sum, an fp32 max and an int32 max. The sum alone under-reads on
    some CPUs: on session 30's Zen 4 it read 31.7 GB/s where both maxes read 49.7-54.7, and
    our bf16 kernel streamed weights at up to 47 GB/s, so a bound from the sum alone would
    be 1.7x too lenient."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.ones(mbytes * 2**20 // 4)
        reads = (a.sum, a.amax, a.view(torch.int32).max)
        best = min(_best(fn, repeat) for fn in reads)
    finally:
        torch.set_num_threads(before)
    return a.numel() * 4 / best / 1e9


def _best(fn: Any, repeat: int) -> float:
    fn()
    return min(_timed(fn) for _ in range(repeat))


PAIRED: list[float] = []  # each run_engine's median step / paired bound (--paired-bound)


def quick_bandwidth(threads: int, mbytes: int = 512) -> Any:
    """A probe: GB/s of the faster of an fp32 max and an int32 max over `mbytes` MB (one of
    each, ~25 ms), read between decode steps."""
    a = torch.ones(mbytes * 2**20 // 4)
    reads = (a.amax, a.view(torch.int32).max)

    def probe() -> float:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return a.numel() * 4 / min(_timed(fn) for fn in reads) / 1e9
        finally:
            torch.set_num_threads(before)

    return probe


PREFILL_STEPS: list[float] = []  # the last run's prefill steps (until every first token), s
PREFILL_PAIRS: list[tuple[float, float]] = []  # --rounds: (peak GFLOP/s read just before, s)
PARTS: dict[str, float] = {}  # --parts: seconds in each kernel call kind over the prefill steps
PARTS_ON = [False]  # --parts: inside a prefill step


def time_parts() -> None:
    """--parts: every call of the kernels a prefill step makes is timed, by kind (the linears by
    their shape), while PARTS_ON[0]: the Python around each call is included, the rest of the
    step (torch ops, the layers' own Python) is what the step's time leaves."""

    def wrap(cls: Any, name: str, tag: Any) -> None:
        inner = getattr(cls, name)

        def timed(self: Any, *a: Any, **k: Any) -> Any:
            if not PARTS_ON[0]:
                return inner(self, *a, **k)
            t0 = time.perf_counter()
            out = inner(self, *a, **k)
            key = tag(a, k)
            PARTS[key] = PARTS.get(key, 0.0) + time.perf_counter() - t0
            return out

        setattr(cls, name, timed)

    def linear_tag(a: Any, k: Any) -> str:
        w = a[1]
        on = [n for n in ("norm", "silu", "residual") if k.get(n) is not None and k[n] is not False]
        extra = "+".join(on)
        return f"linear N={w.out_features} K={w.in_features}" + (f" +{extra}" if extra else "")

    wrap(Bf16Kernel, "linear_fused", linear_tag)
    wrap(Bf16Kernel, "linear", lambda a, k: f"linear N={a[1].out_features} (plain: head, small)")
    wrap(PrefillAttention, "attend", lambda a, k: "prefill attention")
    wrap(RowKernel, "rope_", lambda a, k: "RoPE (+ K/V write)")
    wrap(RowKernel, "decode_attention", lambda a, k: "decode rows' attention")


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def weight_bytes(cfg: MistralConfig, itemsize: int = 4) -> int:
    """Bytes of weights one decode step reads (itemsize 4: fp32, 2: bf16): every projection
    and the output head."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = (q + 2 * kv) * h + q * h + 2 * i * h + i * h
    return itemsize * (cfg.num_hidden_layers * per_layer + cfg.vocab_size * h)


def prefill_flops(cfg: MistralConfig, batch: int, prompt: int) -> float:
    """FLOPs of prefilling `batch` prompts of `prompt` tokens (bench_engine's count per token,
    at the mean causal context), with the head on one row a sequence."""
    per_token = flops_per_token(cfg, ctx=(prompt + 1) / 2, logits=False)
    return batch * (prompt * per_token + 2 * cfg.hidden_size * cfg.vocab_size)


def matmul_shapes(cfg: MistralConfig) -> list[tuple[str, int, int]]:
    """(name, N, K) of the weights a layer and the head multiply by."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return [
        ("w13", 2 * i, h),
        ("w2", h, i),
        ("wqkv", q + 2 * kv, h),
        ("wo", h, q),
        ("head", cfg.vocab_size, h),
    ]


def micro(cfg: MistralConfig, rows: int, threads: int, dtype: torch.dtype, rounds: int = 5) -> None:
    """Per-matmul ms and GB/s of weights streamed, kernel vs oneDNN-packed, distinct weights,
    in `dtype` (fp32: gemv.c; bf16: gemv_bf16.c)."""
    torch.set_num_threads(threads)
    kernel: LinearKernel | None
    if dtype == torch.bfloat16:
        kernel, why = load_bf16_kernel(), bf16_kernel_unavailable_reason
    else:
        kernel, why = load_small_m_kernel(), small_m_unavailable_reason
    if kernel is None:
        print(f"kernel unavailable: {why()}")
    for name, n, k in matmul_shapes(cfg):
        nbytes = n * k * dtype.itemsize
        copies = max(2, -(-640 * 2**20 // nbytes))  # >= 640 MB: no weight stays in L3
        weights = [torch.randn(n, k).to(dtype) for _ in range(copies)]
        x = torch.randn(rows, k).to(dtype)
        runs: dict[str, Any] = {}
        panels = []
        if kernel is not None:
            panels = [kernel.pack(w) for w in weights]
            runs["kernel"] = [lambda w=w, x=x: kernel.linear(x, w) for w in panels]
        packed = [PackedLinear(w) for w in weights]
        del weights  # the plain copies
        runs["oneDNN"] = [lambda p=p, x=x: p(x) for p in packed]
        res = []
        for tag, fns in runs.items():
            for fn in fns:
                fn()
            per = [sum(_timed(fn) for fn in fns) / len(fns) for _ in range(rounds)]
            ms = statistics.median(per) * 1e3
            res.append(f"{tag} {ms:.3f} ms ({nbytes / ms / 1e6:.1f} GB/s)")
        print(f"  [{rows} x {k}] x [{k} x {n}] ({name}, {nbytes / 1e6:.1f} MB): " + ", ".join(res))
        del runs, packed, panels


def long_prompts(text: str) -> tuple[int, int]:
    """--long-prompts N:LEN, both non-negative integers."""
    n, sep, length = text.partition(":")
    try:
        parsed = (int(n), int(length))
    except ValueError:
        parsed = (-1, -1)
    if not sep or min(parsed) < 0:
        raise argparse.ArgumentTypeError(f"want N:LEN, two non-negative integers (got {text!r})")
    return parsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: embedded)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument(
        "--long-prompts",
        type=long_prompts,
        default=(0, 0),
        metavar="N:LEN",
        help="the first N sequences' prompts LEN tokens long, the rest --prompt (mixed contexts)",
    )
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--old-buckets", action="store_true", help="token buckets from 16")
    ap.add_argument("--no-kernel", action="store_true", help="small_m_kernel=False (oneDNN)")
    ap.add_argument(
        "--no-row-kernels", action="store_true", help="row_kernels=False (torch argmax/sampling)"
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled decode")
    ap.add_argument("--ab-kernel", action="store_true", help="oneDNN, then the kernel; ratio")
    ap.add_argument("--no-fused-decode", action="store_true", help="fused_decode=False")
    ap.add_argument(
        "--ab-fused", action="store_true", help="op by op, then the fused decode stack; ratio"
    )
    ap.add_argument(
        "--ab-greedy-head",
        action="store_true",
        help="the stack without its greedy head (norm, head, argmax in Python), then with; ratio",
    )
    ap.add_argument("--matmuls", action="store_true", help="per-matmul micro bench")
    ap.add_argument(
        "--prefill-peak",
        action="store_true",
        help="the prefill's GFLOP/s against a 2048^3 matmul's in the same dtype",
    )
    ap.add_argument(
        "--kv-cache-gib", type=int, default=4, help="KV pool (bench_vllm.py gives both 4 GiB)"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --prefill-peak: this many prefill runs, each after its own peak read (the "
        "machine's rate moves within minutes); the median of the paired ratios last",
    )
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--parts",
        action="store_true",
        help="with --prefill-peak: ms a prefill step in each kernel call kind (linears by shape)",
    )
    ap.add_argument(
        "--paired-bound",
        action="store_true",
        help="read the bandwidth after every decode step and report the median of each "
        "step's own ratio to its bound (the memory's rate moves with the neighbours)",
    )
    args = ap.parse_args()
    if args.prefill_peak and args.long_prompts[0]:
        ap.error("--prefill-peak counts the FLOPs of --batch x --prompt: not with --long-prompts")
    model = args.model or default_model_dir()
    cfg = MistralConfig.from_dir(model)
    bound: dict[int, float] = {}
    if args.ab_kernel or args.ab_fused or args.ab_greedy_head or args.matmuls:
        wb = weight_bytes(cfg, getattr(torch, args.dtype).itemsize)
        for t in sorted({1, args.threads}):
            gbs = read_bandwidth(t)
            bound[t] = wb / gbs / 1e6
            print(
                f"read bandwidth {t} thread(s): {gbs:.1f} GB/s (best read of 512 MB); "
                f"{wb / 1e6:.0f} MB of weights per decode step -> bound {bound[t]:.1f} ms"
            )
    if args.matmuls:
        micro(cfg, args.batch, args.threads, getattr(torch, args.dtype))
    if args.prefill_peak:
        if args.parts:
            time_parts()
        torch.set_num_threads(args.threads)
        peak = matmul_flops(getattr(torch, args.dtype)) / 1e9  # bench_engine's MFU peak
        flops = prefill_flops(cfg, args.batch, args.prompt)
        run_engine(args, model, not args.no_kernel, not args.no_fused_decode)
        took = sum(PREFILL_STEPS)
        got = flops / took / 1e9
        print(
            f"prefill {args.batch} x {args.prompt} tokens: {flops / 1e9:.1f} GFLOP in "
            f"{took * 1e3:.0f} ms = {got:.1f} GFLOP/s; {args.dtype} matmul peak "
            f"(2048^3 for 1 s, {args.threads} threads) {peak:.1f} GFLOP/s: prefill at "
            f"{peak / got:.2f}x the compute bound"
        )
        print(f"prefill steps (ms): {[round(x * 1e3) for x in PREFILL_STEPS]}")
        if PREFILL_PAIRS:
            ratios = [p * t / (flops / 1e9) for p, t in PREFILL_PAIRS]
            rounds = ", ".join(
                f"{t * 1e3:.0f} ms / {p:.0f} GFLOP/s = {r:.2f}x"
                for (p, t), r in zip(PREFILL_PAIRS, ratios, strict=True)
            )
            print(f"rounds (prefill / the peak read just before it): {rounds}")
            print(
                f"prefill at {statistics.median(ratios):.2f}x the compute bound (median of "
                f"{len(ratios)} paired rounds, {min(ratios):.2f}-{max(ratios):.2f}x)"
            )
        if args.parts:
            n = len(PREFILL_STEPS)
            print(f"where a prefill step goes (ms a step, mean of {n}; --parts):")
            for key, sec in sorted(PARTS.items(), key=lambda kv: -kv[1]):
                print(f"  {sec / n * 1e3:7.1f}  {key}")
            rest = took - sum(PARTS.values())
            print(f"  {rest / n * 1e3:7.1f}  the rest (torch ops, Python, the step around it)")
        return
    if args.ab_fused:
        op, fused = (run_engine(args, model, not args.no_kernel, f) for f in (False, True))
        b = bound.get(args.threads, math.nan)
        print(
            f"decode step batch={args.batch} threads={args.threads}: fused {fused:.1f} ms, "
            f"op by op {op:.1f} ms (op by op / fused {op / fused:.2f}x); bound {b:.1f} ms: "
            f"fused {fused / b:.2f}x the bound, op by op {op / b:.2f}x"
        )
        if len(PAIRED) == 2:
            print(
                f"decode step / paired bound (bandwidth read after each step): fused "
                f"{PAIRED[1]:.2f}x, op by op {PAIRED[0]:.2f}x"
            )
        return
    if args.ab_greedy_head:
        off, on = (
            run_engine(args, model, not args.no_kernel, True, greedy_head=g) for g in (False, True)
        )
        b = bound.get(args.threads, math.nan)
        print(
            f"decode step batch={args.batch} threads={args.threads}: greedy head {on:.1f} ms, "
            f"without {off:.1f} ms (without / with {off / on:.2f}x); bound {b:.1f} ms: with "
            f"{on / b:.2f}x the bound, without {off / b:.2f}x"
        )
        return
    variants = [True, False] if args.ab_kernel else [not args.no_kernel]
    steps: dict[bool, float] = {}
    for use_kernel in variants[::-1]:  # oneDNN first in an A/B
        steps[use_kernel] = run_engine(args, model, use_kernel, not args.no_fused_decode)
    if args.ab_kernel:
        b = bound.get(args.threads, math.nan)
        k, o = steps[True], steps[False]
        print(
            f"decode step batch={args.batch} threads={args.threads}: kernel {k:.1f} ms, "
            f"oneDNN {o:.1f} ms (oneDNN / kernel {o / k:.2f}x); bound {b:.1f} ms: "
            f"kernel {k / b:.2f}x the bound, oneDNN {o / b:.2f}x"
        )
        if len(PAIRED) == 2:
            print(
                f"decode step / paired bound (bandwidth read after each step): kernel "
                f"{PAIRED[1]:.2f}x, oneDNN {PAIRED[0]:.2f}x"
            )


def run_engine(
    args: argparse.Namespace, model: Path, use_kernel: bool, fused: bool, greedy_head: bool = True
) -> float:
    """One engine's median decode step in ms (printed with its parts); greedy_head=False
    leaves the decode stack's greedy tail off (the final norm, head and argmax in Python)."""
    extra: dict[str, Any] = {}
    if args.old_buckets:
        extra["token_buckets"] = (16, 32, 64, 128, 256, 512, 1024)
    cfg = EngineConfig(
        model_dir=str(model),
        dtype=args.dtype,
        threads=args.threads,
        max_model_len=2048,
        kv_cache_bytes=args.kv_cache_gib * 2**30,
        nice=0,
        small_m_kernel=use_kernel,
        row_kernels=not args.no_row_kernels,
        fused_decode=fused,
        **extra,
    )
    core = EngineCore(cfg, model)
    if not greedy_head and core.runner.model._stack is not None:
        core.runner.model._stack = dataclasses.replace(core.runner.model._stack, greedy_head=None)
    core.warmup()
    encode = msgspec.msgpack.Encoder().encode
    rng = random.Random(0)
    forwards: list[float] = []
    model_ = core.runner.model

    def timing(inner: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = inner(*a, **k)
            if out is not None:  # decode_greedy: None where it does not apply
                forwards.append(time.perf_counter() - t0)
            return out

        return timed

    # the forward; where the decode stack takes a greedy step whole (decode_greedy), that
    # call, which includes the final norm, the head and the argmax
    model_.forward = timing(model_.forward)  # type: ignore[method-assign]
    model_.decode_greedy = timing(model_.decode_greedy)  # type: ignore[method-assign]

    n_long, long_len = args.long_prompts

    def run(tag: str) -> tuple[list[float], list[float], list[float]]:
        for i in range(args.batch):
            size = long_len if i < n_long else args.prompt
            prompt = tuple(rng.randrange(3, 32000) for _ in range(size))
            sp = SamplingParams(
                max_tokens=args.output, ignore_eos=True, temperature=args.temperature
            )
            core.add(EngineRequest(request_id=f"{tag}{i}", prompt_token_ids=prompt, sampling=sp))
        steps, encodes = [], []
        forwards.clear()
        started: set[str] = set()  # requests with a first token
        prefill_steps = 0  # steps until every prompt is in (several when the budget chunks it)
        while core.has_work():
            PARTS_ON[0] = len(started) < args.batch
            t0 = time.perf_counter()
            outs = core.step()
            t1 = time.perf_counter()
            encode(UpdateMsg(outputs=outs, stats=core.stats()))
            steps.append(t1 - t0)
            encodes.append(time.perf_counter() - t1)
            if probe is not None:
                rates.append(probe())
            if len(started) < args.batch:
                started.update(o.request_id for o in outs if o.new_token_ids)
                prefill_steps += 1
        n = prefill_steps
        PREFILL_STEPS[:] = steps[:n]
        return steps[n:], forwards[n:], encodes[n:]  # the prefill steps left out

    probe = quick_bandwidth(args.threads) if args.paired_bound else None
    rates: list[float] = []
    run("warm")
    paired = args.prefill_peak and args.rounds > 1  # each prefill after a peak read of its own
    for i in range(args.rounds if paired else 1):  # the last round's steps are reported
        PARTS.clear()  # --parts: the measured run's prefill steps only
        rates.clear()
        peak = matmul_flops(core.runner.dtype) / 1e9 if paired else 0.0
        steps, fwd, enc = run(f"run{i}-")
        if paired:
            PREFILL_PAIRS.append((peak, sum(PREFILL_STEPS)))
    s, f, e = (statistics.median(x) * 1e3 for x in (steps, fwd, enc))
    if probe is not None:
        wb = weight_bytes(core.runner.mcfg, core.runner.dtype.itemsize)
        paired = [st * gbs * 1e9 / wb for st, gbs in zip(steps, rates[-len(steps) :], strict=True)]
        print(
            f"paired bound: bandwidth after each step {min(rates):.1f}-{max(rates):.1f} GB/s "
            f"(median {statistics.median(rates):.1f}); step / its own bound: median "
            f"{statistics.median(paired):.2f}x (p10 {sorted(paired)[len(paired) // 10]:.2f}x)"
        )
        PAIRED.append(statistics.median(paired))
    kernel = "kernel" if core.runner.small_m_kernel is not None else "oneDNN"
    if core.runner.model._stack is not None:
        kernel += ", fused decode stack"
        if core.runner.model._stack.greedy_head is None:
            kernel += " without its greedy head"
        elif args.temperature <= 0:
            kernel += " + greedy head (forward includes the head and argmax)"
    rss = psutil.Process().memory_info().rss / 2**20
    prompts = f"{args.batch - n_long} x {args.prompt}"
    if n_long:
        prompts += f" + {n_long} x {long_len}"
    print(
        f"{model.name} batch={args.batch} threads={args.threads} dtype={args.dtype} "
        f"buckets={'from 16' if args.old_buckets else 'from 1'} {kernel}: decode step {s:.1f} "
        f"ms, forward {f:.1f} ms, outside the forward {s - f:.1f} ms, encode+stats {e:.2f} ms "
        f"({args.batch / (s + e) * 1e3:.0f} tok/s engine-only); prefill "
        f"({prompts} tokens, every chunk) {sum(PREFILL_STEPS) * 1e3:.0f} ms; "
        f"RSS {rss:.0f} MiB"
    )
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run("prof")
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return s


if __name__ == "__main__":
    main()
