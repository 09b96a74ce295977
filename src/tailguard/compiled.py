"""The compiled request path: the server's hot modules built with mypyc, loaded when current.

Why: on the 2-core machines this project runs on, the HTTP process's CPU per request decides
the burst behaviour and the front-end benchmark. The request path is ~40 small steps of plain
Python (parse, admission, pipeline, metrics, answer); mypyc compiles those same typed modules
to C extensions: the in-process app path took 26.6 us a request against 56.7 in pure Python
(`bench/bench_app_path.py`; docs/benchmarks.md). Nothing is rewritten by hand: the sources
stay the only truth.

How it stays correct:
- A build is keyed by the content of every `.py` file of the package (and the interpreter's
  ABI): `$TAILGUARD_CACHE/compiled/<key>/` (default `~/.cache/tailguard/compiled`).
  `tailguard/__init__.py` puts a finder in front of `sys.meta_path`; at the first import of a
  compiled module it computes the key of the sources it runs from (~5 ms) and loads the
  compiled modules only from the build with exactly that key. Edit any source and the key
  changes: pure Python runs until the next build (`make compiled`, which every make target that
  runs the server or the tests calls first); a stale extension can never shadow an edited
  source.
- `TAILGUARD_COMPILED=0` forces pure Python (debugging, profiling line by line).
- A failed build (no C compiler) leaves pure Python running; `status()` says which is active
  and `tailguard serve` logs it.

    tailguard compiled build     # build for the current sources (a no-op if built)
    tailguard compiled status    # which path is active, and why

Only modules in `MODULES` are compiled: typed, no msgspec Structs defined in them (mypyc
cannot compile those), no async generators (unsupported by mypyc), and no class that tests
patch (a compiled class's methods cannot be replaced: tests/server/inproc.py spies on the
tokenizer by wrapping it) or that Python code subclasses without
`@mypyc_attr(allow_interpreted_subclasses=True)`. This module itself is never compiled.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from tailguard.paths import cache_home

if TYPE_CHECKING:
    import argparse

# Imported by `import tailguard`, so kept light: no importlib.abc (it pulls importlib.resources,
# ~20 ms), shutil and tempfile only when building.

__all__ = ["MODULES", "add_arguments", "build", "install", "run", "status"]

MODULES = (
    "tailguard.core.admission",
    "tailguard.core.admission_config",
    "tailguard.core.calibration",
    "tailguard.engine.router",
    "tailguard.server.app",
    "tailguard.server.cache",
    "tailguard.server.call",
    "tailguard.server.errors",
    "tailguard.server.generate",
    "tailguard.server.handlers",
    "tailguard.server.http",
    "tailguard.server.http_conn",
    "tailguard.server.http_read",
    "tailguard.server.metrics",
    "tailguard.server.pipeline",
    "tailguard.server.quota",
    "tailguard.server.stub",
    "tailguard.server.text",
    "tailguard.server.tokenizer",
)
GROUP = "tailguard_compiled"  # mypyc's shared library: `tailguard_compiled__mypyc`
ENV_SWITCH = "TAILGUARD_COMPILED"
PACKAGE_DIR = Path(__file__).resolve().parent
_KEEP_BUILDS = 3  # older builds (other source versions) are pruned past this many


def cache_root() -> Path:
    """`$TAILGUARD_CACHE/compiled` (default `~/.cache/tailguard/compiled`)."""
    return cache_home() / "compiled"


def source_key(package_dir: Path = PACKAGE_DIR) -> str:
    """The key of a build: every `.py` file of the package (path and bytes), the interpreter's
    ABI tag and the module list. Any edit anywhere gives a new key."""
    h = hashlib.sha256()
    h.update(f"{sys.implementation.cache_tag}|{_ext_suffix()}|{','.join(MODULES)}".encode())
    files = []
    for folder, dirs, names in os.walk(package_dir):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    base = len(str(package_dir)) + 1
    for path in sorted(files):
        h.update(path[base:].encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _ext_suffix() -> str:
    return importlib.machinery.EXTENSION_SUFFIXES[0]


def _build_files(build_dir: Path) -> dict[str, Path]:
    """Each compiled module's extension (and mypyc's shared library) in a build folder."""
    suffix = _ext_suffix()
    files = {
        name: build_dir.joinpath(*name.split(".")).with_name(name.rsplit(".", 1)[-1] + suffix)
        for name in MODULES
    }
    files[f"{GROUP}__mypyc"] = build_dir / f"{GROUP}__mypyc{suffix}"
    return files


def _complete(build_dir: Path) -> bool:
    return all(f.is_file() for f in _build_files(build_dir).values())


class _Finder:
    """In front of `sys.meta_path`: loads a compiled module from the build for these exact
    sources. The build is looked for at the first import of one of them, so a process that
    imports none (the load tester, the batch runner) never hashes the sources."""

    _names = frozenset((*MODULES, f"{GROUP}__mypyc"))

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._names:
            return None
        active, where = status()
        if not active:
            return None
        file = _build_files(Path(where))[fullname]
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


_status: tuple[bool, str] | None = None  # (compiled, where from or why not), once chosen


def install() -> None:
    """Called once by `tailguard/__init__.py`, before any compiled module can be imported."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def status() -> tuple[bool, str]:
    """(compiled modules used in this process, the build folder or why not); chosen once."""
    global _status
    if _status is None:
        _status = _choose()
    return _status


def _choose() -> tuple[bool, str]:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False, f"{ENV_SWITCH}=0"
    build_dir = cache_root() / source_key()
    if not _complete(build_dir):
        return False, "no compiled build for these sources: run `make compiled`"
    return True, str(build_dir)


def loaded_compiled(module: ModuleType) -> bool:
    """Whether `module` came from a compiled build (its file is an extension)."""
    return str(getattr(module, "__file__", "")).endswith(_ext_suffix())


def build(*, force: bool = False, opt_level: str = "3") -> Path:
    """Build the compiled modules for the current sources into the cache (a no-op when that
    build exists). Raises on failure (no compiler, mypyc error); nothing half-built is left."""
    import shutil
    import tempfile

    key = source_key()
    root = cache_root()
    target = root / key
    if _complete(target) and not force:
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"build-{key}-", dir=root) as tmp:
        out = Path(tmp) / "out"
        _run_mypyc(Path(tmp), out, opt_level)
        if not _complete(out):
            raise RuntimeError(f"mypyc finished but left no complete build in {out}")
        if source_key() != key:
            raise RuntimeError("the sources changed during the build; build again")
        if target.exists():
            shutil.rmtree(target)
        out.rename(target)
    _prune(root, keep=target)
    return target


def _run_mypyc(work: Path, out: Path, opt_level: str) -> None:
    """mypyc on `MODULES` in a child process (setuptools' build_ext), output into `out`; the
    sources are compiled where they are and never written to."""
    import subprocess

    paths = [str(PACKAGE_DIR.parent.joinpath(*m.split(".")).with_suffix(".py")) for m in MODULES]
    script = work / "setup_compiled.py"
    script.write_text(
        "from setuptools import setup\n"
        "from mypyc.build import mypycify\n"
        f"paths = {paths!r}\n"
        "setup(name='tailguard-compiled', ext_modules=mypycify(\n"
        f"    ['--ignore-missing-imports', *paths], opt_level={opt_level!r},\n"
        f"    group_name={GROUP!r}, target_dir={str(work / 'c')!r}),\n"
        f"    script_args=['build_ext', '--build-lib', {str(out)!r},\n"
        f"                 '--build-temp', {str(work / 'tmp')!r}])\n"
    )
    env = {**os.environ, ENV_SWITCH: "0"}
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"mypyc build failed (exit {proc.returncode}):\n{tail}")


def _prune(root: Path, keep: Path) -> None:
    """Keep the newest `_KEEP_BUILDS` builds (`keep` among them); drop the work folders of
    builds that died (a killed `make`) once they are an hour old."""
    import shutil
    import time

    stale_work = time.time() - 3600
    builds = []
    for p in root.iterdir():
        if not p.is_dir() or p == keep:
            continue
        if p.name.startswith("build-"):
            if p.stat().st_mtime < stale_work:
                shutil.rmtree(p, ignore_errors=True)
            continue
        builds.append(p)
    builds.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in builds[_KEEP_BUILDS - 1 :]:
        shutil.rmtree(old, ignore_errors=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    b = sub.add_parser("build", help="build for the current sources (a no-op if built)")
    b.add_argument("--force", action="store_true", help="rebuild even if a build exists")
    b.add_argument("--opt-level", default="3", choices="0123", help="C optimisation level")
    sub.add_parser("status", help="which request path this process runs, and why")


def run(args: argparse.Namespace) -> int:
    if args.action == "build":
        try:
            where = build(force=args.force, opt_level=args.opt_level)
        except Exception as e:
            print(f"tailguard: the compiled build failed; pure Python runs instead.\n{e}")
            return 1
        print(f"tailguard: compiled request path ready in {where}")
        return 0
    active, why = status()
    print(f"{'compiled' if active else 'pure Python'}: {why}")
    return 0
