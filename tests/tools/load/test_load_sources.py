"""Request sources, SLO terms and goodput arithmetic, sweep rates and knee: no sockets."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from tailguard.errors import ConfigError
from tailguard.tools.load.analysis import RunFacts, analyse
from tailguard.tools.load.config import (
    LoadConfig,
    Profile,
    SourceSpec,
    parse_length,
    parse_sla,
)
from tailguard.tools.load.records import RequestRecord
from tailguard.tools.load.sources import BYTE_IDS, BodySource
from tailguard.tools.load.sweep import SweepPoint, find_knee, sweep_rates

BURST = Profile("burst", count=1)


def test_parse_length() -> None:
    assert parse_length("128", what="--random-input-len") == (128, 128)
    assert parse_length("64:256", what="--random-input-len") == (64, 256)
    for bad in ("0", "10:5", "x", "5:"):
        with pytest.raises(ConfigError, match="--random-input-len"):
            parse_length(bad, what="--random-input-len")


def test_parse_slo_terms() -> None:
    t = parse_sla("ttft<=150ms")
    assert (t.metric, t.threshold, t.per_request) == ("ttft", pytest.approx(0.15), True)
    assert parse_sla("tpot<=50ms").threshold == pytest.approx(0.05)
    assert parse_sla("e2e<=2s").threshold == 2.0
    assert parse_sla("itl<=100ms").metric == "itl"
    assert not parse_sla("p99<=1s").per_request
    for bad in ("ttft>=1s", "tpot<=5", "e2e(1s)<=2s"):
        with pytest.raises(ConfigError, match="--sla"):
            parse_sla(bad)


def test_config_refuses_clashing_sources_and_terms() -> None:
    with pytest.raises(ConfigError, match="needs token timings: add --stream"):
        LoadConfig("http://x", BURST, endpoint="chat", sla=(parse_sla("ttft<=1s"),))
    with pytest.raises(ConfigError, match="give one of them"):
        SourceSpec(dataset="f.jsonl", input_len=(1, 2))
    with pytest.raises(ConfigError, match="drop it"):
        LoadConfig("http://x", BURST, body=b"{}", source=SourceSpec(input_len=(1, 1)))
    with pytest.raises(ConfigError, match="generates no tokens"):
        LoadConfig("http://x", BURST, endpoint="infer", source=SourceSpec(output_len=(4, 4)))
    # e2e needs no stream, and alone it is enough for goodput
    cfg = LoadConfig("http://x", BURST, sla=(parse_sla("e2e<=1s"), parse_sla("goodput>=1/s")))
    assert [t.text for t in cfg.slo_terms()] == ["e2e<=1s"]


def test_sweep_profile_validation() -> None:
    with pytest.raises(ConfigError, match="--duration"):
        Profile("sweep")
    with pytest.raises(ConfigError, match="both --rate LOW and --to-rate HIGH"):
        Profile("sweep", duration_s=1, rate=5)
    with pytest.raises(ConfigError, match="must be above"):
        Profile("sweep", duration_s=1, rate=5, to_rate=5)
    with pytest.raises(ConfigError, match="--steps must be >= 2"):
        Profile("sweep", duration_s=1, steps=1)
    assert Profile("sweep", duration_s=2, steps=3).planned_duration_s() == 2


def _bodies(cfg: LoadConfig, n: int) -> list[dict[str, object]]:
    src = BodySource(cfg)
    return [orjson.loads(src.body(i).data) for i in range(n)]


def test_default_bodies_all_differ_and_say_so() -> None:
    cfg = LoadConfig("http://h:1", BURST, endpoint="infer")
    bodies = _bodies(cfg, 50)
    assert len({json.dumps(b) for b in bodies}) == 50
    assert all(str(b["prompt"]).startswith(cfg.prompt) for b in bodies)
    src = BodySource(cfg)
    assert src.distinct is None and not src.repeats(10**6)
    assert "every body different" in src.describe(50)
    fixed = BodySource(LoadConfig("http://h:1", BURST, body=b'{"a": 1}'))
    assert fixed.body(7).data == b'{"a": 1}' and fixed.repeats(2)
    assert "ONE BODY REPEATED" in fixed.describe(2)


def test_random_token_prompts_have_the_drawn_lengths_and_are_seeded() -> None:
    spec = SourceSpec(input_len=(20, 40), output_len=(5, 9), seed=3)
    cfg = LoadConfig("http://h:1", BURST, endpoint="completions", stream=True, source=spec)
    src = BodySource(cfg)
    bodies = [src.body(i) for i in range(200)]
    for b in bodies:
        obj = orjson.loads(b.data)
        assert isinstance(obj["prompt"], list) and len(obj["prompt"]) == b.input_tokens
        assert 20 <= len(obj["prompt"]) <= 40 and all(
            BYTE_IDS[0] <= t < BYTE_IDS[1] for t in obj["prompt"]
        )
        assert obj["max_tokens"] == b.output_tokens and 5 <= obj["max_tokens"] <= 9
        assert obj["ignore_eos"] is True and obj["stream"] is True
        assert obj["stream_options"] == {"include_usage": True}
    assert {b.input_tokens for b in bodies} == set(range(20, 41))  # the whole range is drawn
    assert len({b.data for b in bodies}) == 200
    # same seed, same bodies, whatever order they are built in; another seed, others
    again = BodySource(cfg)
    assert [again.body(i).data for i in reversed(range(200))][::-1] == [b.data for b in bodies]
    other = BodySource(LoadConfig("http://h:1", BURST, endpoint="completions",
                                  source=SourceSpec(input_len=(20, 40), seed=4)))  # fmt: skip
    assert other.body(0).data != bodies[0].data
    # a sweep's next step continues the sequence instead of repeating it
    assert src.at_offset(150).body(0).data == bodies[150].data


def test_random_chat_prompts_without_a_tokenizer_are_words() -> None:
    cfg = LoadConfig("http://h:1", BURST, endpoint="chat", source=SourceSpec(input_len=(12, 12)))
    b = BodySource(cfg).body(0)
    text = orjson.loads(b.data)["messages"][0]["content"]
    assert len(text.split()) == 12 and b.input_tokens is None  # the server's usage counts them
    assert "words (approximate)" in BodySource(cfg).describe()


def test_dataset_of_bodies_and_batch_lines(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    lines = [
        {"prompt": "a", "max_tokens": 3},
        {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}},
        {"model": "m2", "prompt": [5, 6, 7]},
    ]  # fmt: skip
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    spec = SourceSpec(dataset=str(f), output_len=(8, 8))
    cfg = LoadConfig("http://h:1/", BURST, endpoint="completions", stream=True, source=spec)
    src = BodySource(cfg)
    got = [src.body(i) for i in range(5)]
    assert [b.url for b in got] == [
        "http://h:1/v1/completions",
        "http://h:1/v1/chat/completions",  # the Batch line names its endpoint
        "http://h:1/v1/completions",
        "http://h:1/v1/completions",
        "http://h:1/v1/chat/completions",
    ]
    objs = [orjson.loads(b.data) for b in got]
    assert objs[0]["prompt"] == "a" and objs[0]["model"] == "tailguard-embedded"
    assert objs[2]["model"] == "m2"  # a body's own model is kept
    assert all(o["max_tokens"] == 8 and o["ignore_eos"] and o["stream"] for o in objs)
    assert got[3].data == got[0].data  # 5 requests over 3 lines: bodies repeat ...
    assert src.distinct == 3 and src.repeats(5) and not src.repeats(3)
    assert "BODIES REPEAT: 5 requests cycle through 3 bodies" in src.describe(5)  # ... and say so
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"custom_id": "a", "method": "POST", "url": "/v2/x", "body": {}}\n')
    with pytest.raises(ConfigError, match="line 1: a Batch line needs"):
        BodySource(LoadConfig("http://h:1", BURST, source=SourceSpec(dataset=str(bad))))
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="no request bodies"):
        BodySource(
            LoadConfig("http://h:1", BURST, source=SourceSpec(dataset=str(tmp_path / "e.jsonl")))
        )


def _facts(wall: float = 1.0) -> RunFacts:
    return RunFacts("t", wall, 0.1, [0.001] * 100, 1024, "asyncio")


def _rec(i: int, *, e2e: float, ttft: float, tpot: float, ok: bool = True) -> RequestRecord:
    r = RequestRecord(i, 0.0, sent_s=0.0, status=200 if ok else 503, ok=ok)
    r.latency_s = r.service_s = r.done_s = e2e
    r.ttft_s, r.tpot_s, r.itl_s = ttft, tpot, [tpot] * 3
    r.output_tokens, r.prompt_tokens = 4, 10
    r.error = None if ok else "http 503"
    return r


def test_goodput_counts_a_request_that_misses_one_slo_term_as_bad() -> None:
    recs = [_rec(i, e2e=0.5, ttft=0.1, tpot=0.02) for i in range(5)]  # good
    recs += [_rec(5, e2e=0.5, ttft=0.3, tpot=0.02), _rec(6, e2e=0.5, ttft=0.25, tpot=0.02)]
    recs += [_rec(7, e2e=0.5, ttft=0.1, tpot=0.08)]  # tpot only
    recs += [_rec(8, e2e=3.0, ttft=0.1, tpot=0.02)]  # e2e only
    recs += [_rec(9, e2e=0.01, ttft=0.001, tpot=0.001, ok=False)]  # failed: never good
    sla = tuple(parse_sla(t) for t in ("ttft<=200ms", "tpot<=50ms", "e2e<=2s", "goodput>=5/s"))
    cfg = LoadConfig("http://x", Profile("constant", rate=10, duration_s=1), stream=True,
                     endpoint="chat", sla=sla, slo_attainment=0.7)  # fmt: skip
    res = analyse(cfg, recs, [], _facts(wall=2.0), None, None)
    s = res.summary
    assert s.good == 5 and s.goodput == 5.0  # 5 good over the 1-s sending window
    assert s.slo_met == {"ttft<=200ms": 7, "tpot<=50ms": 8, "e2e<=2s": 8}
    assert [r.passed for r in res.sla] == [True, True, True, True]  # 70 %, 80 %, 80 % >= 70 %
    strict = analyse(
        LoadConfig("http://x", cfg.profile, stream=True, endpoint="chat", sla=sla),
        recs, [], _facts(wall=2.0), None, None,
    )  # fmt: skip
    assert [r.passed for r in strict.sla] == [False, False, False, True]  # 99 % needed
    assert "7 of 10 requests ok with ttft <= 200.0 ms" in strict.sla[0].detail
    assert s.output_tokens.total == 36 and s.output_tokens_per_s == 18.0  # 9 ok x 4 / 2 s wall
    assert s.ttft.count == 9 and s.itl.count == 27


def _point(rate: float, passed: bool, tput: float) -> SweepPoint:
    return SweepPoint(
        f"rate {rate}", "rate", rate, None, 10, 10, tput, None, None, None, None, None, None,
        None, None, None, 0.0, 1.0, True, passed, 0 if passed else 1,
    )  # fmt: skip


def test_sweep_rates_and_knee_rule() -> None:
    assert sweep_rates(10, 50, 5) == [10, 20, 30, 40, 50]
    pts = [
        _point(10, True, 10),
        _point(20, True, 19.5),
        _point(30, False, 24),
        _point(40, False, 25),
    ]
    knee, rule = find_knee(pts, with_sla=True)
    assert knee is not None and knee.offered_rps == 20 and "held every --sla term" in rule
    knee, rule = find_knee(pts, with_sla=False)  # 24 < 90 % of 30
    assert knee is not None and knee.offered_rps == 20 and "90%" in rule
    assert find_knee([_point(10, False, 1)], with_sla=True)[0] is None


def test_random_chat_text_from_a_tokenizer_vocabulary(tmp_path: Path) -> None:
    """--tokenizer DIR: chat prompts decoded from the vocabulary, without importing torch."""
    import subprocess
    import sys

    from tailguard.model.embedded import TOKENIZER_FILE, mistral_v1_tokenizer_path

    (tmp_path / TOKENIZER_FILE).write_bytes(mistral_v1_tokenizer_path().read_bytes())
    code = (
        "import sys, orjson\n"
        "from tailguard.tools.load.config import LoadConfig, Profile, SourceSpec\n"
        "from tailguard.tools.load.sources import BodySource\n"
        f"spec = SourceSpec(input_len=(40, 40), tokenizer={str(tmp_path)!r})\n"
        "cfg = LoadConfig('http://h:1', Profile('burst', count=1), endpoint='chat', source=spec)\n"
        "src = BodySource(cfg)\n"
        "tok = src.tokenizer\n"
        "text = orjson.loads(src.body(0).data)['messages'][0]['content']\n"
        "n = len(tok.encode(text, add_bos=False))\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('tailguard.engine')]\n"
        "print(src.id_range, n, bad, src.body(0).input_tokens)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    id_range, rest = out.stdout.split(")", 1)
    n, bad, planned = rest.split(maxsplit=2)
    assert id_range == "(259, 32000"  # past the specials and byte tokens of the v1 vocabulary
    assert 30 <= int(n) <= 60  # decoded text re-encodes to about as many tokens
    assert bad == "[]" and planned.strip() == "None"  # text: the server's usage counts it
