"""Kill `tailguard batch` with SIGKILL at random moments, resume, and check the final output."""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from tests.tools.batch.batch_helpers import (
    batch_cmd,
    errors_path,
    id_counts,
    run_batch,
    sim_server,
    tailguard_server,
    write_input,
)

N = 800


def ledger_rows(out: Path) -> int:
    path = Path(str(out) + ".ledger.sqlite")
    if not path.exists():
        return 0
    db = sqlite3.connect(path)
    try:
        return int(db.execute("SELECT COUNT(*) FROM results").fetchone()[0])
    except sqlite3.OperationalError:  # killed before the schema was committed
        return 0
    finally:
        db.close()


def real_server_available() -> bool:
    return importlib.util.find_spec("tailguard.server.cli") is not None


@contextmanager
def server(kind: str) -> Iterator[tuple[str, Callable[[], int | None]]]:
    # Both run the 800-request job in a few seconds, so four kills land mid-run.
    """(url, executed-count function) for the named kind of server."""
    if kind == "sim":
        with sim_server("--slots", "8", "--service-ms", "20") as sim:
            yield sim.url, lambda: sim.stats()["ok"]
    else:
        # The real server with its simulated engine, slowed to ~250 requests/s.
        with tailguard_server("--simulated-tokens-per-s", "6000") as url:
            yield url, lambda: None


@pytest.mark.parametrize(
    "kind",
    [
        "sim",
        pytest.param(
            "tailguard-serve",
            marks=pytest.mark.skipif(
                not real_server_available(), reason="tailguard.server is not in this tree yet"
            ),
        ),
    ],
)
def test_resume_after_repeated_kill_9(tmp_path: Path, kind: str) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = write_input(inp, N)
    rng = random.Random(os.getpid())
    progress = [0]
    kills = 0
    with server(kind) as (url, executed):
        for _ in range(4):
            proc = subprocess.Popen(
                batch_cmd(inp, out, url),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            # Kill at a random moment once this run is sending and committing (start-up
            # takes a variable second on a loaded machine; a kill before it proves nothing).
            deadline = time.monotonic() + 20
            while ledger_rows(out) <= progress[-1] and proc.poll() is None:
                assert time.monotonic() < deadline, "batch made no progress"
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.3))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            progress.append(ledger_rows(out))
            if proc.returncode == 0:
                break  # it finished before the kill landed
            assert proc.returncode == -signal.SIGKILL
            kills += 1
        res = run_batch(inp, out, url)
        ran = executed()
    assert res.returncode == 0, res.stderr
    # The kills interrupted real work (the ledger grew between them) and the job finished.
    assert kills >= 2 and 0 < progress[kills] < N, progress
    assert progress == sorted(progress)
    counts = id_counts(out)
    assert set(counts) == set(ids)
    assert max(counts.values()) == 1
    assert not errors_path(out).read_text()
    # Requests in flight at a kill are sent again (the server may see a few twice); the output
    # never has them twice.
    assert ran is None or ran >= N
