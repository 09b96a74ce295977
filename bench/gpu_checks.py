"""The checks `bench/gpu_check.sh` runs on a CUDA machine; each prints one summary line.

    python bench/gpu_checks.py --device cuda [--model DIR] [--only parity,graphs,...]

  parity     our fp32 logits on the device vs transformers fp32 on CPU, same seeded weights
             (prefill of 40 tokens, then 4 decode steps through the paged cache); TF32 off
  warmup     (always, with the three below) the engine's warm-up on --model (default: synth
             preset m, bf16): every bucket, one CUDA graph per decode bucket, headroom; timed
  allocator  after warm-up, 300 random requests (greedy, temperature, top-p, scoring): no
             device allocation (`num_device_alloc` delta from torch.cuda.memory_stats()), no
             allocator retry, no escaped op shape; the first steps that allocate are named
  engine     decode step time at batch 8 and 32, graphs against eager on the same engine
  graphs     the captured decode graphs replayed on random inputs against the same forward
             run eagerly on the same static buffers

Everything here also runs on CPU (tests/engine/test_gpu_checks.py does, on a tiny model): on
CPU the engine runs `decode_graphs="static"`: the graphs' buffers and forward, no capture.
Exit status 1 if any fails.
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
from tailguard.engine.allocator import configure_cuda_allocator
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


def check_warmup(core: EngineCore) -> Result:
    """Warm-up (every bucket, the decode graphs, the allocator headroom), timed."""
    t0 = time.perf_counter()
    core.warmup()
    secs = time.perf_counter() - t0
    r = core.runner
    want_graphs = r.device.type == "cuda" or r.config.decode_graphs == "static"
    n = 0 if r.graphs is None else len(r.graphs.keys)
    return Result(
        "warmup",
        n > 0 or not want_graphs,
        f"{secs:.1f} s ({', '.join(f'{k} {v:.1f} s' for k, v in r.warmup_phases.items())}); "
        f"{n} decode graphs captured in {r.graph_capture_s:.1f} s; "
        f"allocator headroom {r.headroom_bytes >> 20} MiB",
    )


def check_engine(core: EngineCore, batches: tuple[int, ...] = (8, 32)) -> Result:
    """Median decode step (whole EngineCore.step) per batch size, 32-token prompts, with the
    decode graphs and without them (the same engine, graphs set aside), side by side."""
    graphs = core.runner.graphs
    parts = []
    for b in batches:
        eager = _decode_step_s(core, b, f"e{b}", use_graphs=False)
        replay = _decode_step_s(core, b, f"g{b}", use_graphs=True) if graphs else float("nan")
        parts.append(
            f"batch {b}: decode step eager {eager * 1e3:.2f} ms ({b / eager:.0f} tok/s), "
            f"graphs {replay * 1e3:.2f} ms ({b / replay:.0f} tok/s), {eager / replay:.2f}x"
        )
    return Result("engine", graphs is not None or core.runner.device.type != "cuda",
                  "; ".join(parts))  # fmt: skip


def _decode_step_s(core: EngineCore, batch: int, tag: str, use_graphs: bool) -> float:
    runner = core.runner
    graphs = runner.graphs
    if not use_graphs:
        runner.graphs = None
    try:
        rng = random.Random(0)
        for i in range(batch):
            core.add(
                EngineRequest(
                    request_id=f"bench-{tag}-{i}",
                    prompt_token_ids=tuple(rng.randrange(3, 500) for _ in range(32)),
                    sampling=SamplingParams(max_tokens=24, ignore_eos=True),
                )
            )
        steps = []
        while core.has_work():
            t0 = time.perf_counter()
            core.step()
            _sync(runner.device)
            steps.append(time.perf_counter() - t0)
        return statistics.median(steps[2:])
    finally:
        runner.graphs = graphs


def check_graphs(core: EngineCore, max_seqs: int = 32, max_ladder: int = 4) -> Result:
    """Each decode graph warm-up captured (G up to `max_seqs`, the first `max_ladder` block
    buckets), replayed on random inputs, against the same forward run eagerly on the same
    static buffers. On CPU (`decode_graphs="static"`) the replay is the forward itself."""
    runner = core.runner
    graphs = runner.graphs
    if graphs is None:
        return Result("graphs", False, "no decode graphs were captured")
    dev = runner.device
    checked, worst = 0, 0.0
    timed: dict[int, tuple[float, float]] = {}
    rng = random.Random(3)
    for g in [s for s in graphs.seq_buckets if s <= max_seqs]:
        for b in graphs.ladder[:max_ladder]:
            ctx = [rng.randint(1, 16 * b) for _ in range(g)]
            tables = [
                [rng.randrange(1, runner.layout.num_blocks) for _ in range(b)] for _ in range(g)
            ]
            ids = [rng.randrange(3, runner.mcfg.vocab_size) for _ in range(g)]
            slots = [0] * g  # the null block's first slot
            graphs.load(g, b, ids, [c - 1 for c in ctx], slots, ctx, tables)
            eager_fn = graphs.forward_fn(g, b)
            replay = graphs._replay[(g, b)]
            with torch.inference_mode():
                eager_fn()
                _sync(dev)
                eager = graphs.logits[:g].clone()
                graphs.logits.zero_()
                replay()
                _sync(dev)
                got = graphs.logits[:g].clone()
                if b == graphs.ladder[0] and g in (8, 32):
                    timed[g] = (_median_ms(eager_fn, dev), _median_ms(replay, dev))
            worst = max(worst, (got.float() - eager.float()).abs().max().item())
            checked += 1
    kind = "CUDA graphs" if graphs.mode.value == "cuda" else "static replays (no graph)"
    times = "".join(f"; G={g}: eager {e:.2f} ms, replay {r:.2f} ms" for g, (e, r) in timed.items())
    return Result(
        "graphs",
        checked > 0 and worst == 0.0,
        f"{checked} decode buckets, {kind}; max |replay - eager| = {worst:.2e}{times}",
    )


def _median_ms(fn: Callable[[], object], device: torch.device, n: int = 10) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _segments(device: torch.device) -> tuple[int, int]:
    """(small-pool, large-pool) segments the caching allocator holds; (0, 0) on CPU."""
    if device.type != "cuda":
        return (0, 0)
    st = torch.cuda.memory_stats(device)  # pragma: no cover - needs a GPU
    return (  # pragma: no cover
        int(st.get("segment.small_pool.current", 0)),
        int(st.get("segment.large_pool.current", 0)),
    )


def check_allocator(core: EngineCore, requests: int = 300) -> Result:
    """After warm-up (done by the caller), `requests` random prompts of 4-600 tokens, a third
    prompt scoring: no new device allocation. Each step that allocates is named."""
    runner = core.runner
    before = core.stats()
    allocs = runner.device_allocations()
    grew: list[str] = []
    steps = 0

    def step() -> None:
        nonlocal steps
        n0, seg0 = runner.device_allocations(), _segments(runner.device)
        core.step()
        steps += 1
        if runner.device_allocations() > n0 and len(grew) < 4:
            seg1 = _segments(runner.device)
            grew.append(
                f"step {steps} shape {runner.last_shape} +{runner.device_allocations() - n0} "
                f"(small +{seg1[0] - seg0[0]}, large +{seg1[1] - seg0[1]})"
            )

    rng = random.Random(11)
    for i in range(requests):
        n = rng.randint(4, 600)
        core.add(
            EngineRequest(
                request_id=f"a{i}",
                prompt_token_ids=tuple(rng.randrange(3, 500) for _ in range(n)),
                kind=RequestKind.GENERATE if i % 3 else RequestKind.SCORE,
                top_k=3,
                sampling=SamplingParams(
                    max_tokens=rng.randint(1, 32),
                    ignore_eos=True,
                    temperature=0.0 if i % 2 else 0.8,
                    top_p=0.9 if i % 5 == 0 else 1.0,
                ),
            )
        )
        if i % 50 == 49:
            for _ in range(10):
                step()
    while core.has_work():
        step()
    after = core.stats()
    new_allocs = runner.device_allocations() - allocs
    retries = after.allocator.num_alloc_retries - before.allocator.num_alloc_retries
    escaped = sorted(runner.shapes.after_warmup, key=str)
    ok = new_allocs == 0 and retries == 0 and not escaped
    what = "device allocations" if runner.device.type == "cuda" else "KV allocations (CPU)"
    where = f"; {'; '.join(grew)}" if grew else ""
    return Result(
        "allocator",
        ok,
        f"{requests} requests, {steps} steps after warm-up ({runner.graph_steps} on graphs): "
        f"{new_allocs} new {what}, {retries} alloc retries, "
        f"{len(escaped)} escaped shapes {escaped[:3]}{where}",
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
        if only & {"engine", "graphs", "allocator"}:
            # one engine, warmed once: the allocator check first, from the warm state
            graphs = "auto" if device.type == "cuda" else "static"
            core = _engine(model_dir, device, dtype, decode_graphs=graphs)
            results.append(check_warmup(core))
            if "allocator" in only:
                results.append(check_allocator(core))
            if "engine" in only:
                results.append(check_engine(core))
            if "graphs" in only:
                results.append(check_graphs(core))
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: synth m)")
    ap.add_argument("--only", default="parity,allocator,engine,graphs")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        # the allocator settings the engine process serves with (engine/process.py), set
        # before CUDA initialises: the allocator check measures what is served
        configure_cuda_allocator()
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
