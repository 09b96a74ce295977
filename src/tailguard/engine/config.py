"""Engine configuration: typed, validated at construction, never mutated afterwards."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tailguard.errors import ConfigError


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def default_engine_threads() -> int:
    """The cores available, less one for the HTTP front-end process that shares the machine.

    Measured on 2 cores under a 10,000-connection burst (docs/bench-notes/server.md): with both
    cores the engine's OpenMP threads fight the front end and a 25 ms forward took 500-670 ms;
    with one thread, 180 ms. Single-process uses (`tailguard generate`, engine benchmarks) pass
    `threads=available_cores()`.
    """
    return max(1, available_cores() - 1)


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str | None = None
    """Checkpoint folder (config.json + safetensors + tokenizer); None: the embedded model."""
    dtype: str = "auto"
    """auto (bf16 where the CPU supports it, else fp32; CUDA: bf16), float32, bfloat16, float16."""
    device: str = "cpu"
    """cpu or cuda[:N]."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    kv_cache_bytes: int = 256 * 1024 * 1024
    """KV pool size in bytes (CPU). The pool is allocated once at start-up."""
    kv_cache_memory_fraction: float = 0.85
    """CUDA: fraction of free device memory (after a warm-up at the largest bucket) for the pool."""
    max_num_seqs: int = 256
    """Most sequences in one forward pass. Large: decode steps are bound by the output-head
    matmul, which runs far more efficiently on 256 rows than on 64."""
    max_num_batched_tokens: int = 1024
    """Per-step token budget (prefill chunks + decodes). Bounds the step time, which bounds how
    long any admitted request waits for the next step: 30-50 ms measured for the embedded
    model in fp32 on 2 cores."""
    max_model_len: int | None = None
    """Longest prompt + output; None: the model's max_position_embeddings."""
    seq_buckets: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, *range(32, 257, 8))
    """Sequence-count buckets: the output head runs on this many rows, and a group of
    sequences attends as this many; the last must be >= max_num_seqs. Steps of 8 from 32 (as
    vLLM's CUDA-graph sizes): with the 1.5x steps before session 22 a 65-sequence decode of the
    embedded model ran its head on 96 rows and attended as 128, and took 26.9 ms against
    17.9 ms at 64 (20.1 ms with steps of 8 and groups padded to them)."""
    token_buckets: tuple[int, ...] = (
        1, 2, 4, 8, 16, 24, *range(32, 257, 8), *range(288, 513, 32), *range(576, 1025, 64)
    )  # fmt: skip
    """Token-count buckets; the last must be >= max_num_batched_tokens. Small buckets matter:
    a decode step of S sequences runs every projection on T rows, and on CPU small-row
    matmuls cost about in proportion to the rows, so padding a batch-8 decode to 16 rows
    nearly doubled its matmul time (docs/benchmarks.md, issue 12). Steps of 8 up to 256, then
    at most 12.5% (32 to 512, 64 to 1024): a decode step's tokens are its sequences plus the
    prompts joining it, and the 1.5x steps of sessions 20-21 ran a 65-sequence decode on 96
    rows of every projection."""
    threads: int = field(default_factory=default_engine_threads)
    """Intra-op threads in the engine process (every other process uses 1). Default: the cores
    available less one, which the HTTP front end needs under load."""
    nice: int = -5
    """Scheduling niceness of the engine process (-20..19). Negative lets its steps preempt the
    HTTP process and co-located clients when cores are contended; needs CAP_SYS_NICE (root),
    else the engine keeps the default priority and logs why."""
    max_restarts: int = 3
    """Engine process restarts before the server gives up (stays not-ready)."""
    seed: int = 0
    """Seed of the sampling generator for requests without a `seed` of their own (the same
    seed and the same requests in the same order sample the same tokens)."""
    warmup: bool = True
    """Run every bucket shape once before reporting ready."""
    prepack_weights: bool = True
    """CPU: reorder every weight once into oneDNN's blocked layout (fp32/bf16). Measured on 2
    cores, 246M-parameter model in bf16: decode step at batch 8 80 -> 63 ms, same tokens."""
    small_m_kernel: bool = True
    """CPU fp32: hold every projection and the output head in our own kernel's layout
    (model/kernels/gemv.c, compiled at first use with the system C compiler into
    ~/.cache/tailguard/kernels) and run every matmul on it: at decode sizes (up to ~64 rows)
    it streams the weights at about the read bandwidth where oneDNN's fp32 kernel reaches
    50-75% of it; above that its prefill step measured the same as oneDNN's (one copy). CPU
    bf16 on AVX512-BF16 without AMX (AMD Zen 4): the same with model/kernels/gemv_bf16.c, 1.1-2x
    oneDNN's bf16 speed at 1-8 rows, equal at 256 (with AMX oneDNN's tiles stay). Without a
    compiler, or if the build or its self-check fails, the engine logs one line saying why and
    uses oneDNN (`prepack_weights`). False: oneDNN only (A/B)."""
    row_kernels: bool = True
    """CPU: greedy argmax and temperature sampling (rows without top-p) over the step's logits,
    and (fp32) decode attention read straight from the paged cache, RMSNorm, RoPE and the
    MLP's silu(gate) * up, in our own compiled passes
    (model/kernels/rows.c, built like the small-M kernel): on 44 rows of the embedded model's
    32,000 logits 0.3 ms against torch's 2.5 ms (argmax) and 0.75 ms against 5.6-17 ms
    (sampling); the 246M model's batch-8 decode step 44.8-45.0 -> 39.1-41.5 ms.
    Same uniforms, same distribution, same greedy tokens; falls back to torch with one log line
    when it cannot be built. False: torch only (A/B)."""
    fused_decode: bool = True
    """CPU, with our linear kernel (fp32, or bf16 without AMX) and the row kernels: a pure
    decode step's whole decoder stack in one compiled call (model/kernels/decode.c, or
    decode_bf16.c: every layer's norms, matmuls, RoPE, KV write, decode attention and
    residuals in one OpenMP region) instead of ~13 torch and ctypes calls a layer. Same
    kernels, same tokens. False: op by op (A/B)."""
    decode_graphs: str = "auto"
    """Decode steps replayed from graphs captured at warm-up, one per decode bucket (sequence
    bucket x block bucket; engine/graphs.py). auto: CUDA graphs on CUDA, none on CPU (no
    graphs there: the launch cost they remove is a GPU's). off: every step eager (A/B).
    static: the graphs' static buffers without a capture, on any device (tests). Measured on
    an H200, 246M model: a decode forward at 8 sequences 13.8 ms eager, 1.8 ms replayed."""
    oom_test_hook: str | None = None
    """Tests only: request ids (comma-separated) whose batches raise OutOfMemoryError."""

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            f"dtype={self.dtype!r}: use auto, float32, bfloat16 or float16",
        )
        need(
            self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
            f"block_size={self.block_size}: must be a power of two, e.g. 16",
        )
        need(self.kv_cache_bytes > 0, f"kv_cache_bytes={self.kv_cache_bytes}: must be positive")
        need(
            0.0 < self.kv_cache_memory_fraction <= 0.95,
            f"kv_cache_memory_fraction={self.kv_cache_memory_fraction}: must be in (0, 0.95]",
        )
        need(self.max_num_seqs >= 1, f"max_num_seqs={self.max_num_seqs}: must be >= 1")
        need(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"max_num_batched_tokens={self.max_num_batched_tokens} < max_num_seqs="
            f"{self.max_num_seqs}: every running sequence needs a token per step; raise the budget",
        )
        need(
            list(self.seq_buckets) == sorted(set(self.seq_buckets)) and self.seq_buckets[0] >= 1,
            f"seq_buckets={self.seq_buckets}: must be strictly increasing positive sizes",
        )
        need(
            list(self.token_buckets) == sorted(set(self.token_buckets)),
            f"token_buckets={self.token_buckets}: must be strictly increasing",
        )
        need(
            self.seq_buckets[-1] >= self.max_num_seqs,
            f"seq_buckets end at {self.seq_buckets[-1]} < max_num_seqs={self.max_num_seqs}: "
            "add a bucket or lower max_num_seqs",
        )
        need(
            self.token_buckets[-1] >= self.max_num_batched_tokens,
            f"token_buckets end at {self.token_buckets[-1]} < max_num_batched_tokens="
            f"{self.max_num_batched_tokens}: add a bucket or lower the budget",
        )
        need(
            self.decode_graphs in ("auto", "off", "static"),
            f"decode_graphs={self.decode_graphs!r}: use auto, off or static",
        )
        need(self.threads >= 1, f"threads={self.threads}: must be >= 1")
        need(-20 <= self.nice <= 19, f"nice={self.nice}: must be in -20..19")
        need(self.max_restarts >= 0, f"max_restarts={self.max_restarts}: must be >= 0")
