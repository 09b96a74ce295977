"""Building this folder's C files and loading them once per process.

`build_library` compiles `<name>.c` with the system compiler into
`$TAILGUARD_CACHE/kernels/<name>-<hash>.so` (default `~/.cache/tailguard/kernels`), the hash
covering the source (and the neighbours it `#include`s), the command, the compiler's version
and the CPU's flags: a new CPU or compiler builds afresh, and a process that finds the
library built uses it without a compiler.
`Loader` wraps one file: build, open, check its ABI number, wrap it, self-check it against
torch; the result (or why not, logged once) is kept per (compiler, cache folder).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from tailguard.paths import cache_home

__all__ = ["Loader", "build_library", "default_cache_dir", "default_compiler"]

log = logging.getLogger("tailguard.engine")

CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LDLIBS = ("-lm",)

K = TypeVar("K")


def default_compiler() -> str:
    return os.environ.get("CC") or "cc"


def default_cache_dir() -> Path:
    """`$TAILGUARD_CACHE/kernels` (default `~/.cache/tailguard/kernels`), beside the
    embedded checkpoint."""
    return cache_home() / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def build_library(source_path: Path, compiler: str, cache_dir: Path) -> Path:
    """Compile (or find) the library of one of this folder's C files; raises OSError /
    CalledProcessError / RuntimeError."""
    source = _with_includes(source_path)
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    key = hashlib.sha256()
    command = " ".join((*CFLAGS, *LDLIBS)).encode()
    for part in (source, compiler.encode(), command, version.encode()):
        key.update(part + b"\0")
    key.update(_cpu_flags().encode())
    path = cache_dir / f"{source_path.stem}-{key.hexdigest()[:20]}.so"
    if path.exists():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build under a temporary name and rename: concurrent processes never load a half file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *CFLAGS, "-o", tmp, str(source_path), *LDLIBS],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("tailguard: built %s", path)
    return path


def _with_includes(source_path: Path) -> bytes:
    """The source and every neighbour it includes, at any depth, each once (decode_bf16.c
    includes gemv_bf16.c, which includes gemv_amx.c and rows.c, which includes attend.c): all
    of them key the build."""
    seen: list[Path] = []
    todo = [source_path]
    while todo:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.append(path)
        for name in re.findall(rb'#include "([^"]+)"', path.read_bytes()):
            todo.append(source_path.parent / name.decode())
    return b"\0".join(p.read_bytes() for p in seen)


class Loader(Generic[K]):
    """One C file's library: built, opened, its ABI checked, wrapped and self-checked once per
    (compiler, cache folder); `load` gives None after one warning line when it cannot be had."""

    def __init__(
        self,
        source: Path,
        abi_symbol: str,
        abi: int,
        wrap: Callable[[ctypes.CDLL, Path], K],
        check: Callable[[K], str | None],
        *,
        what: str,
        fallback: str,
    ) -> None:
        self.source, self.abi_symbol, self.abi = source, abi_symbol, abi
        self.wrap, self.check = wrap, check
        self.what, self.fallback = what, fallback
        self._loaded: dict[tuple[str, str], K | str] = {}  # key -> wrapped library | why not

    @staticmethod
    def _key(compiler: str | None, cache_dir: Path | None) -> tuple[str, str]:
        return compiler or default_compiler(), str(cache_dir or default_cache_dir())

    def _load(self, compiler: str, cache_dir: Path) -> K | str:
        try:
            path = build_library(self.source, compiler, cache_dir)
        except FileNotFoundError:
            return f"no C compiler ({compiler!r} not found; set CC)"
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            return f"compiling {self.source.name} failed: {exc}"
        try:
            lib = ctypes.CDLL(str(path))
            if getattr(lib, self.abi_symbol)() != self.abi:
                return f"{path} is not this version of the {self.what}"
            wrapped = self.wrap(lib, path)
        except (OSError, AttributeError) as exc:
            return f"loading {path} failed: {exc}"
        return self.check(wrapped) or wrapped

    def load(self, compiler: str | None = None, cache_dir: Path | None = None) -> K | None:
        key = self._key(compiler, cache_dir)
        if key not in self._loaded:
            got = self._loaded[key] = self._load(key[0], Path(key[1]))
            if isinstance(got, str):
                log.warning(
                    "tailguard: %s unavailable, using %s: %s", self.what, self.fallback, got
                )
        got = self._loaded[key]
        return None if isinstance(got, str) else got

    def reason(self, compiler: str | None = None, cache_dir: Path | None = None) -> str | None:
        """Why `load` gave None (after it ran), else None."""
        got = self._loaded.get(self._key(compiler, cache_dir))
        return got if isinstance(got, str) else None
