"""The tokenizer the HTTP process uses (tokenization happens here, never in the engine).

The real one comes from `tailguard.model.tokenizer.load_tokenizer` (SentencePiece / Tekken via
mistral-common; no torch). The stub and simulated engines, when no `--model` is given, use
`SimpleTokenizer`: UTF-8 bytes shifted by 3 (0 pad, 1 BOS, 2 EOS), so server tests need neither a
checkpoint nor a tokenizer file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tailguard.model.tokenizer import Tokenizer

__all__ = ["ModelInfo", "SimpleTokenizer", "load_model_info"]


class SimpleTokenizer:
    """Byte-level tokenizer for model-free engines (ids 3..258 are the bytes 0..255)."""

    bos_id = 1
    eos_id = 2
    vocab_size = 259

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [b + 3 for b in text.encode("utf-8")]
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        # Mistral's v1 layout, good enough for a model-free engine.
        text = "".join(
            f"[INST] {m['content']} [/INST]" if m["role"] != "assistant" else f" {m['content']}"
            for m in messages
        )
        return self.encode(text)


@dataclass(frozen=True)
class ModelInfo:
    """The served model as the HTTP process knows it: its tokenizer. Its context length is the
    engine's (`EngineClientProtocol.max_model_len`, reported at start-up)."""

    tokenizer: Tokenizer
    model_dir: str | None  # None: no checkpoint (simple tokenizer)


def load_model_info(model_dir: str | None, *, need_model: bool) -> ModelInfo:
    """The served model's tokenizer: the checkpoint's (the embedded model's when `model_dir` is
    None and a model is needed), else (stub and simulated engines, no model_dir) the simple
    byte tokenizer."""
    if model_dir is None and not need_model:
        return ModelInfo(SimpleTokenizer(), None)
    from tailguard.model.tokenizer import load_tokenizer

    if model_dir is None:
        from tailguard.model.embedded import default_model_dir

        model_dir = str(default_model_dir())
    return ModelInfo(load_tokenizer(Path(model_dir)), model_dir)
