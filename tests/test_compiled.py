"""The compiled request path (tailguard.compiled): used only for the exact sources it was built
from, the same answers as pure Python, and really used by the suite where a compiler exists."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tailguard
from tailguard import compiled

SRC = Path(tailguard.__file__).resolve().parent.parent

# Answers of the server's endpoints (stub engine, in-process, through tests/server/inproc.py),
# minus what is fresh per answer.
PROBE = r"""
import asyncio, json
from tailguard.compiled import status
from tests.server.inproc import request, running_app

VOLATILE = {"id", "created", "timing"}
CASES = [
    ("POST", "/v1/infer", {"prompt": "The quick brown fox", "top_k": 3, "embedding": True}),
    ("POST", "/v1/infer", {"input_ids": [5, 6, 7], "top_k": 2}),
    ("POST", "/v1/embeddings", {"input": ["a b", "c"]}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 5}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "max_tokens": 4}),
    ("POST", "/v1/infer", b"{not json"),
    ("POST", "/v1/infer", {"prompt": "x", "model": "nope"}),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "many"}),
    ("GET", "/v1/infer", None),
    ("GET", "/nowhere", None),
    ("GET", "/v1/models", None),
]

def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if k not in VOLATILE}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x

def decode(raw):
    if raw.startswith(b"data: "):
        events = [e[6:] for e in raw.split(b"\n\n")]
        return [strip(json.loads(e)) for e in events if e not in (b"", b"[DONE]")]
    return strip(json.loads(raw))

async def main():
    out = []
    async with running_app(engine="stub", log_level="warning") as app:
        for method, path, body in CASES:
            r = await request(app, method, path, body)
            out.append([method, path, r.status, decode(r.body)])
    print(json.dumps({"compiled": status()[0], "answers": out}))

asyncio.run(main())
"""


def _probe(env: dict[str, str]) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, "PYTHONPATH": str(SRC.parent), **env},  # tests.server.inproc
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout.splitlines()[-1])
    return result


def _status(src: Path, env: dict[str, str] | None = None) -> tuple[str, str]:
    """(request path, the file tailguard.server.app came from) in a fresh process on `src`."""
    code = (
        "import tailguard.server.app as a; from tailguard.compiled import status; "
        "print(status()[0], a.__file__)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(src), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    active, file = proc.stdout.split()
    return active, file


def test_the_suite_runs_on_the_compiled_modules_where_a_compiler_exists() -> None:
    """`make test` builds first (`make compiled`); a build that failed silently would leave
    every other test exercising pure Python only."""
    if os.environ.get("TAILGUARD_EXPECT_COMPILED") != "1":
        pytest.skip("run through `make test` (TAILGUARD_EXPECT_COMPILED=1)")
    if not (shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")):
        pytest.skip("no C compiler: the server runs as pure Python here")
    active, why = compiled.status()
    assert active, why
    import tailguard.core.admission
    import tailguard.server.pipeline

    assert compiled.loaded_compiled(tailguard.server.pipeline)
    assert compiled.loaded_compiled(tailguard.core.admission)


def test_compiled_and_pure_python_give_the_same_answers() -> None:
    if not compiled.status()[0]:
        pytest.skip("no compiled build for these sources (`make compiled`)")
    fast = _probe({})
    pure = _probe({compiled.ENV_SWITCH: "0"})
    assert fast["compiled"] is True and pure["compiled"] is False
    assert fast["answers"] == pure["answers"]
    statuses = [a[2] for a in pure["answers"]]  # type: ignore[union-attr, index]
    assert statuses == [200, 200, 200, 200, 200, 200, 400, 404, 400, 405, 404, 200]


def test_an_edited_source_is_never_shadowed_by_a_stale_build(tmp_path: Path) -> None:
    """A build serves only the sources it was built from: edit any file (even one that is not
    compiled) and the same process setup runs pure Python from the edited sources."""
    if not compiled.status()[0]:
        pytest.skip("no compiled build for these sources (`make compiled`)")
    copy = tmp_path / "src"
    shutil.copytree(SRC / "tailguard", copy / "tailguard", ignore=shutil.ignore_patterns("*.pyc"))
    active, file = _status(copy)
    assert active == "True" and file.endswith(compiled._ext_suffix())  # same sources: compiled

    readme = copy / "tailguard" / "deploy" / "__init__.py"  # not compiled, still part of the key
    readme.write_text(readme.read_text() + "\n# edited\n")
    active, file = _status(copy)
    assert active == "False" and file == str(copy / "tailguard" / "server" / "app.py")


def test_the_switch_forces_pure_python() -> None:
    active, file = _status(SRC, {compiled.ENV_SWITCH: "0"})
    assert active == "False" and file.endswith("app.py")


def test_the_key_covers_every_source_and_nothing_else(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    key = compiled.source_key(pkg)
    (pkg / "notes.txt").write_text("not a source")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "c.py").write_text("z = 3\n")
    assert compiled.source_key(pkg) == key
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    assert compiled.source_key(pkg) != key
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    assert compiled.source_key(pkg) == key
    (pkg / "sub" / "b.py").rename(pkg / "b.py")  # same bytes, another module
    assert compiled.source_key(pkg) != key


def test_an_incomplete_build_is_not_used(tmp_path: Path) -> None:
    """A build folder missing one module (a crash mid-copy, a hand-deleted file) is ignored."""
    if not compiled.status()[0]:
        pytest.skip("no compiled build for these sources (`make compiled`)")
    cache = tmp_path / "cache"
    src_build = Path(compiled.status()[1])
    shutil.copytree(src_build, cache / "compiled" / src_build.name)
    env = {"TAILGUARD_CACHE": str(cache)}
    assert _status(SRC, env)[0] == "True"
    victim = compiled._build_files(cache / "compiled" / src_build.name)[compiled.MODULES[-1]]
    victim.unlink()
    assert _status(SRC, env)[0] == "False"


def test_old_builds_and_dead_work_folders_are_pruned(tmp_path: Path) -> None:
    import time

    root = tmp_path / "compiled"
    root.mkdir()
    now = time.time()
    for i, name in enumerate(["a", "b", "c", "d", "keep"]):
        (root / name).mkdir()
        os.utime(root / name, (now - 100 + i, now - 100 + i))  # a oldest, keep newest
    for name, age in (("build-x-old", 7200), ("build-y-running", 60)):
        (root / name).mkdir()
        os.utime(root / name, (now - age, now - age))
    compiled._prune(root, keep=root / "keep")
    assert sorted(p.name for p in root.iterdir()) == ["build-y-running", "c", "d", "keep"]
