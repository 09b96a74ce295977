"""Forward-pass cost of our MistralModel vs transformers' MistralForCausalLM, side by side.

Same checkpoint (the embedded model unless --model), same shapes, same thread count:
  prefill  B sequences x P prompt tokens in one forward
  decode   B sequences x 1 new token, context P..P+steps (the paged cache vs HF's DynamicCache)
Prints ms per forward and our speed-up over HF; also tokenizer encode/decode cost.

    .venv/bin/python bench/model_forward.py --batch 64 --prompt 32 --steps 16 --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tailguard.model.batch import NULL_BLOCK, AttnGroup, ForwardBatch
from tailguard.model.embedded import default_model_dir
from tailguard.model.loader import load_model, resolve_dtype
from tailguard.model.mistral import MistralModel, allocate_kv_cache
from tailguard.model.tokenizer import load_tokenizer

Runner = Callable[[], object]


def _interleaved(fns: dict[str, Runner], rounds: int) -> dict[str, float]:
    """Median seconds per call, alternating the contenders each round so that load from other
    processes on a shared machine hits both alike."""
    for fn in fns.values():
        fn()  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            counted = fn()  # a float return is the part of the call to count (seconds)
            wall = time.perf_counter() - t0
            samples[name].append(counted if isinstance(counted, float) else wall)
    return {name: statistics.median(v) for name, v in samples.items()}


def _time(fn: Runner, repeat: int) -> float:
    return _interleaved({"x": fn}, repeat)["x"]


def ours(
    model: MistralModel, batch: int, prompt: int, steps: int, dtype: torch.dtype
) -> tuple[Runner, Runner]:
    """(prefill, all decode steps) closures over the paged cache."""
    bs = 16
    per_seq = (prompt + steps + bs - 1) // bs
    kv = allocate_kv_cache(model.config, 1 + batch * per_seq, bs, dtype, "cpu")
    tables = torch.arange(1, 1 + batch * per_seq).view(batch, per_seq)  # [B, blocks]
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt + steps))

    def step(start: int, q: int) -> ForwardBatch:
        pos = start + torch.arange(q)  # [q]
        slots = tables[:, pos // bs] * bs + pos % bs  # [B, q]
        group = AttnGroup(
            token_index=torch.arange(batch * q).view(batch, q),
            block_tables=tables,
            context_lens=torch.full((batch,), start + q),
            query_start=torch.full((batch,), start),
        )
        return ForwardBatch(
            input_ids=ids[:, start : start + q].reshape(-1),
            positions=pos.repeat(batch),
            slot_mapping=slots.reshape(-1),
            groups=(group,),
        )

    prefill = step(0, prompt)
    decodes = [step(prompt + i, 1) for i in range(steps)]
    assert NULL_BLOCK not in tables

    def run_prefill() -> None:
        h = model(prefill, kv)
        model.compute_logits(h.view(batch, prompt, -1)[:, -1])

    def run_decodes() -> None:
        for b in decodes:
            model.compute_logits(model(b, kv))

    return run_prefill, run_decodes


def hf(
    model_dir: Path, batch: int, prompt: int, steps: int, dtype: torch.dtype
) -> tuple[Runner, Runner]:
    """(prefill, all decode steps) closures over HF's DynamicCache."""
    from transformers import DynamicCache, MistralForCausalLM

    model = MistralForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt + steps))

    def run_prefill() -> DynamicCache:
        cache = DynamicCache(config=model.config)
        model(ids[:, :prompt], cache=cache, use_cache=True, logits_to_keep=1)
        return cache

    def run_decodes() -> float:
        cache = run_prefill()  # not counted: only the decode steps are timed
        t0 = time.perf_counter()
        for i in range(steps):
            model(ids[:, prompt + i : prompt + i + 1], cache=cache, use_cache=True)
        return time.perf_counter() - t0

    return run_prefill, run_decodes


def tokenizer_cost(model_dir: Path) -> tuple[int, float, float]:
    tok = load_tokenizer(model_dir)
    text = "The quick brown fox jumps over the lazy dog. " * 9
    ids = tok.encode(text)
    n = 2000
    enc = _time(lambda: [tok.encode(text) for _ in range(n)], 3) / n
    dec = _time(lambda: [tok.decode(ids) for _ in range(n)], 3) / n
    return len(ids), enc, dec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="checkpoint folder (default: embedded)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | auto")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model or default_model_dir()
    dtype = resolve_dtype(args.dtype)

    model, _ = load_model(model_dir, dtype=dtype)
    with torch.inference_mode():
        o_pre, o_dec = ours(model, args.batch, args.prompt, args.steps, dtype)
        h_pre, h_dec = hf(model_dir, args.batch, args.prompt, args.steps, dtype)
        t = _interleaved({"o_pre": o_pre, "h_pre": h_pre}, args.rounds)
        t |= _interleaved({"o_dec": o_dec, "h_dec": h_dec}, args.rounds)
    o_pre, h_pre = t["o_pre"], t["h_pre"]
    o_dec, h_dec = t["o_dec"] / args.steps, t["h_dec"] / args.steps
    n, enc, dec = tokenizer_cost(model_dir)
    print(
        f"model={model_dir.name} dtype={dtype} threads={args.threads} batch={args.batch} "
        f"prompt={args.prompt} steps={args.steps}"
    )
    print(f"{'':10}{'ours ms':>10}{'HF ms':>10}{'speed-up':>10}")
    for name, o, h in (("prefill", o_pre, h_pre), ("decode", o_dec, h_dec)):
        print(f"{name:10}{o * 1e3:10.2f}{h * 1e3:10.2f}{h / o:9.2f}x")
    print(f"tokenizer: {n}-token prompt encode {enc * 1e6:.1f} us, decode {dec * 1e6:.1f} us")


if __name__ == "__main__":
    main()
