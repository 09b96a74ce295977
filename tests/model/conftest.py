"""Fixtures for the model tests (helpers live in model_testkit)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from tests.model.model_testkit import TINY, PagedCache, make_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_full_tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Full attention (no window) and a tied output head."""
    cfg = replace(TINY, sliding_window=None, tie_word_embeddings=True)
    return make_checkpoint(tmp_path_factory.mktemp("tiny-tied"), cfg)


@pytest.fixture
def paged() -> type[PagedCache]:
    return PagedCache
