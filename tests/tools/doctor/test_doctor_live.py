"""`tailguard doctor` as a real process collecting over real sockets.

Tiny aiohttp servers replay recorded scrapes: the first GET of a page gets the "before" text,
later GETs the "after" text, as a live server's counters would move over the window.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.tools.doctor.doctor_testkit import FIXTURES, Replay, fixture_pair, free_port

from tailguard.tools.doctor.snapshot import parse_prometheus_text


def doctor(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tailguard.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_live_churn_over_sockets_and_record_round_trip(tmp_path: Path) -> None:
    server = Replay({"/metrics": fixture_pair("churn_missed", "server-0")})
    envoy = Replay({"/stats": fixture_pair("churn_missed", "envoy")})
    with server.running() as s_url, envoy.running() as e_url:
        out = doctor("--server", s_url, "--envoy-admin", e_url, "--window", "300ms",
                     "--load-report", str(FIXTURES / "churn_missed"), "--host-cores", "2",
                     "--record", str(tmp_path / "rec"), "--json")  # fmt: skip
    assert out.returncode == 1, out.stderr + out.stdout
    doc = json.loads(out.stdout)
    assert doc["verdict"] == "churn"
    assert 0.3 <= doc["window_s"] < 5
    assert server.hits == {"/metrics": 2} and envoy.hits == {"/stats": 2}
    # the recording re-reads to the same verdict, offline
    again = doctor("--from-dir", str(tmp_path / "rec"), "--json")
    assert again.returncode == 1
    assert json.loads(again.stdout)["verdict"] == "churn"
    envoy_after = fixture_pair("churn_missed", "envoy")[1]
    assert (tmp_path / "rec" / "envoy.after.txt").read_text() == envoy_after
    # the doctor's own probe of the server was recorded too (about 3 probes in 300 ms)
    watch = json.loads((tmp_path / "rec" / "watch-0.json").read_text())
    assert len(watch["probe_latencies"]) >= 2
    # the replay server is on this host: its process and the host's CPU were sampled
    assert watch["proc"]["samples"] >= 1
    meta = json.loads((tmp_path / "rec" / "meta.json").read_text())
    assert 0.0 <= meta["host_cpu_busy"] <= 1.0
    assert isinstance(meta["neighbours"], list)  # other processes' CPU, read from /proc


def test_live_churn_cap_on_a_healthy_window_exits_three() -> None:
    server = Replay({"/metrics": fixture_pair("churn", "server-0")})
    envoy = Replay({"/stats": fixture_pair("churn", "envoy")})
    with server.running() as s_url, envoy.running() as e_url:
        out = doctor("--server", s_url, "--envoy-admin", e_url + "/stats", "--window", "0.2s",
                     "--no-proc", "--no-probe")  # fmt: skip
    assert out.returncode == 3, out.stderr + out.stdout
    assert "verdict: healthy_with_risk (exit 3)" in out.stdout


def test_live_vllm_server_over_sockets() -> None:
    server = Replay({"/metrics": fixture_pair("vllm_overload", "server-0")})
    with server.running() as url:
        # --no-proc: a replayed window is not this host's; its CPU (a busy shared machine) is not
        out = doctor("--server", url, "--window", "0.2s", "--sla", "2s", "--no-probe", "--no-proc",
                     "--json")  # fmt: skip
    assert out.returncode == 1, out.stderr + out.stdout
    doc = json.loads(out.stdout)
    assert doc["verdict"] == "overload"
    assert any("no deadline prediction" in x for x in doc["not_evaluated"])


def test_live_healthy_exits_zero() -> None:
    # The replay packs 60 s of counters into a 0.2 s window: GC seconds would read as 70% of
    # it. Healthy means no GC figures at all here; the GC rule has its own recorded window.
    pages = ["\n".join(x for x in p.splitlines() if "tailguard_gc_pause" not in x) + "\n"
             for p in fixture_pair("healthy", "server-0")]  # fmt: skip
    server = Replay({"/metrics": pages})
    envoy = Replay({"/stats": fixture_pair("healthy", "envoy")})
    with server.running() as s_url, envoy.running() as e_url:
        out = doctor("--server", s_url, "--envoy-admin", e_url + "/stats", "--window", "0.2s")
    assert out.returncode == 0, out.stderr + out.stdout
    assert "no standing risk seen" in out.stdout


def test_one_server_down_is_a_note_not_a_failure() -> None:
    server = Replay({"/metrics": fixture_pair("starvation", "server-0")})
    with server.running() as s_url:
        dead = f"http://127.0.0.1:{free_port()}"
        out = doctor("--server", s_url, "--server", dead, "--window", "0.2s", "--host-cores", "2",
                     "--no-proc")  # fmt: skip
    assert out.returncode == 1, out.stderr + out.stdout
    assert "verdict: starvation" in out.stdout
    assert f"skipped {dead}/metrics" in out.stdout


def test_nothing_answers_exits_two() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    out = doctor("--server", dead, "--envoy-admin", dead, "--window", "0.1s", "--timeout", "2s")
    assert out.returncode == 2
    assert "could not collect" in out.stderr and "no source answered" in out.stderr
    assert out.stdout == ""


def test_wrong_page_exits_two() -> None:
    server = Replay({"/metrics": ["<html>{{ this is a login page }}</html>"]})
    with server.running() as url:
        out = doctor("--server", url, "--window", "0.1s")
    assert out.returncode == 2
    assert "Prometheus text" in out.stderr


def _as_range_answer(scenario: str) -> str:
    """The fixture's two scrapes as a Prometheus query_range matrix (two points per series)."""
    before, after = (parse_prometheus_text(t) for t in fixture_pair(scenario, "server-0"))
    result = []
    for (name, labels), v1 in after.values.items():
        v0 = before.values.get((name, labels), 0.0)
        metric = {"__name__": name, "instance": "10.0.0.7:8000", "job": "tailguard", **dict(labels)}
        result.append({"metric": metric, "values": [[1000.0, str(v0)], [1060.0, str(v1)]]})
    return json.dumps({"status": "success", "data": {"resultType": "matrix", "result": result}})


def test_prometheus_range_query() -> None:
    prom = Replay({"/api/v1/query_range": [_as_range_answer("overload")]})
    with prom.running() as url:
        out = doctor("--prometheus", url, "--window", "60s", "--json")
    assert out.returncode == 1, out.stderr + out.stdout
    doc = json.loads(out.stdout)
    assert doc["verdict"] == "overload"
    assert doc["causes"][0]["where"] == "10.0.0.7:8000"
    assert prom.hits == {"/api/v1/query_range": 1}  # no waiting: the window is in Prometheus
