"""Input checks and the ledger, without a server."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from tailguard.errors import ConfigError
from tailguard.tools.batch.config import BatchConfig, default_errors_path, default_ledger_path
from tailguard.tools.batch.inputs import read_input
from tailguard.tools.batch.ledger import Ledger, LedgerRow


def line(cid: str, url: str = "/v1/infer", **kw: object) -> str:
    obj: dict[str, object] = {
        "custom_id": cid,
        "method": "POST",
        "url": url,
        "body": {"prompt": "x"},
    }
    obj.update(kw)
    return json.dumps(obj)


def test_input_reports_duplicates_and_malformed_with_line_numbers(tmp_path: Path) -> None:
    p = tmp_path / "in.jsonl"
    lines = [
        line("a"),
        line("b", url="/v1/chat/completions"),
        "{not json",
        line("a"),
        "",
        json.dumps(["a", "list"]),
        line("c", url="/v2/nope"),
        line("d", method="GET"),
        json.dumps({"method": "POST", "url": "/v1/infer", "body": {}}),
        line("e", body="text"),
        line("b", url="/v1/embeddings"),
    ]
    p.write_text("\n".join(lines) + "\n")
    rep = read_input(p)
    assert rep.duplicates == {"a": [1, 4], "b": [2, 11]}
    assert [n for n, _ in rep.malformed] == [3, 6, 7, 8, 9, 10]
    problems = "\n".join(rep.problems())
    assert "duplicate custom_id 'a' on lines 1, 4" in problems
    assert "line 3: not valid JSON" in problems
    assert "line 7: custom_id 'c': 'url' must be one of" in problems
    assert "line 8:" in problems and "'method' must be" in problems
    assert "line 9: 'custom_id' is missing" in problems
    assert "line 10: custom_id 'e': 'body' must be a JSON object" in problems


def test_ledger_never_stores_a_custom_id_twice(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "l.sqlite")
    row = LedgerRow("a", 1, True, 1, 5.0, '{"custom_id":"a"}')
    assert led.record_many([row]) == 1
    assert led.record_many([row, LedgerRow("b", 2, False, 3, None, '{"custom_id":"b"}')]) == 1
    assert led.done_ids() == {"a", "b"}
    assert led.counts() == (1, 1)
    mode = sqlite3.connect(tmp_path / "l.sqlite").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    led.close()


def test_ledger_writes_outputs_in_input_order(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "l.sqlite")
    led.record_many(
        [
            LedgerRow("c", 3, True, 1, 1.0, '{"custom_id":"c"}'),
            LedgerRow("a", 1, True, 1, 1.0, '{"custom_id":"a"}'),
            LedgerRow("b", 2, False, 1, None, '{"custom_id":"b"}'),
        ]
    )
    out, err = tmp_path / "o.jsonl", tmp_path / "o.errors.jsonl"
    out.write_text("stale\n" * 10)
    assert led.write_outputs(out, err) == (2, 1)
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["a", "c"]
    assert [json.loads(x)["custom_id"] for x in err.read_text().splitlines()] == ["b"]
    assert led.forget_failed() == 1
    assert led.done_ids() == {"a", "c"}
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary file left behind
    led.close()


def test_ledger_refuses_a_different_input(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "l.sqlite")
    assert led.bind_input("aaa", Path("in.jsonl")) is False
    assert led.bind_input("aaa", Path("in.jsonl")) is True
    with pytest.raises(ConfigError, match="belongs to a different input"):
        led.bind_input("bbb", Path("in.jsonl"))
    led.close()


def test_config_defaults_and_refusals(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    assert default_errors_path(out) == tmp_path / "out.errors.jsonl"
    assert default_ledger_path(out) == tmp_path / "out.jsonl.ledger.sqlite"
    with pytest.raises(ConfigError, match="not an http"):
        BatchConfig(tmp_path / "in", out, ("localhost:8000",))
    with pytest.raises(ConfigError, match="below the number of endpoints"):
        BatchConfig(tmp_path / "in", out, ("http://a", "http://b"), max_in_flight=1)
    with pytest.raises(ConfigError, match="--output is the input"):
        BatchConfig(out, out, ("http://a",))
    with pytest.raises(ConfigError, match="does not exist; create it"):
        BatchConfig(tmp_path / "in", tmp_path / "no" / "out.jsonl", ("http://a",))
