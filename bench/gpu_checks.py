"""The checks `bench/gpu_check.sh` runs on a CUDA machine; each prints one summary line.

    python bench/gpu_checks.py --device cuda [--model DIR] [--only parity,graphs,...]

  parity     our fp32 logits on the device vs transformers fp32 on CPU, same seeded weights
             (prefill of 40 tokens, then 4 decode steps through the paged cache); TF32 off
  engine     decode step time at batch 8 and 32 on --model (default: synth preset m), bf16
  graphs     CUDA-graph capture of the decode forward (+ head) per decode bucket (G x B),
             replayed and compared with the eager forward on the same inputs
  allocator  after warm-up, 300 random requests: no device allocation (`num_device_alloc`
             delta from torch.cuda.memory_stats()), no allocator retry, no escaped op shape

Everything here also runs on CPU (tests/engine/test_gpu_checks.py does, on a tiny model): on
CPU `graphs` checks the static-buffer replay path without a graph. Exit status 1 if any fails.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tailguard.core.request import EngineRequest, RequestKind, SamplingParams
from tailguard.engine.config import EngineConfig
from tailguard.engine.core import EngineCore
from tailguard.model.batch import AttnGroup, ForwardBatch
from tailguard.model.embedded import EMBEDDED_CONFIG, write_checkpoint
from tailguard.model.loader import load_model
from tailguard.model.mistral import allocate_kv_cache

# A small model with every feature the parity test needs (GQA, sliding window, untied head).
PARITY_CONFIG = replace(
    EMBEDDED_CONFIG,
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    sliding_window=16,
    source="<gpu check parity model>",
)


@dataclass
class Result:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"CHECK {self.name:9s} {'PASS' if self.ok else 'FAIL'}  {self.detail}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        torch.cuda.synchronize(device)


def check_parity(device: torch.device, folder: Path) -> Result:
    from transformers import MistralForCausalLM

    write_checkpoint(folder, PARITY_CONFIG, seed=7, init_std=0.2, tokenizer=False)
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    ours, cfg = load_model(folder, dtype=torch.float32, device=str(device))
    hf = MistralForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(3, 97, (44,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0].float()  # [44, V]
    bs = 4
    kv = allocate_kv_cache(cfg, 16, bs, torch.float32, device)
    table = torch.arange(1, 13, device=device)[None]  # [1, 12] blocks: 48 positions

    def step(start: int, new: list[int]) -> torch.Tensor:
        n = len(new)
        pos = torch.arange(start, start + n, device=device)
        group = AttnGroup(
            token_index=torch.arange(n, device=device)[None],
            block_tables=table,
            context_lens=torch.tensor([start + n], device=device),
            query_start=torch.tensor([start], device=device),
        )
        batch = ForwardBatch(
            input_ids=torch.tensor(new, device=device),
            positions=pos,
            slot_mapping=table[0, pos // bs] * bs + pos % bs,
            groups=(group,),
        )
        with torch.inference_mode():
            return ours.compute_logits(ours(batch, kv)).cpu()

    got = [step(0, ids[:40])] + [step(40 + i, [ids[40 + i]]) for i in range(4)]
    diff = (torch.cat(got) - expected).abs().max().item()
    return Result("parity", diff < 1e-4, f"max |ours - transformers| = {diff:.2e} (limit 1e-4)")


def _engine(model_dir: Path, device: torch.device, dtype: str, **kw: object) -> EngineCore:
    cfg = EngineConfig(
        model_dir=str(model_dir),
        device=str(device),
        dtype=dtype,
        threads=max(1, torch.get_num_threads()),
        max_model_len=2048,
        **kw,  # type: ignore[arg-type]
    )
    return EngineCore(cfg, model_dir)


def check_engine(core: EngineCore, batches: tuple[int, ...] = (8, 32)) -> Result:
    """Median decode step (whole EngineCore.step) per batch size, 32-token prompts."""
    rng = random.Random(0)
    parts = []
    for b in batches:
        for i in range(b):
            core.add(
                EngineRequest(
                    request_id=f"bench{b}-{i}",
                    prompt_token_ids=tuple(rng.randrange(3, 500) for _ in range(32)),
                    sampling=SamplingParams(max_tokens=24, ignore_eos=True),
                )
            )
        steps = []
        while core.has_work():
            t0 = time.perf_counter()
            core.step()
            _sync(core.runner.device)
            steps.append(time.perf_counter() - t0)
        med = statistics.median(steps[2:])
        parts.append(f"batch {b}: decode step {med * 1e3:.2f} ms ({b / med:.0f} tok/s)")
    return Result("engine", True, "; ".join(parts))


def check_graphs(core: EngineCore, max_seqs: int = 32, max_ladder: int = 4) -> Result:
    """Capture the decode forward + head per decode bucket on static buffers; replay must
    equal eager. On CPU the same static-buffer replay runs without a graph."""
    runner = core.runner
    dev = runner.device
    checked, worst = 0, 0.0
    for g in [s for s in runner.config.seq_buckets if s <= max_seqs]:
        for b in runner.blocks_ladder[:max_ladder]:
            key = ("attn", g, 1, b)
            group = runner._null_group(key, g)
            tables = torch.randint(1, runner.layout.num_blocks, (g, b), device=dev)
            ctx = torch.full((g,), 8 * b, dtype=torch.long, device=dev)  # half the blocks
            group = AttnGroup(group.token_index, tables, ctx, ctx - 1)
            batch = ForwardBatch(
                input_ids=torch.randint(3, runner.mcfg.vocab_size, (g,), device=dev),
                positions=group.query_start.clone(),
                slot_mapping=torch.zeros(g, dtype=torch.long, device=dev),  # null block
                groups=(group,),
            )

            def forward(batch: ForwardBatch = batch) -> torch.Tensor:
                return runner.model.compute_logits(runner.model(batch, runner.kv_caches))

            with torch.inference_mode():
                eager = forward().clone()
                replay = _capture(forward, dev)
                got = replay()
                _sync(dev)
            worst = max(worst, (got - eager).abs().max().item())
            checked += 1
    kind = "CUDA graphs" if dev.type == "cuda" else "static replays (CPU: no graph)"
    return Result(
        "graphs",
        worst == 0.0,
        f"{checked} decode buckets, {kind}; max |replay - eager| = {worst:.2e}",
    )


def _capture(fn: Callable[[], torch.Tensor], device: torch.device) -> Callable[[], torch.Tensor]:
    if device.type != "cuda":
        return fn
    stream = torch.cuda.Stream(device)  # pragma: no cover - needs a GPU
    stream.wait_stream(torch.cuda.current_stream(device))  # pragma: no cover
    with torch.cuda.stream(stream):  # pragma: no cover
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)  # pragma: no cover
    graph = torch.cuda.CUDAGraph()  # pragma: no cover
    with torch.cuda.graph(graph):  # pragma: no cover
        out = fn()

    def replay() -> torch.Tensor:  # pragma: no cover
        graph.replay()
        return out

    return replay  # pragma: no cover


def check_allocator(core: EngineCore, requests: int = 300) -> Result:
    core.warmup()
    before = core.stats()
    allocs = core.runner.device_allocations()
    rng = random.Random(11)
    for i in range(requests):
        n = rng.randint(4, 600)
        core.add(
            EngineRequest(
                request_id=f"a{i}",
                prompt_token_ids=tuple(rng.randrange(3, 500) for _ in range(n)),
                kind=RequestKind.GENERATE if i % 3 else RequestKind.SCORE,
                top_k=3,
                sampling=SamplingParams(max_tokens=rng.randint(1, 32), ignore_eos=True),
            )
        )
        if i % 50 == 49:
            for _ in range(10):
                core.step()
    while core.has_work():
        core.step()
    after = core.stats()
    new_allocs = core.runner.device_allocations() - allocs
    retries = after.allocator.num_alloc_retries - before.allocator.num_alloc_retries
    escaped = sorted(core.runner.shapes.after_warmup, key=str)
    ok = new_allocs == 0 and retries == 0 and not escaped
    what = "device allocations" if core.runner.device.type == "cuda" else "KV allocations (CPU)"
    return Result(
        "allocator",
        ok,
        f"{requests} requests after warm-up: {new_allocs} new {what}, {retries} alloc retries, "
        f"{len(escaped)} escaped shapes {escaped[:3]}",
    )


def run_checks(device: torch.device, model_dir: Path | None, only: set[str]) -> list[Result]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        if "parity" in only:
            results.append(check_parity(device, Path(tmp) / "parity"))
        if model_dir is None:
            from tailguard.model.synth import synth

            model_dir = synth("m", Path(tmp) / "m")
        dtype = "bfloat16" if device.type == "cuda" else "auto"
        if "engine" in only:
            results.append(check_engine(_engine(model_dir, device, dtype)))
        if "graphs" in only:
            results.append(check_graphs(_engine(model_dir, device, dtype, warmup=False)))
        if "allocator" in only:
            results.append(check_allocator(_engine(model_dir, device, dtype)))
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: synth m)")
    ap.add_argument("--only", default="parity,engine,graphs,allocator")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CHECK cuda      FAIL  torch.cuda.is_available() is False on this machine")
        return 1
    t0 = time.monotonic()
    results = run_checks(device, args.model, set(args.only.split(",")))
    for r in results:
        print(r.line(), flush=True)
    passed = sum(r.ok for r in results)
    print(f"gpu checks: {passed}/{len(results)} passed in {time.monotonic() - t0:.0f} s")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
