"""HTTP-process CPU per streamed token: is it flat in the generation's length? (issue 14)

Two measurements, each at 500 and 4,000 tokens, side by side in the same run:
- the detokenizer alone on the real tokenizer (the embedded model's SentencePiece v1): the
  incremental `GeneratedText` vs the old way (re-decode every id so far on every output, the
  baseline: what `_Text.add` did before issue 14);
- the whole request path in-process: a streamed /v1/completions answered by `App.handle` with
  an engine that sends one token per output (the real engine's streaming shape, no model), CPU
  time (`time.process_time`) of the HTTP process per token.

    .venv/bin/python bench/bench_stream.py [--repeat 3]

Target: CPU per token at 4,000 tokens within 1.2x of that at 500 (flat), where the old way
grows with the length (about 8x from 500 to 4,000).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from tailguard.core.request import EngineOutput, EngineRequest, FinishReason
from tailguard.model.embedded import mistral_v1_tokenizer_path
from tailguard.model.tokenizer import Tokenizer, load_tokenizer
from tailguard.server.app import App, Call
from tailguard.server.config import load_config
from tailguard.server.stub import StubEngineClient
from tailguard.server.text import GeneratedText
from tailguard.server.tokenizer import ModelInfo

TEXT = (
    "The quick brown fox jumps over the lazy dog. Streaming answers one token at a time, "
    "the server turns ids into text and checks the stop strings as they arrive. "
)
LENGTHS = (500, 4000)


def token_ids(tok: Tokenizer, n: int) -> list[int]:
    ids = tok.encode(TEXT, add_bos=False)
    return (ids * (n // len(ids) + 1))[:n]


def old_way(tok: Tokenizer, ids: list[int]) -> str:
    """The baseline: decode every id so far on every output (quadratic)."""
    seen: list[int] = []
    emitted = 0
    text = ""
    for t in ids:
        seen.append(t)
        text = tok.decode(seen)
        emitted = len(text)
    return text[:emitted]


def new_way(tok: Tokenizer, ids: list[int]) -> str:
    text = GeneratedText(tok, ["\n\n\n"])
    for i, t in enumerate(ids):
        text.add([t], i == len(ids) - 1)
    return text.text


def cpu_per_token(fn: object, tok: Tokenizer, ids: list[int], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        fn(tok, ids)  # type: ignore[operator]
        best = min(best, time.process_time() - t)
    return best / len(ids)


class OneTokenPerOutput(StubEngineClient):
    """The stub engine, streaming like the real one: one output per generated token."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__(max_model_len=2 * max(LENGTHS) + 64)
        self.ids = ids

    def outputs(self, request: EngineRequest) -> list[EngineOutput]:
        n = request.sampling.max_tokens
        return [
            EngineOutput(
                request_id=request.request_id,
                new_token_ids=[self.ids[i % len(self.ids)]],
                finished=i == n - 1,
                finish_reason=FinishReason.LENGTH if i == n - 1 else None,
                num_output_tokens=i + 1,
            )
            for i in range(n)
        ]


class Sink:
    """A Conn that keeps nothing (the socket's cost is not the detokenizer's)."""

    def send_response(self, call: Call, status: int, headers: object, body: bytes) -> None:
        pass

    def send_head(self, call: Call, status: int, headers: object) -> None:
        pass

    async def send_chunk(self, call: Call, data: bytes, more: bool) -> None:
        pass


async def request_cpu_per_token(tok: Tokenizer, n: int, repeat: int) -> float:
    engine = OneTokenPerOutput(token_ids(tok, n))
    cfg = load_config(None, {"engine": "stub", "sla_ms": 600_000, "max_deadline_ms": 600_000})
    app = App(cfg, engine, ModelInfo(tok, None))
    await engine.start()
    body = (
        b'{"prompt": "Hello", "max_tokens": %d, "stream": true, "ignore_eos": true, '
        b'"temperature": 0}' % n
    )
    best = float("inf")
    for _ in range(repeat):
        call = Call("POST", "/v1/completions", {}, body, "127.0.0.1", Sink())
        t = time.process_time()
        await app.handle(call)
        best = min(best, time.process_time() - t)
        assert call.outcome == "ok", call.outcome
    return best / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per figure (best is kept)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(mistral_v1_tokenizer_path(), Path(d) / "tokenizer.model.v1")
        tok = load_tokenizer(Path(d))
        rows = []
        for n in LENGTHS:
            ids = token_ids(tok, n)
            assert new_way(tok, ids) == old_way(tok, ids)  # the same text
            rows.append(
                (
                    n,
                    cpu_per_token(old_way, tok, ids, args.repeat),
                    cpu_per_token(new_way, tok, ids, args.repeat),
                    asyncio.run(request_cpu_per_token(tok, n, args.repeat)),
                )
            )
    print(f"{'tokens':>7} {'old detok us/tok':>17} {'new detok us/tok':>17} {'request us/tok':>15}")
    for n, old, new, req in rows:
        print(f"{n:>7} {old * 1e6:>17.1f} {new * 1e6:>17.1f} {req * 1e6:>15.1f}")
    (_, o1, n1, r1), (_, o2, n2, r2) = rows
    print(
        f"4000 vs 500 tokens, CPU per token: old detok {o2 / o1:.2f}x, new detok {n2 / n1:.2f}x, "
        f"whole request path {r2 / r1:.2f}x (flat = 1.0x; target <= 1.2x)"
    )
    print(f"new vs old detok at 4000 tokens: {o2 / n2:.1f}x less CPU per token")


if __name__ == "__main__":
    main()
