"""The durable ledger: the one place a finished request is recorded.

A result counts as done only once its row is committed here (SQLite, WAL mode,
`synchronous=FULL`, so a commit survives the process being killed and the machine losing
power). The output and errors files are *derived* from the ledger (rewritten whole, through a
temporary file and an atomic rename), never appended to, so a crash between two writes cannot
leave a result twice. `custom_id` is the primary key: even a logic error cannot store it twice.

A killed run loses at most the results not yet committed (a few tens of milliseconds' worth);
those requests are sent again on resume, so the server may see a request twice, the output never.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tailguard.errors import ConfigError

__all__ = ["Ledger", "LedgerRow"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (
    custom_id  TEXT PRIMARY KEY,
    line_no    INTEGER NOT NULL,
    ok         INTEGER NOT NULL,  -- 1: goes to the output file, 0: to the errors file
    attempts   INTEGER NOT NULL,
    latency_ms REAL,              -- the successful attempt's latency; NULL for failures
    record     TEXT NOT NULL      -- the output line (OpenAI batch output format)
);
"""


@dataclass(frozen=True)
class LedgerRow:
    custom_id: str
    line_no: int
    ok: bool
    attempts: int
    latency_ms: float | None
    record: str  # one JSON line, no newline


class Ledger:
    """One run's ledger. Methods are called from one thread at a time (writes go through the
    runner's single flusher), so one connection with `check_same_thread=False` is enough."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def bind_input(self, fingerprint: str, input_path: Path) -> bool:
        """Tie the ledger to one input file. True if this is a resume of that same file.

        A ledger made for a different input is refused: resuming against changed input would
        mix results of two different jobs."""
        row = self._db.execute("SELECT value FROM meta WHERE key='input_sha256'").fetchone()
        if row is None:
            with self._tx():
                self._db.execute("INSERT INTO meta VALUES ('input_sha256', ?)", (fingerprint,))
                self._db.execute("INSERT INTO meta VALUES ('input_path', ?)", (str(input_path),))
            return False
        if row[0] != fingerprint:
            (old_path,) = self._db.execute(
                "SELECT value FROM meta WHERE key='input_path'"
            ).fetchone() or ("?",)
            raise ConfigError(
                f"the ledger {self.path} belongs to a different input ({old_path}, which has "
                f"changed since, or another file); to start over delete {self.path} (and its "
                "-wal/-shm files) or choose another --output"
            )
        return True

    def done_ids(self) -> set[str]:
        return {r[0] for r in self._db.execute("SELECT custom_id FROM results")}

    def forget_failed(self) -> int:
        """Drop the failed results so they are sent again; returns how many."""
        with self._tx():
            cur = self._db.execute("DELETE FROM results WHERE ok = 0")
        return cur.rowcount

    def record_many(self, rows: Iterable[LedgerRow]) -> int:
        """Commit a group of results in one transaction (one fsync); returns rows added."""
        with self._tx():
            cur = self._db.executemany(
                "INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (r.custom_id, r.line_no, int(r.ok), r.attempts, r.latency_ms, r.record)
                    for r in rows
                ],
            )
        return cur.rowcount

    def counts(self) -> tuple[int, int]:
        """(succeeded, failed) rows."""
        row = self._db.execute(
            "SELECT COALESCE(SUM(ok), 0), COALESCE(SUM(1 - ok), 0) FROM results"
        ).fetchone()
        return int(row[0]), int(row[1])

    def write_outputs(self, output: Path, errors: Path) -> tuple[int, int]:
        """Rewrite the output and errors files from the ledger, in input order."""
        n_ok = self._write(output, ok=True)
        n_err = self._write(errors, ok=False)
        return n_ok, n_err

    def _write(self, path: Path, *, ok: bool) -> int:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        n = 0
        try:
            with tmp.open("w", encoding="utf-8") as f:
                cur = self._db.execute(
                    "SELECT record FROM results WHERE ok = ? ORDER BY line_no", (int(ok),)
                )
                for (record,) in cur:
                    f.write(record)
                    f.write("\n")
                    n += 1
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # readers see the old file or the new one, never half
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return n

    @contextlib.contextmanager
    def _tx(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
