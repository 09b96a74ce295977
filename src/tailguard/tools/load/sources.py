"""Request bodies: one per request, different for every request unless a dataset runs out.

    BodySource(cfg).body(i) -> Body(url, data, planned input/output tokens)
    ├── default   the --prompt text with a per-run nonce and the request number appended
    ├── dataset   --dataset FILE: JSONL of request bodies, or OpenAI Batch input lines
    │             ({"custom_id", "method": "POST", "url", "body"}: the `tailguard batch` file);
    │             a run longer than the file cycles through it (and says so)
    └── random    --random-input-len N[:M]: prompts of token ids (exact lengths; completions
                  accept token-id prompts), or text decoded from a tokenizer's vocabulary for
                  chat; sizes drawn per request from Random(seed, i), so body i is the same
                  whatever order requests are built in
    --random-output-len N[:M] sets max_tokens per request with ignore_eos (fixed output lengths);
    --stream adds "stream": true and stream_options.include_usage (token counts from the server).

The tokenizer (`--tokenizer DIR|embedded`) is imported only when given: tailguard.model.tokenizer
loads tokenizers without torch, and nothing here imports the engine.
"""

from __future__ import annotations

import copy
import random
import secrets
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from tailguard.errors import ConfigError
from tailguard.tools.load.config import ENDPOINT_PATHS, LoadConfig, endpoint_body

__all__ = ["Body", "BodySource", "read_dataset", "server_vocab"]

# Token ids every tokenizer has without a vocabulary file: SimpleTokenizer's bytes (3..258),
# and the byte-fallback tokens of SentencePiece vocabularies (<0x00>..<0xFF>).
BYTE_IDS = (3, 259)
_GENERATING = ("/v1/completions", "/v1/chat/completions")


class _Tokenizer(Protocol):
    vocab_size: int

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class Body:
    url: str  # where it is posted
    data: bytes  # the JSON body
    input_tokens: int | None  # planned prompt tokens (None: not known before the server counts)
    output_tokens: int | None  # planned max_tokens (with ignore_eos: the exact output length)


@dataclass(frozen=True)
class _Line:
    path: str | None  # an OpenAI Batch line's url; None: the run's --endpoint
    body: dict[str, Any]


def read_dataset(path: Path) -> list[_Line]:
    """Every non-blank line: a request body, or an OpenAI Batch input line (custom_id, url)."""
    from tailguard.tools.batch.inputs import URLS  # the same file drives tailguard batch

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--dataset {path}: cannot read ({exc.strerror})") from exc
    lines: list[_Line] = []
    for n, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"--dataset {path} line {n}: not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"--dataset {path} line {n}: expected a JSON object")
        if "custom_id" in obj and "body" in obj:
            url, body = obj.get("url"), obj.get("body")
            if obj.get("method", "POST") != "POST" or url not in URLS or not isinstance(body, dict):
                raise ConfigError(
                    f"--dataset {path} line {n}: a Batch line needs method POST, url one of "
                    f"{', '.join(URLS)} and a JSON object body"
                )
            lines.append(_Line(url, body))
        else:
            lines.append(_Line(None, obj))
    if not lines:
        raise ConfigError(f"--dataset {path}: no request bodies in it")
    return lines


def _load_tokenizer(spec: str) -> _Tokenizer:
    from tailguard.model.tokenizer import load_tokenizer  # no torch (see module docstring)

    if spec == "embedded":
        from tailguard.model.embedded import default_model_dir

        return load_tokenizer(default_model_dir())
    return load_tokenizer(Path(spec))


class BodySource:
    """Builds body i on demand; `prepare(n)` builds the first n before the clock starts."""

    def __init__(self, cfg: LoadConfig, *, nonce: str | None = None) -> None:
        self.cfg = cfg
        self.spec = cfg.source
        self.nonce = nonce or secrets.token_hex(3)
        self.base = cfg.url.rstrip("/")
        self.lines = read_dataset(Path(self.spec.dataset)) if self.spec.dataset else None
        self.tokenizer = _load_tokenizer(self.spec.tokenizer) if self.spec.tokenizer else None
        self.id_range = BYTE_IDS
        if self.tokenizer is not None and self.tokenizer.vocab_size > 1000:
            self.id_range = (BYTE_IDS[1], self.tokenizer.vocab_size)  # past specials and bytes
        self.server_vocab: int | None = None  # what the server's /v1/models says, when asked
        self._vocab_asked = False
        self._built: list[Body] = []

    def at_offset(self, offset: int) -> BodySource:
        """The same bodies continued from body `offset` (a sweep's next step); shares the
        dataset, tokenizer and nonce, so no body repeats across steps."""
        from dataclasses import replace

        other = copy.copy(self)
        other.cfg = replace(self.cfg, body_offset=offset)
        other._built = []
        return other

    # ---- the server's vocabulary -----------------------------------------------------------
    @property
    def draws_token_ids(self) -> bool:
        """Random prompts sent as token ids (every endpoint but chat, which gets text)."""
        return self.spec.input_len is not None and self.cfg.endpoint != "chat"

    async def ask_server_vocab(self) -> None:
        """Before the first body: read the server's vocabulary size from GET /v1/models
        (tailguard lists `vocab_size`; servers that do not are left to --tokenizer) and keep
        the drawn ids inside it. Once per source; a sweep's steps share the answer."""
        if self._vocab_asked or not self.draws_token_ids:
            return
        self.fit_server_vocab(await server_vocab(self.cfg))

    def fit_server_vocab(self, vocab: int | None) -> None:
        """Token ids from the server's vocabulary when the tokenizer's (or the byte ids) reach
        past it: a --tokenizer that is not the server's model's must not make every request
        a 400 ("token id ... is outside the vocabulary")."""
        self._vocab_asked = True
        self.server_vocab = vocab
        if vocab is None or self.id_range[1] <= vocab:
            return
        if vocab > 1000:  # a real vocabulary: past its specials and byte tokens
            self.id_range = (BYTE_IDS[1], vocab)
        else:  # a byte tokenizer (259) or smaller
            self.id_range = (min(BYTE_IDS[0], vocab - 1), min(BYTE_IDS[1], vocab))
        self._built = []

    # ---- what the header says --------------------------------------------------------------
    @property
    def distinct(self) -> int | None:
        """How many different bodies exist; None when every request gets its own."""
        if self.cfg.body is not None:
            return 1
        return len(self.lines) if self.lines is not None else None

    def repeats(self, total: int) -> bool:
        return self.distinct is not None and total > self.distinct

    def describe(self, total: int | None = None) -> str:
        s = self.spec
        out = ""
        if s.output_len is not None:
            out = f", output {_span(s.output_len)} tokens (ignore_eos)"
        if self.cfg.body is not None:
            return "--body FILE: ONE BODY REPEATED for every request"
        if self.lines is not None:
            n = len(self.lines)
            rep = ""
            if total is not None and total > n:
                rep = f"; BODIES REPEAT: {total:,} requests cycle through {n:,} bodies"
            return f"dataset {s.dataset} ({n:,} bodies{out}){rep}"
        if s.input_len is not None:
            unit = "tokens"
            if self.cfg.endpoint == "chat":
                unit = "tokens of text" if self.tokenizer is not None else "words (approximate)"
            ids = ""
            if self.draws_token_ids and self.server_vocab is not None:
                lo, hi = self.id_range
                ids = f", ids {lo}-{hi - 1} of the server's vocabulary ({self.server_vocab:,})"
            return (
                f"random prompts, input {_span(s.input_len)} {unit}{out}{ids}, seed {s.seed}; "
                "every body different"
            )
        return f"--prompt with a per-request suffix (nonce {self.nonce}){out}; every body different"

    def to_dict(self) -> dict[str, object]:
        s = self.spec
        return {
            "kind": s.kind,
            "dataset": s.dataset,
            "input_len": list(s.input_len) if s.input_len else None,
            "output_len": list(s.output_len) if s.output_len else None,
            "tokenizer": s.tokenizer,
            "seed": s.seed,
            "nonce": self.nonce if s.kind == "default" else None,
            "distinct_bodies": self.distinct,
            "token_ids": list(self.id_range) if self.draws_token_ids else None,
            "server_vocab": self.server_vocab,
        }

    # ---- bodies ------------------------------------------------------------------------------
    def prepare(self, n: int) -> None:
        while len(self._built) < n:
            self._built.append(self._build(len(self._built)))

    def body(self, i: int) -> Body:
        """Body of the run's i-th request (counting from the config's body_offset)."""
        return self._built[i] if i < len(self._built) else self._build(i)

    def _build(self, i: int) -> Body:
        cfg, s = self.cfg, self.spec
        k = cfg.body_offset + i
        rng = random.Random((s.seed << 32) ^ k)
        out_len = _draw(rng, s.output_len) if s.output_len else None
        if self.lines is not None:
            line = self.lines[k % len(self.lines)]
            obj = dict(line.body)
            path = line.path or ENDPOINT_PATHS[cfg.endpoint]
            url = cfg.target_url
            if line.path is not None:  # a Batch line names its endpoint
                url = (_origin(cfg.url) if cfg.endpoint == "raw" else self.base) + line.path
            in_len = None
        else:
            path = ENDPOINT_PATHS[cfg.endpoint]
            url = cfg.target_url
            if s.input_len is not None:
                in_len = _draw(rng, s.input_len)
                obj = self._random_body(rng, in_len)
                if cfg.endpoint == "chat":
                    in_len = None  # text (and a chat template): the server's usage count tells
            else:
                in_len = None
                if cfg.body is not None:  # --body: the one fixed body the user asked for
                    return Body(url, cfg.body, None, None)
                obj = endpoint_body(cfg.endpoint, cfg.model, f"{cfg.prompt} [{self.nonce}-{k}]")
        if path in _GENERATING:
            if out_len is not None:
                obj["max_tokens"] = out_len
                obj["ignore_eos"] = True
            if cfg.stream:
                obj["stream"] = True
                obj["stream_options"] = {"include_usage": True}
            obj.setdefault("model", cfg.model)
            if out_len is None and isinstance(obj.get("max_tokens"), int):
                out_len = int(obj["max_tokens"])
        return Body(url, orjson.dumps(obj), in_len, out_len)

    def _random_body(self, rng: random.Random, n: int) -> dict[str, Any]:
        lo, hi = self.id_range
        ep, model = self.cfg.endpoint, self.cfg.model
        if ep == "chat":
            if self.tokenizer is not None:
                text = self.tokenizer.decode([rng.randrange(lo, hi) for _ in range(n)])
            else:
                text = " ".join(_word(rng) for _ in range(n))
            return {"model": model, "messages": [{"role": "user", "content": text}]}
        ids = [rng.randrange(lo, hi) for _ in range(n)]
        if ep == "completions":
            return {"model": model, "prompt": ids, "max_tokens": 16}
        if ep == "infer":
            return {"input_ids": ids, "top_k": 5}
        return {"model": model, "input": ids}  # embeddings


async def server_vocab(cfg: LoadConfig) -> int | None:
    """`vocab_size` of the run's model in the server's GET /v1/models (tailguard's extension of
    the OpenAI listing, next to vLLM's `max_model_len`); None when it has none or no answer."""
    import aiohttp

    url = _origin(cfg.url) + "/v1/models"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
            session.get(url, headers=dict(cfg.headers)) as resp,
        ):
            data = orjson.loads(await resp.read()) if resp.status == 200 else {}
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        return None
    models = [m for m in data.get("data", []) if isinstance(m, dict)]
    models.sort(key=lambda m: m.get("id") != cfg.model)  # the run's model first
    sizes = [m["vocab_size"] for m in models if isinstance(m.get("vocab_size"), int)]
    return sizes[0] if sizes and sizes[0] > 0 else None


def _draw(rng: random.Random, span: tuple[int, int]) -> int:
    lo, hi = span
    return lo if lo == hi else rng.randint(lo, hi)


def _span(span: tuple[int, int]) -> str:
    return f"{span[0]}" if span[0] == span[1] else f"{span[0]}-{span[1]}"


def _word(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7)))


def _origin(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"
