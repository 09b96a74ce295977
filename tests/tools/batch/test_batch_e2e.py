"""`tailguard batch` as a real process against small real servers (each in its own process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.tools.batch.batch_helpers import (
    batch_cmd,
    dead_url,
    errors_path,
    id_counts,
    read_jsonl,
    run_batch,
    sim_server,
    summary,
    write_input,
)


def assert_each_once(out: Path, ids: list[str]) -> None:
    counts = id_counts(out)
    assert set(counts) == set(ids), f"missing: {sorted(set(ids) - set(counts))[:10]}"
    assert max(counts.values()) == 1, f"duplicated: {[k for k, v in counts.items() if v > 1]}"


def test_capacity_limited_server_every_result_once_within_sla(tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = write_input(inp, 400)
    # 8 slots, 10 ms each alone and slower when busy; more than 24 in flight: 503 + Retry-After.
    with sim_server("--slots", "8", "--service-ms", "10", "--max-in-flight", "24") as sim:
        res = run_batch(inp, out, sim.url, extra=("--sla-ms", "150"))
        st = sim.stats()
    assert res.returncode == 0, res.stderr
    assert_each_once(out, ids)
    assert read_jsonl(errors_path(out)) == []
    rec = read_jsonl(out)[0]
    assert set(rec) == {"id", "custom_id", "response", "error"} and rec["error"] is None
    assert rec["response"]["status_code"] == 200 and rec["response"]["request_id"]
    assert "queue_ms" in rec["response"]["body"]
    s = summary(out)
    assert s["succeeded"] == 400 and s["failed"] == 0
    # The limiter left its starting point (8) and found the server's room; every 503 the
    # server sent was retried, and nothing was sent twice to completion.
    assert s["endpoints"][0]["final_limit"] > 8
    assert st["ok"] == 400
    assert s["retry_reasons"].get("503", 0) == st["overloaded"]
    assert "makespan" in res.stdout and "within SLA" in res.stdout


def test_limiter_keeps_a_queueing_server_inside_the_sla(tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = write_input(inp, 500)
    # No admission control: the server queues whatever it is sent (~270 req/s). Sent all at
    # once, the last of 500 would wait ~1.8 s; the limiter must hold the queue to what the SLA
    # allows (~100 in flight at 4 requests per 14 ms for a 400 ms SLA). The SLA is generous so
    # that a shared test box's occasional 100-200 ms stall does not decide the test.
    with sim_server("--slots", "4", "--service-ms", "10", "--max-in-flight", "10000") as sim:
        res = run_batch(inp, out, sim.url, extra=("--sla-ms", "400"))
        st = sim.stats()
    assert res.returncode == 0, res.stderr
    assert_each_once(out, ids)
    s = summary(out)
    assert st["max_in_flight_seen"] <= 160, (st, s["latency_ms"])
    assert s["endpoints"][0]["final_limit"] > 8
    assert s["within_sla"] >= 0.97, (st, s["latency_ms"])


def test_overloaded_server_with_retry_after_then_recovers(tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = write_input(inp, 200)
    with sim_server("--overload-for-s", "1.5", "--overload-retry-after-s", "0.3") as sim:
        t0 = time.monotonic()
        res = run_batch(inp, out, sim.url)
        st = sim.stats()
    assert res.returncode == 0, res.stderr
    assert_each_once(out, ids)
    s = summary(out)
    assert s["retry_reasons"]["503"] == st["overload_window"] > 0
    # Honoring Retry-After (0.3 s, endpoint-wide) the client knocks a few times per 0.3 s with
    # a shrinking limit; one that ignored it would have sent thousands in 1.5 s.
    assert st["overload_window"] <= 80, st
    assert time.monotonic() - t0 >= 1.5
    assert st["ok"] == 200


def test_server_that_drops_connections(tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = write_input(inp, 300)
    with sim_server("--drop-rate", "0.2", "--seed", "7") as sim:
        res = run_batch(inp, out, sim.url)
        st = sim.stats()
    assert res.returncode == 0, res.stderr
    assert_each_once(out, ids)
    s = summary(out)
    assert s["retry_reasons"]["connection"] == st["dropped"] > 0
    assert st["ok"] == 300  # a dropped request was never executed, so none ran twice


def test_several_endpoints_one_dead(tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = write_input(inp, 300)
    dead = dead_url()
    with sim_server("--slots", "4") as a, sim_server("--slots", "4") as b:
        res = run_batch(inp, out, a.url, dead, b.url)
        sa, sb = a.stats(), b.stats()
    assert res.returncode == 0, res.stderr
    assert_each_once(out, ids)
    eps = {e["url"]: e for e in summary(out)["endpoints"]}
    assert eps[dead]["ejections"] >= 1 and eps[dead]["ok"] == 0
    assert eps[dead]["sent"] <= 12  # its first limit's worth (8), then only probes
    assert sa["ok"] + sb["ok"] == 300
    assert min(sa["ok"], sb["ok"]) >= 60  # both live servers shared the work


def test_client_errors_are_recorded_not_retried(tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bad = [
        json.dumps({"custom_id": f"bad{i}", "method": "POST", "url": "/v1/infer", "body": {}})
        for i in range(5)
    ]
    ids = write_input(inp, 100, extra=bad)
    with sim_server() as sim:
        res = run_batch(inp, out, sim.url)
        st = sim.stats()
    assert res.returncode == 1, res.stderr
    assert_each_once(out, ids)
    errs = read_jsonl(errors_path(out))
    assert sorted(e["custom_id"] for e in errs) == [f"bad{i}" for i in range(5)]
    assert errs[0]["response"]["status_code"] == 400
    assert errs[0]["error"]["code"] == "invalid_request_error"
    assert "needs 'prompt' or 'input_ids'" in errs[0]["error"]["message"]
    assert st["invalid"] == 5  # each sent once: a 400 is not retried


def test_bad_input_is_refused_before_sending(tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(
        inp,
        5,
        extra=[
            json.dumps(
                {"custom_id": "r2", "method": "POST", "url": "/v1/infer", "body": {"prompt": "x"}}
            )
        ],
    )
    with sim_server() as sim:
        res = run_batch(inp, out, sim.url)
        assert res.returncode == 2
        assert "duplicate custom_id 'r2' on lines 3, 6" in res.stderr
        assert sim.stats()["received"] == 0

        ids = write_input(inp, 5, extra=["{oops", '{"custom_id": "x"}'])
        res = run_batch(inp, out, sim.url, extra=("--strict",))
        assert res.returncode == 2 and "line 6: not valid JSON" in res.stderr
        assert sim.stats()["received"] == 0

        res = run_batch(inp, out, sim.url)
        assert res.returncode == 0, res.stderr
        assert "skipping 2 malformed line(s)" in res.stderr
        assert "line 7: custom_id 'x': 'method' must be" in res.stderr
        assert_each_once(out, ids)


def test_sigint_finishes_in_flight_then_resumes(tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = write_input(inp, 600)
    with sim_server("--slots", "4", "--service-ms", "20") as sim:
        proc = subprocess.Popen(
            batch_cmd(inp, out, sim.url),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "COLUMNS": "200"},
        )
        deadline = time.monotonic() + 20
        while sim.stats()["ok"] < 100 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert "Resume with the same command" in err and "tailguard batch" in err
        partial = id_counts(out)
        assert 100 <= len(partial) < 600 and max(partial.values()) == 1

        res = run_batch(inp, out, sim.url)
        assert res.returncode == 0, res.stderr
        assert "resuming from" in res.stderr
        st = sim.stats()
    assert_each_once(out, ids)
    # In-flight requests were finished and recorded at the interrupt, not abandoned: the
    # server executed each request exactly once across both runs.
    assert st["ok"] == 600


def test_deadline_expired_504_is_retried(tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = write_input(inp, 150)
    # One slot, 10 ms each, 25 ms queue deadline: the first wave of 8 cannot all make it.
    args = ("--slots", "1", "--service-ms", "10", "--growth", "0", "--queue-deadline-ms", "25")
    with sim_server(*args) as sim:
        res = run_batch(inp, out, sim.url, extra=("--sla-ms", "500"))
        st = sim.stats()
    assert res.returncode == 0, res.stderr
    assert_each_once(out, ids)
    assert summary(out)["retry_reasons"]["504"] == st["expired"] > 0
    assert st["ok"] == 150


def test_retry_failed_resends_only_the_failures(tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = write_input(inp, 20)
    args = ("--overload-for-s", "600", "--overload-retry-after-s", "0.05")
    with sim_server(*args) as swamped:
        res = run_batch(inp, out, swamped.url, extra=("--max-attempts", "1"))
    assert res.returncode == 1
    errs = read_jsonl(errors_path(out))
    assert len(errs) == 20 and errs[0]["response"]["status_code"] == 503
    assert errs[0]["error"]["code"] == "overloaded"
    assert "gave up after 1 attempts" in errs[0]["error"]["message"]
    with sim_server() as healthy:
        res = run_batch(inp, out, healthy.url)  # without --retry-failed: nothing to do
        assert res.returncode == 1 and healthy.stats()["received"] == 0
        res = run_batch(inp, out, healthy.url, extra=("--retry-failed",))
        assert res.returncode == 0, res.stderr
        assert healthy.stats()["ok"] == 20
    assert_each_once(out, ids)
    assert read_jsonl(errors_path(out)) == []


def test_rate_cap(tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = write_input(inp, 150)
    with sim_server("--slots", "64", "--service-ms", "5") as sim:  # could do ~8,000/s
        res = run_batch(inp, out, sim.url, extra=("--max-rps", "100"))
    assert res.returncode == 0, res.stderr
    assert_each_once(out, ids)
    s = summary(out)
    # 150 starts at 100/s with a 5-token burst: ~1.45 s; uncapped this takes ~0.1 s.
    assert 1.3 <= s["makespan_s"] <= 3.0, s["makespan_s"]
