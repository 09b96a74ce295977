"""Engine throughput vs Hugging Face transformers static batching, side by side in one run.

    .venv/bin/python bench/bench_engine.py [--requests 512] [--queries 2000]

Each workload runs in A B B A order (--rounds 2) so a burst of other load hits both sides.
(a) 512 generation requests (prompts 24-40 tokens, 16 output tokens, EOS ignored), all submitted
    at once: output tokens/s, tailguard's continuous batching vs transformers' `generate` on
    static batches of 64 with left padding.
(b) 2,000 single-pass queries (prompts 32-128 tokens, top-5 next-token log-probs): queries/s vs
    transformers forward passes on static batches of 64.
Both sides run on the same embedded checkpoint, dtype and thread count. Also reports model
FLOP/s against this machine's measured matmul FLOP/s (MFU). The last line prints the ratios.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tailguard.core.request import EngineRequest, RequestKind, SamplingParams
from tailguard.engine.config import EngineConfig, available_cores
from tailguard.engine.core import EngineCore
from tailguard.engine.runner import choose_dtype
from tailguard.model.config import MistralConfig
from tailguard.model.embedded import default_model_dir

HF_BATCH = 64


def matmul_flops(dtype: torch.dtype, seconds: float = 1.0) -> float:
    """FLOP/s of the fastest 2048^3 product over `seconds` (the peak: a mean over the run let
    a noisy neighbour pull the bound down, 336-406 GFLOP/s in two runs minutes apart on
    session 30's machine)."""
    a = torch.randn(2048, 2048, dtype=dtype)
    b = torch.randn(2048, 2048, dtype=dtype)
    a @ b
    best, t0 = math.inf, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        t1 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t1)
    return 2 * 2048**3 / best


def flops_per_token(m: MistralConfig, ctx: float, logits: bool) -> float:
    per_layer = m.hidden_size * (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim
    per_layer += (
        m.num_attention_heads * m.head_dim * m.hidden_size + 3 * m.hidden_size * m.intermediate_size
    )
    attn = 4 * ctx * m.num_attention_heads * m.head_dim
    total = m.num_hidden_layers * (2 * per_layer + attn)
    return total + (2 * m.hidden_size * m.vocab_size if logits else 0)


def workloads(n_gen: int, n_q: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    gen = [[rng.randrange(3, 32000) for _ in range(rng.randint(24, 40))] for _ in range(n_gen)]
    qs = [[rng.randrange(3, 32000) for _ in range(rng.randint(32, 128))] for _ in range(n_q)]
    return gen, qs


def tailguard_generate(core: EngineCore, prompts: list[list[int]], new: int) -> tuple[float, int]:
    for i, p in enumerate(prompts):
        core.add(
            EngineRequest(
                request_id=f"g{i}",
                prompt_token_ids=tuple(p),
                sampling=SamplingParams(max_tokens=new, ignore_eos=True),
            )
        )
    t0, n = time.perf_counter(), 0
    while core.has_work():
        n += sum(len(o.new_token_ids) for o in core.step())
    return time.perf_counter() - t0, n


def tailguard_queries(core: EngineCore, prompts: list[list[int]]) -> tuple[float, int]:
    for i, p in enumerate(prompts):
        core.add(
            EngineRequest(
                request_id=f"q{i}", prompt_token_ids=tuple(p), kind=RequestKind.SCORE, top_k=5
            )
        )
    t0, n = time.perf_counter(), 0
    while core.has_work():
        n += sum(1 for o in core.step() if o.finished and o.top_logprobs)
    return time.perf_counter() - t0, n


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], new: int) -> tuple[float, int]:
    t0, n = time.perf_counter(), 0
    for b in range(0, len(prompts), HF_BATCH):
        ids, mask = left_pad(prompts[b : b + HF_BATCH])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,  # type: ignore[operator]
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
        n += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return time.perf_counter() - t0, n


def hf_queries(model: torch.nn.Module, prompts: list[list[int]]) -> tuple[float, int]:
    t0, n = time.perf_counter(), 0
    with torch.inference_mode():
        for b in range(0, len(prompts), HF_BATCH):
            ids, mask = left_pad(prompts[b : b + HF_BATCH])
            # logits_to_keep=1: the fairest baseline runs the output head on the last token only
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1, :]
            torch.log_softmax(logits.float(), dim=-1).topk(5)
            n += ids.shape[0]
    return time.perf_counter() - t0, n


def left_pad(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def abba(
    a: Callable[[], tuple[float, int]], b: Callable[[], tuple[float, int]], rounds: int
) -> tuple[float, int, float, int]:
    """Run both sides in A B B A order `rounds` times and sum: on a shared machine a burst of
    someone else's load then hits both sides alike instead of one of them."""
    ta = na = tb = nb = 0.0
    for r in range(rounds):
        order = (a, b) if r % 2 == 0 else (b, a)
        for side in order:
            t, n = side()
            if side is a:
                ta, na = ta + t, na + n
            else:
                tb, nb = tb + t, nb + n
    return ta, int(na), tb, int(nb)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds per workload")
    ap.add_argument(
        "--small-m-kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="EngineConfig.small_m_kernel (--no-small-m-kernel: oneDNN, to A/B the kernel)",
    )
    args = ap.parse_args()
    from transformers import MistralForCausalLM

    model_dir: Path = default_model_dir()
    # no HTTP process shares the machine here: the engine (and transformers) get every core
    config = EngineConfig(
        model_dir=str(model_dir),
        threads=args.threads or available_cores(),
        small_m_kernel=args.small_m_kernel,
    )
    torch.set_num_threads(config.threads)
    dtype = choose_dtype(config)
    gen, qs = workloads(args.requests, args.queries)
    core = EngineCore(config, model_dir)
    core.warmup()
    hf = MistralForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    hf_generate(hf, gen[:HF_BATCH], 2)  # warm both sides
    tailguard_generate(core, gen[:HF_BATCH], 2)
    peak = matmul_flops(dtype)
    m = core.runner.mcfg
    print(
        f"machine: {torch.get_num_threads()} threads, {dtype}, matmul peak {peak / 1e9:.0f} GFLOP/s"
    )
    print(
        f"engine: max_num_seqs={config.max_num_seqs} max_num_batched_tokens="
        f"{config.max_num_batched_tokens}"
    )

    tg_t, tg_n, hf_t, hf_n = abba(
        lambda: tailguard_generate(core, gen, args.new_tokens),
        lambda: hf_generate(hf, gen, args.new_tokens),
        args.rounds,
    )
    ctx = 32 + args.new_tokens / 2
    gen_flops = tg_n * flops_per_token(m, ctx, True) + args.rounds * sum(
        map(len, gen)
    ) * flops_per_token(m, 16, False)
    print(
        f"(a) generation  {args.requests} req x {args.new_tokens} tok: "
        f"tailguard {tg_n / tg_t:8.0f} "
        f"tok/s ({tg_t:.2f} s, MFU {gen_flops / tg_t / peak:.0%})   transformers b{HF_BATCH} "
        f"{hf_n / hf_t:8.0f} tok/s ({hf_t:.2f} s, MFU {gen_flops / hf_t / peak:.0%})"
    )
    tq_t, tq_n, hq_t, hq_n = abba(
        lambda: tailguard_queries(core, qs), lambda: hf_queries(hf, qs), args.rounds
    )
    q_flops = args.rounds * sum(
        len(p) * flops_per_token(m, len(p) / 2, False) + 2 * m.hidden_size * m.vocab_size
        for p in qs
    )
    print(
        f"(b) queries     {args.queries} x 32-128 tok:  tailguard {tq_n / tq_t:8.0f} q/s   "
        f"({tq_t:.2f} s, MFU {q_flops / tq_t / peak:.0%})   transformers b{HF_BATCH} "
        f"{hq_n / hq_t:8.0f} q/s   ({hq_t:.2f} s, MFU {q_flops / hq_t / peak:.0%})"
    )
    stats = core.stats()
    print(
        f"shapes after warm-up: {len(core.runner.shapes.after_warmup)} new; KV allocations "
        f"{stats.kv_allocations_total}; GC pauses {stats.gc_pause_s_total * 1000:.1f} ms"
    )
    print(
        f"RATIO generation {(tg_n / tg_t) / (hf_n / hf_t):.2f}x (target 1.5x)  "
        f"queries {(tq_n / tq_t) / (hq_n / hq_t):.2f}x (target 1.3x)"
    )


if __name__ == "__main__":
    main()
