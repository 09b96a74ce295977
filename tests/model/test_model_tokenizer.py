"""Tokenizers: mistral-common files, a tokenizer.json, chat templates, the folder choice."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tailguard.errors import InvalidRequestError, ModelLoadError
from tailguard.model.embedded import mistral_v1_tokenizer_path
from tailguard.model.tokenizer import (
    HFTokenizer,
    MistralCommonTokenizer,
    Tokenizer,
    load_tokenizer,
)

CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]

# A Mistral-style template in the form tokenizer_config.json carries it.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% elif m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% else %}{{ raise_exception('unknown role') }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def v1_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("v1")
    shutil.copy(mistral_v1_tokenizer_path(), folder / "tokenizer.model.v1")
    return folder


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tokenizer.json, trained here (byte-level BPE) since there is no network."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["The quick brown fox jumps over the lazy dog.", "What is 2+2? Hello there!"] * 50
    tok.train_from_iterator(corpus, trainer)
    folder = tmp_path_factory.mktemp("hf")
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def test_mistral_common_v1_round_trip(v1_dir: Path) -> None:
    tok = load_tokenizer(v1_dir)
    assert isinstance(tok, MistralCommonTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 32000)
    text = "Hello world, ünïcode and 123 numbers."
    ids = tok.encode(text)
    assert ids[0] == 1 and 1 not in ids[1:]
    assert len(ids) > 5  # not the "everything encodes to [1]" failure
    assert tok.encode(text, add_bos=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_id]) == text  # special tokens are not rendered


def test_mistral_common_chat(v1_dir: Path) -> None:
    tok = load_tokenizer(v1_dir)
    ids = tok.apply_chat_template(CHAT)
    inst, end_inst = tok.encode("[INST]", add_bos=False), tok.encode("[/INST]", add_bos=False)
    assert ids[0] == tok.bos_id
    assert ids[-len(end_inst) :] == end_inst  # ready for the assistant's turn
    assert tok.eos_id in ids  # closes the earlier assistant turn
    text = tok.decode(ids)
    assert "Answer briefly." in text and "What is 2+2?" in text
    assert ids[1 : 1 + len(inst)] == inst
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.role is 'tool'"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(InvalidRequestError, match="messages cannot be formatted"):
        tok.apply_chat_template([{"role": "assistant", "content": "I start"}])


def test_hf_tokenizer_round_trip_and_template(hf_dir: Path) -> None:
    tok = load_tokenizer(hf_dir)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    text = "The lazy fox says hello there!"
    ids = tok.encode(text)
    assert ids[0] == 1 and len(ids) > 3
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template(CHAT[1:])
    # special tokens written by the template come back as single ids, not split text
    assert chat[0] == tok.bos_id and chat.count(3) == 2 and chat.count(4) == 2
    assert tok.eos_id in chat
    assert tok.decode(chat).split() == ["Hi", "Hello!", "What", "is", "2+2?"]


def test_hf_tokenizer_without_template(hf_dir: Path, tmp_path: Path) -> None:
    shutil.copy(hf_dir / "tokenizer.json", tmp_path)
    tok = load_tokenizer(tmp_path)
    with pytest.raises(InvalidRequestError, match="has no chat template"):
        tok.apply_chat_template(CHAT)


def test_folder_choice(v1_dir: Path, hf_dir: Path, tmp_path: Path) -> None:
    both = tmp_path / "both"
    shutil.copytree(hf_dir, both)
    shutil.copy(v1_dir / "tokenizer.model.v1", both)
    assert isinstance(load_tokenizer(both), MistralCommonTokenizer)  # Mistral's files win
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"no tokenizer in .*tokenizer\.json, tekken\.json"):
        load_tokenizer(empty)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: cannot be loaded"):
        load_tokenizer(bad)


def test_light_modules_do_not_import_torch(v1_dir: Path) -> None:
    """The HTTP process imports these to tokenize and find the default model."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "import tailguard.model.config, tailguard.model.embedded\n"
        "from tailguard.model.tokenizer import load_tokenizer\n"
        f"tok = load_tokenizer(Path({str(v1_dir)!r}))\n"
        "tok.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
        "assert tok.encode('hi')[0] == 1\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _mistral_data(name: str) -> Path:
    return mistral_v1_tokenizer_path().parent / name


def test_highest_spm_version_wins(v1_dir: Path, tmp_path: Path) -> None:
    shutil.copy(v1_dir / "tokenizer.model.v1", tmp_path)
    shutil.copy(
        _mistral_data("mistral_instruct_tokenizer_240323.model.v3"), tmp_path / "tokenizer.model.v3"
    )
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, MistralCommonTokenizer)
    assert tok.path.name == "tokenizer.model.v3" and tok.vocab_size == 32768
    ids = tok.apply_chat_template(CHAT)
    assert 3 in ids and 4 in ids  # v3 has [INST] / [/INST] as control tokens 3 and 4


def test_tekken(tmp_path: Path) -> None:
    shutil.copy(_mistral_data("tekken_240911.json"), tmp_path / "tekken.json")
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, MistralCommonTokenizer) and tok.vocab_size == 131072
    text = "Hello world, ünïcode"
    assert tok.decode(tok.encode(text)) == text
    assert tok.apply_chat_template(CHAT)[0] == tok.bos_id
