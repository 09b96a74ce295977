"""`tailguard load` as an LLM benchmark, over real sockets: the simulated engine behind the real
server, and the test server with known timings and a known capacity."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tailguard.cli import main
from tailguard.errors import ConfigError
from tailguard.tools.load.config import LoadConfig, Profile, SourceSpec, parse_sla
from tailguard.tools.load.records import RequestRecord
from tailguard.tools.load.runner import DEADLINE_HEADER, _Sender, run_load
from tailguard.tools.load.sources import BodySource

LENIENT = ["--max-send-lag", "1s", "--max-loop-lag", "1s", "--max-cpu", "8"]
CACHE_HITS = "tailguard_cache_hits_total"


def test_default_bodies_differ_so_the_degradation_cache_never_answers(
    simulated_server, tmp_path: Path
) -> None:
    """Under overload /v1/infer answers a repeated prompt from its cache; distinct ones it can't."""
    srv = simulated_server("--simulated-tokens-per-s", "5000")
    base = ["load", srv.url, "--profile", "burst", "--count", "300", "--quiet", *LENIENT]
    assert main([*base, "--report", str(tmp_path / "distinct")]) in (0, 1)
    assert srv.metric(CACHE_HITS) == 0
    result = json.loads((tmp_path / "distinct" / "result.json").read_text())
    assert "every body different" in result["config"]["source_text"]
    assert result["summary"]["errors_by_kind"].get("http 503", 0) > 0  # it was overloaded
    # the old behaviour, for contrast: one fixed body, answered from the cache under overload
    body = tmp_path / "fixed.json"
    body.write_text('{"prompt": "the same prompt for everyone", "top_k": 5}')
    fixed = [*base[:4], "--count", "1", "--body", str(body), "--quiet"]
    assert main(fixed) == 0  # stores the answer
    main([*base, "--body", str(body), "--report", str(tmp_path / "fixed")])
    assert srv.metric(CACHE_HITS) > 0
    fixed_result = json.loads((tmp_path / "fixed" / "result.json").read_text())
    assert "ONE BODY REPEATED" in fixed_result["config"]["source_text"]


def test_length_distributions_are_honoured_per_request(simulated_server) -> None:
    srv = simulated_server()
    spec = SourceSpec(input_len=(20, 40), output_len=(5, 9), seed=11)
    cfg = LoadConfig(srv.url, Profile("constant", rate=40, duration_s=1), endpoint="completions",
                     stream=True, source=spec)  # fmt: skip
    source = BodySource(cfg)
    res = asyncio.run(run_load(cfg, source=source))
    assert res.summary.total == 40 and res.summary.ok == 40, res.summary.errors_by_kind
    for r in res.records:
        planned = source.body(r.i)
        assert r.prompt_tokens == planned.input_tokens  # the server's usage count
        assert r.output_tokens == planned.output_tokens  # ignore_eos: exactly max_tokens
        assert r.ttft_s is not None and r.itl_s is not None
        assert len(r.itl_s) == r.output_tokens - 1  # one content event per token
    s = res.summary
    assert s.prompt_tokens.min is not None and s.prompt_tokens.min >= 20
    assert s.prompt_tokens.max is not None and s.prompt_tokens.max <= 40
    assert s.output_tokens.total == sum(source.body(i).output_tokens or 0 for i in range(40))
    assert {r.output_tokens for r in res.records} == {5, 6, 7, 8, 9}


def test_ttft_itl_tpot_against_known_timings(local_server) -> None:
    # first event after delay + one token delay (70 ms), then one every 20 ms
    srv = local_server("--delay", "0.05", "--token-delay", "0.02")
    spec = SourceSpec(input_len=(16, 16), output_len=(6, 6))
    cfg = LoadConfig(srv.url, Profile("constant", rate=10, duration_s=1), endpoint="completions",
                     stream=True, source=spec)  # fmt: skip
    res = asyncio.run(run_load(cfg))
    s = res.summary
    assert s.ok == 10 and s.ttft.count == 10
    assert all(r.output_tokens == 6 and r.prompt_tokens == 16 for r in res.records)
    assert s.ttft.p50 is not None and 0.068 <= s.ttft.p50 <= 0.09, s.ttft
    assert s.itl.count == 50 and s.itl.p50 is not None and 0.018 <= s.itl.p50 <= 0.03, s.itl
    assert s.tpot.p50 is not None and 0.018 <= s.tpot.p50 <= 0.03, s.tpot
    # e2e = TTFT + 5 more tokens (+ the usage event)
    assert s.latency.p50 is not None and 0.16 <= s.latency.p50 <= 0.2, s.latency
    assert s.output_tokens_per_s > 0 and s.output_tokens.total == 60


def test_goodput_counts_requests_missing_one_slo_term(local_server, tmp_path: Path) -> None:
    # every 4th request's first token comes 200 ms late: it misses ttft, meets e2e
    srv = local_server("--delay", "0.01", "--token-delay", "0.005", "--slow-every", "4",
                       "--slow-delay", "0.2")  # fmt: skip
    code = main(
        ["load", srv.url, "--endpoint", "chat", "--stream", "--random-input-len", "8"]  # noqa: RUF005
        + ["--random-output-len", "4", "--profile", "constant", "--rate", "20", "--duration", "1s"]
        + ["--sla", "ttft<=100ms", "--sla", "e2e<=1s", "--sla", "goodput>=14/s"]
        + ["--report", str(tmp_path), "--csv", "--quiet", *LENIENT]
    )
    result = json.loads((tmp_path / "result.json").read_text())
    s = result["summary"]
    assert s["total"] == 20 and s["ok"] == 20
    assert s["slo_met"] == {"ttft<=100ms": 15, "e2e<=1s": 20}
    assert s["good"] == 15 and s["goodput"] == 15.0
    assert [x["passed"] for x in result["sla"]] == [False, True, True]  # 75 % < 99 %
    assert code == 1
    assert "ttft_s" in (tmp_path / "requests.csv").read_text().splitlines()[0]
    page = (tmp_path / "report.html").read_text()
    assert "TPOT (time per output token)" in page and "Goodput 15.00/s" in page


def test_sweep_finds_the_knee_of_a_known_capacity(local_server, tmp_path: Path) -> None:
    # 4 at a time, 50 ms each: 80 requests/s; above it the queue grows and p90 passes 100 ms
    srv = local_server("--capacity", "4", "--delay", "0.05")
    code = main(
        ["load", srv.url, "--profile", "sweep", "--duration", "1s", "--steps", "6"]  # noqa: RUF005
        + ["--concurrency", "16", "--arrivals", "constant", "--sla", "p90<=100ms"]
        + ["--report", str(tmp_path), "--quiet", *LENIENT]
    )
    d = json.loads((tmp_path / "result.json").read_text())
    assert code == 0, d["verdict"]
    sync, top = d["probes"]
    assert 15 <= sync["throughput_rps"] <= 20.5  # 1 in flight x 50 ms
    assert 65 <= top["throughput_rps"] <= 81  # the max: 4 / 50 ms
    rates = [p["offered_rps"] for p in d["points"]]
    assert len(rates) == 6 and rates[0] == sync["throughput_rps"]
    assert rates[-1] > 80  # past saturation
    step = rates[1] - rates[0]
    knee = d["knee"]["offered_rps"]
    assert abs(knee - 80) <= step, (knee, rates)
    assert not d["points"][-1]["sla_passed"]
    steps = sorted(p.name for p in (tmp_path / "steps").iterdir())
    assert len(steps) == 8 and steps[0] == "00-synchronous"
    page = (tmp_path / "report.html").read_text()
    assert page.count("<svg") == 2 and "knee" in page  # no tokens: no tokens/s chart


def test_sweep_with_given_rates_and_compare(local_server, tmp_path: Path, capsys) -> None:
    """A: capacity 4 (80/s), 6 steps; B: capacity 8 (160/s), 3 steps over the same range."""
    for name, capacity, steps in (("a", "4", "6"), ("b", "8", "3")):
        srv = local_server("--capacity", capacity, "--delay", "0.05")
        main(
            ["load", srv.url, "--profile", "sweep", "--rate", "20", "--to-rate", "130"]  # noqa: RUF005
            + ["--steps", steps, "--duration", "1s", "--arrivals", "constant"]
            + ["--sla", "p90<=100ms", "--report", str(tmp_path / name), "--quiet", *LENIENT]
        )
    a = json.loads((tmp_path / "a" / "result.json").read_text())
    assert a["probes"] == []
    assert [p["offered_rps"] for p in a["points"]] == [20, 42, 64, 86, 108, 130]
    assert a["knee"]["offered_rps"] == 64  # 86/s over 80/s: a third of requests queue > 50 ms
    capsys.readouterr()
    out = tmp_path / "cmp"
    code = main(["load", "compare", str(tmp_path / "a"), str(tmp_path / "b" / "result.json"),
                 "--report", str(out), "--json", "--quiet"])  # fmt: skip
    assert code == 0
    rows = {r["metric"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    knee = rows["knee (offered)"]
    assert (knee["a"], knee["b"], knee["ratio"]) == (64, 130, 130 / 64)  # B holds every step
    # rates both sweeps have: 20 and 130 (B's 75 is not one of A's)
    assert {m for m in rows if m.startswith("goodput at")} == {
        "goodput at 20/s",
        "goodput at 130/s",
    }
    assert rows["goodput at 130/s"]["ratio"] > 1.5  # A is saturated there, B is not
    page = (out / "compare.html").read_text()
    assert page.count("<svg") == 2 and "a: throughput" in page and "b: throughput" in page
    assert "a: knee 64/s" in page and "b: knee 130/s" in page


def test_compare_two_single_runs_with_ratios(local_server, tmp_path: Path, capsys) -> None:
    srv = local_server("--delay", "0.01")
    for name, rate in (("one", "20"), ("two", "40")):
        main(["load", srv.url, "--rate", rate, "--duration", "1s", "--quiet",
              "--report", str(tmp_path / name), *LENIENT])  # fmt: skip
    capsys.readouterr()
    code = main(["load", "compare", str(tmp_path / "one"), str(tmp_path / "two"), "--json"])
    assert code == 0
    rows = {r["metric"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["requests sent"]["a"] == 20 and rows["requests sent"]["b"] == 40
    assert rows["requests sent"]["ratio"] == 2.0
    assert rows["throughput (sent / window)"]["ratio"] == 2.0
    # a run and a sweep do not compare; a missing file is a clear error (exit 2)
    bad = tmp_path / "no.json"
    assert main(["load", "compare", str(tmp_path / "one"), str(bad)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_dataset_in_batch_format_drives_the_load(local_server, tmp_path: Path) -> None:
    srv = local_server()
    f = tmp_path / "batch.jsonl"
    f.write_text(
        "\n".join(
            json.dumps(
                {
                    "custom_id": f"r{i}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {"prompt": f"question {i}", "max_tokens": 4},
                }
            )
            for i in range(25)
        )
    )
    code = main(["load", srv.url, "--dataset", str(f), "--profile", "burst", "--count", "50",
                 "--json", "--quiet", *LENIENT, "--report", str(tmp_path / "r")])  # fmt: skip
    assert code == 0
    assert srv.stats()["requests"] == 50 and srv.stats()["distinct_bodies"] == 25
    result = json.loads((tmp_path / "r" / "result.json").read_text())
    assert "BODIES REPEAT: 50 requests cycle through 25 bodies" in result["config"]["source_text"]
    assert result["config"]["source"]["distinct_bodies"] == 25
    assert result["summary"]["output_tokens"]["total"] == 200  # usage of 50 x 4 tokens


def test_probe_workers_wait_out_a_refusal_instead_of_hammering(local_server) -> None:
    srv = local_server("--fail-every", "1")  # every request: 503 with Retry-After: 1
    prof = Profile("ramp", to_inflight=2, steps=1, hold_s=0.5)
    res = asyncio.run(run_load(LoadConfig(srv.url, prof, reject_backoff_s=0.2)))
    # each of 2 workers: a refusal, 0.2 s wait, ... over 0.5 s: 3 requests
    assert res.summary.total == srv.stats()["requests"] == 6, res.summary.total
    assert all(r.retry_after_s == 1.0 for r in res.records)
    hammered = asyncio.run(run_load(LoadConfig(srv.url, prof)))
    assert hammered.summary.total > 50  # without the wait: as fast as refusals come back


def test_random_token_ids_come_from_the_servers_vocabulary(
    simulated_server, tmp_path: Path
) -> None:
    """--tokenizer with a 32,000-token vocabulary against a server whose model has 259 tokens
    (the simulated engine's byte tokenizer): ids must come from the server's vocabulary, which
    it lists in /v1/models, or every request is a 400."""
    from tailguard.model.embedded import TOKENIZER_FILE, mistral_v1_tokenizer_path

    (tmp_path / TOKENIZER_FILE).write_bytes(mistral_v1_tokenizer_path().read_bytes())
    srv = simulated_server()
    report = tmp_path / "run"
    code = main(["load", srv.url, "--endpoint", "completions", "--stream", "--tokenizer",
                 str(tmp_path), "--random-input-len", "24", "--random-output-len", "4",
                 "--rate", "40", "--duration", "1s", "--quiet", *LENIENT,
                 "--report", str(report)])  # fmt: skip
    result = json.loads((report / "result.json").read_text())
    s = result["summary"]
    assert code == 0 and s["ok"] == s["total"] == 40, s["errors_by_kind"]
    assert s["prompt_tokens"]["min"] == s["prompt_tokens"]["max"] == 24
    src = result["config"]["source"]
    assert src["server_vocab"] == 259 and src["token_ids"] == [3, 259]
    assert "the server's vocabulary" in result["config"]["source_text"]


def test_deadline_propagation_sends_the_budget_left_after_the_clients_own_lag() -> None:
    """`--deadline auto` takes the SLO term the server's deadline stands for; a late send
    propagates less of it, and a send already past it still carries a positive 1 ms."""
    prof = Profile("constant", rate=10, duration_s=1)
    stream = LoadConfig("http://x", prof, endpoint="completions", stream=True,
                        sla=(parse_sla("ttft<=150ms"), parse_sla("e2e<=2s")))  # fmt: skip
    assert stream.deadline_s() == 0.15  # a stream's deadline event is its first token
    plain = LoadConfig("http://x", prof, sla=(parse_sla("p99<=150ms"),))
    assert plain.deadline_s() == 0.15  # the goodput bound
    assert LoadConfig("http://x", prof).deadline_s() is None  # no SLA: nothing to propagate
    assert LoadConfig("http://x", prof, deadline="off", sla=plain.sla).deadline_s() is None
    sender = _Sender(plain, None, None, None)  # type: ignore[arg-type]
    late = RequestRecord(0, intended_s=1.0, sent_s=1.04)
    assert sender._headers(late)[DEADLINE_HEADER] == "110"
    early = RequestRecord(1, intended_s=1.0, sent_s=0.9995)  # a timer that fired early
    assert sender._headers(early)[DEADLINE_HEADER] == "150"
    gone = RequestRecord(2, intended_s=1.0, sent_s=1.3)
    assert sender._headers(gone)[DEADLINE_HEADER] == "1"
    with pytest.raises(ConfigError, match="--deadline"):
        LoadConfig("http://x", prof, deadline=0.0)


def test_the_server_plans_against_the_propagated_deadline(simulated_server) -> None:
    """Over real sockets: the same requests are answered with the SLA's budget and refused at
    once when the client says 1 ms of it is left."""
    srv = simulated_server()
    prof = Profile("constant", rate=20, duration_s=0.5)
    sla = (parse_sla("p99<=150ms"),)
    ok = asyncio.run(run_load(LoadConfig(srv.url, prof, sla=sla)))
    assert ok.summary.ok == ok.summary.total == 10, ok.summary.errors_by_kind
    gone = asyncio.run(run_load(LoadConfig(srv.url, prof, sla=sla, deadline=0.001)))
    assert gone.summary.ok == 0 and gone.summary.total == 10
    assert set(gone.summary.errors_by_kind) <= {"http 503", "http 504"}, gone.summary
