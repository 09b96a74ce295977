"""Tokenizers: one small protocol, two implementations, and `load_tokenizer(model_dir)`.

    MistralCommonTokenizer  tekken.json / tokenizer.model.v* / tokenizer.model, via mistral-common;
                            chat prompts through its ChatCompletionRequest (the reference format)
    HFTokenizer             tokenizer.json via the `tokenizers` package; chat prompts from the
                            `chat_template` in tokenizer_config.json or chat_template.jinja

No torch here: the HTTP process tokenizes every request. Measured on this machine (2-core AMD
EPYC): encoding a ~110-token English prompt takes ~38 us with the v1 SentencePiece model,
decoding it ~10 us (see docs/bench-notes/model.md).

Why not transformers' `LlamaTokenizerFast(vocab_file=...)`: in transformers 5.x it silently
encodes everything to [1]. Mistral's own files go through mistral-common; a tokenizer.json
goes through `tokenizers` directly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tailguard.errors import InvalidRequestError, ModelLoadError

__all__ = ["HFTokenizer", "MistralCommonTokenizer", "Tokenizer", "load_tokenizer"]

_ROLES = ("system", "user", "assistant")


@runtime_checkable
class Tokenizer(Protocol):
    bos_id: int
    eos_id: int
    vocab_size: int

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt ids for a chat (roles system/user/assistant), ready for the assistant's turn.

        Raises InvalidRequestError (HTTP 400) for a conversation the format cannot express.
        """
        ...


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """Pick the tokenizer a checkpoint folder ships.

    Mistral's own files win over tokenizer.json when both exist (as in mistralai's repos):
    mistral-common is the reference for their chat format.
    """
    model_dir = Path(model_dir)
    tekken = model_dir / "tekken.json"
    if tekken.is_file():
        return MistralCommonTokenizer(tekken)
    versioned = sorted(model_dir.glob("tokenizer.model.v*"), key=_version_key)
    if versioned:
        return MistralCommonTokenizer(versioned[-1])
    if (model_dir / "tokenizer.json").is_file():
        return HFTokenizer(model_dir)
    if (model_dir / "tokenizer.model").is_file():
        return MistralCommonTokenizer(model_dir / "tokenizer.model")
    raise ModelLoadError(
        f"no tokenizer in {model_dir}: expected tokenizer.json, tekken.json or "
        "tokenizer.model.v* (copy the tokenizer files from the model's repository)",
        param="tokenizer",
    )


def _version_key(path: Path) -> tuple[int, str]:
    match = re.search(r"\.v(\d+)$", path.name)
    return (int(match.group(1)) if match else -1, path.name)


class MistralCommonTokenizer:
    """Mistral's SentencePiece (`tokenizer.model.v*`) or Tekken (`tekken.json`) files."""

    def __init__(self, path: Path) -> None:
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        try:
            self._mistral = MistralTokenizer.from_file(str(path))
        except Exception as exc:  # mistral-common raises several unrelated types
            raise ModelLoadError(f"{path}: mistral-common cannot load it ({exc})") from exc
        self._raw = self._mistral.instruct_tokenizer.tokenizer
        self.path = path
        self.bos_id = int(self._raw.bos_id)
        self.eos_id = int(self._raw.eos_id)
        self.vocab_size = int(self._raw.n_words)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self._raw.encode(text, bos=add_bos, eos=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self._raw.decode(list(ids))  # special tokens (bos/eos/control) are dropped

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        from mistral_common.exceptions import MistralCommonException
        from mistral_common.protocol.instruct.messages import (
            AssistantMessage,
            SystemMessage,
            UserMessage,
        )
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
        parsed = [kinds[role](content=content) for role, content in _checked(messages)]
        try:
            request = ChatCompletionRequest(messages=parsed)
            return list(self._mistral.encode_chat_completion(request).tokens)
        except (MistralCommonException, ValueError) as exc:
            raise InvalidRequestError(
                f"messages cannot be formatted for this model: {exc}", param="messages"
            ) from exc


class HFTokenizer:
    """A Hugging Face `tokenizer.json` through the `tokenizers` package (Rust, fast)."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        file = model_dir / "tokenizer.json"
        try:
            self._tok = RustTokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception subclass
            raise ModelLoadError(f"{file}: cannot be loaded by `tokenizers` ({exc})") from exc
        self.path = file
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")
        model_cfg = _read_json(model_dir / "config.json")
        self.bos_id = self._special_id(tok_cfg, model_cfg, "bos", "<s>")
        self.eos_id = self._special_id(tok_cfg, model_cfg, "eos", "</s>")
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self._bos_text = self._tok.id_to_token(self.bos_id) or ""
        self._eos_text = self._tok.id_to_token(self.eos_id) or ""
        self._template_src = _chat_template(model_dir, tok_cfg)
        self._template: Any = None  # compiled on first use

    def _special_id(
        self, tok_cfg: dict[str, Any], model_cfg: dict[str, Any], kind: str, default: str
    ) -> int:
        token = tok_cfg.get(f"{kind}_token")
        if isinstance(token, dict):  # AddedToken serialised as {"content": "<s>", ...}
            token = token.get("content")
        for candidate in (token, default):
            if isinstance(candidate, str) and (tid := self._tok.token_to_id(candidate)) is not None:
                return int(tid)
        if isinstance(model_cfg.get(f"{kind}_token_id"), int):
            return int(model_cfg[f"{kind}_token_id"])
        raise ModelLoadError(
            f"{self.path}: cannot find the {kind} token; set {kind}_token in tokenizer_config.json",
            param=f"{kind}_token",
        )

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if self._template_src is None:
            raise InvalidRequestError(
                f"{self.path.parent} has no chat template (no chat_template in "
                "tokenizer_config.json, no chat_template.jinja); use the completions "
                "endpoint with a raw prompt",
                param="messages",
            )
        if self._template is None:
            self._template = _compile(self._template_src)
        from jinja2 import TemplateError

        msgs = [{"role": role, "content": content} for role, content in _checked(messages)]
        try:
            text = self._template.render(
                messages=msgs,
                bos_token=self._bos_text,
                eos_token=self._eos_text,
                add_generation_prompt=True,
            )
        except TemplateError as exc:  # templates raise to reject a conversation shape
            raise InvalidRequestError(
                f"messages cannot be formatted for this model: {exc}", param="messages"
            ) from exc
        # The template writes bos itself; special tokens in the text are matched as tokens.
        return list(self._tok.encode(text, add_special_tokens=False).ids)


def _checked(messages: list[dict[str, str]]) -> list[tuple[str, str]]:
    if not messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in _ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role is {role!r}; supported roles: {', '.join(_ROLES)}",
                param=f"messages[{i}].role",
            )
        if not isinstance(content, str):
            raise InvalidRequestError(
                f"messages[{i}].content must be a string", param=f"messages[{i}].content"
            )
        out.append((role, content))
    return out


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{file}: cannot be read as JSON ({exc})") from exc
    return data if isinstance(data, dict) else {}


def _chat_template(model_dir: Path, tok_cfg: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"  # transformers >= 4.43 saves it separately
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _compile(source: str) -> Any:
    """Compile like transformers does: sandboxed, trim/lstrip blocks, raise_exception()."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ModelLoadError(f"chat template does not compile: {exc}") from exc
