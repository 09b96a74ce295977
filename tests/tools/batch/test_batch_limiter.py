"""The pace parts stepped by hand: adaptive limit, token bucket, backoff, endpoint pool."""

from __future__ import annotations

import itertools
import random

import pytest

from tailguard.errors import ConfigError
from tailguard.tools.batch.endpoints import EndpointPool
from tailguard.tools.batch.limiter import (
    AdaptiveLimit,
    LimiterConfig,
    TokenBucket,
    backoff_delay,
)

SLA = 0.150


def fill(lim: AdaptiveLimit) -> None:
    while lim.has_room():
        lim.on_send()


def complete_window(lim: AdaptiveLimit, latency_s: float, now: float) -> float:
    """Run the limiter for one window at its limit with every request taking latency_s."""
    fill(lim)
    for _ in range(max(4, lim.current // 2) + 1):
        lim.on_success(latency_s, now)
        lim.on_send()
        now += latency_s / max(1, lim.current)
    return now


def queueing_server_latency(in_flight: int, slots: int = 16, service_s: float = 0.02) -> float:
    """A server with `slots` workers: past saturation, latency grows with the queue."""
    return service_s * max(1.0, in_flight / slots)


def test_grows_while_latency_is_far_below_target() -> None:
    lim = AdaptiveLimit(LimiterConfig(sla_s=SLA, initial=8))
    now = 0.0
    for _ in range(5):
        now = complete_window(lim, 0.010, now)
    assert lim.current >= 28  # about x1.5 per window (smoothed) while far below the target


def test_shrinks_when_latency_exceeds_target() -> None:
    lim = AdaptiveLimit(LimiterConfig(sla_s=SLA, initial=100))
    complete_window(lim, 0.140, 0.0)  # p90 way over the 75 ms target
    assert lim.current < 100


def test_converges_to_the_target_against_a_queueing_server() -> None:
    cfg = LimiterConfig(sla_s=SLA, initial=4)
    lim = AdaptiveLimit(cfg)
    now = 0.0
    history = []
    for _ in range(40):
        now = complete_window(lim, queueing_server_latency(lim.current), now)
        history.append(lim.current)
    latency = queueing_server_latency(lim.current)
    # Latencies without spread (p99 == p90): the target rises to its cap, 0.8 x SLA.
    assert lim.target_s == pytest.approx(cfg.max_fraction * SLA)
    # Settles where latency is the target, so every slot stays busy (limit >= slots) and the
    # SLA keeps its headroom; and it stays there.
    assert lim.current >= 16
    assert 0.8 * lim.target_s <= latency <= 1.1 * lim.target_s
    assert max(history[-10:]) - min(history[-10:]) <= 0.15 * lim.current


def test_does_not_grow_when_the_client_is_the_bottleneck() -> None:
    lim = AdaptiveLimit(LimiterConfig(sla_s=SLA, initial=64))
    now = 0.0
    for _ in range(200):  # only one request at a time: no evidence the server wants more
        lim.on_send()
        lim.on_success(0.005, now)
        now += 0.005
    assert lim.current == 64


def test_overload_cuts_once_per_typical_latency() -> None:
    lim = AdaptiveLimit(LimiterConfig(sla_s=SLA, initial=100, backoff_ratio=0.8))
    fill(lim)
    for _ in range(50):  # fifty 503s for requests that were in flight together
        lim.on_overload(1.0)
    assert lim.current == 80
    lim.on_send()
    lim.on_overload(2.0)  # a later, separate signal cuts again
    assert lim.current == 64


def test_limit_stays_within_bounds() -> None:
    lim = AdaptiveLimit(LimiterConfig(sla_s=SLA, initial=2, max_limit=10))
    now = 0.0
    for _ in range(30):
        now = complete_window(lim, 0.001, now)
    assert lim.current == 10
    for i in range(100):
        lim.on_send()
        lim.on_overload(10.0 + i)
    assert lim.current == 1


def test_slow_server_target_follows_its_floor() -> None:
    # A server that takes 100 ms even unloaded: a 75 ms target would pin the limit at 1.
    lim = AdaptiveLimit(LimiterConfig(sla_s=SLA, initial=4))
    now = 0.0
    for _ in range(5):
        now = complete_window(lim, 0.100, now)
    assert lim.target_s == pytest.approx(0.135)  # min(1.5 x 100 ms, 0.9 x SLA)
    assert lim.current >= 4


def test_config_refuses_bad_values() -> None:
    with pytest.raises(ConfigError, match="initial limit"):
        LimiterConfig(sla_s=SLA, initial=0)
    with pytest.raises(ConfigError, match="sla"):
        LimiterConfig(sla_s=0)


def test_token_bucket_spaces_requests_at_the_rate() -> None:
    bucket = TokenBucket(rate=100.0, burst=1.0, now=0.0)
    waits = [bucket.reserve(0.0) for _ in range(5)]
    assert waits == pytest.approx([0.0, 0.01, 0.02, 0.03, 0.04])
    # After a pause the bucket refills only up to its burst.
    assert bucket.reserve(10.0) == 0.0
    assert bucket.reserve(10.0) == pytest.approx(0.01)


def test_backoff_full_jitter_and_retry_after() -> None:
    rng = random.Random(1)
    for attempt in range(1, 12):
        bound = min(10.0, 0.1 * 2 ** (attempt - 1))
        d = backoff_delay(attempt, base_s=0.1, cap_s=10.0, retry_after_s=None, rng=rng)
        assert 0.0 <= d <= bound
    for _ in range(100):
        d = backoff_delay(3, base_s=0.1, cap_s=10.0, retry_after_s=2.0, rng=rng)
        assert 2.0 <= d <= 2.4  # never before Retry-After; spread over min(bound, 2 s)
    spread = {round(backoff_delay(5, base_s=0.1, cap_s=10.0, retry_after_s=None, rng=rng), 3)}
    spread |= {round(backoff_delay(5, base_s=0.1, cap_s=10.0, retry_after_s=None, rng=rng), 3)}
    assert len(spread) == 2  # jittered, not a fixed schedule


def make_pool(*urls: str) -> EndpointPool:
    return EndpointPool(
        urls,
        LimiterConfig(sla_s=SLA, initial=4),
        max_in_flight=100,
        eject_after=3,
        eject_base_s=1.0,
        eject_max_s=8.0,
    )


def test_pool_balances_least_outstanding() -> None:
    pool = make_pool("http://a", "http://b")
    picks = []
    for _ in range(6):
        ep = pool.pick(0.0)
        assert ep is not None
        pool.send(ep)
        picks.append(ep.url)
    assert picks.count("http://a") == 3 and picks.count("http://b") == 3
    a = pool.endpoints[0]
    pool.on_success(a, 0.01, 0.0)  # a now has fewer outstanding
    picked = pool.pick(0.0)
    assert picked is not None and picked.url == "http://a"


def test_pool_ejects_after_consecutive_failures_and_probes_back() -> None:
    pool = make_pool("http://a", "http://b")
    a, b = pool.endpoints
    gens = [pool.send(a) for _ in range(8)]
    pool.on_success(a, 0.01, 5.0)
    # 3 failures among few outcomes are no trend yet; 3 of 4 among 6 judged (2 x eject_after)
    # is.
    assert [pool.on_failure(a, 5.0, g) for g in gens[:3]] == [False, False, True]
    # The others were in flight when it went down: they do not eject it again.
    assert [pool.on_failure(a, 5.0, g) for g in gens[3:7]] == [False] * 4
    assert a.state(5.0) == "ejected" and a.stats.ejections == 1
    assert all(pool.pick(5.0) is b for _ in range(1))
    # After the ejection time: probing, one request at a time.
    assert a.state(6.1) == "probing"
    probe = pool.send(a)
    assert not a.available(6.1)
    assert pool.on_failure(a, 6.2, probe)  # a failed probe ejects again, for twice as long
    assert a.ejected_until == pytest.approx(8.2)
    pool.send(a)
    pool.on_success(a, 0.01, 8.3)
    assert a.state(8.3) == "healthy" and a.limiter.current == 4


def test_pool_honors_retry_after_for_the_endpoint() -> None:
    pool = make_pool("http://a")
    (a,) = pool.endpoints
    pool.send(a)
    pool.on_overload(a, 0.5, 1.0)
    assert pool.pick(1.2) is None
    assert pool.next_change(1.2) == pytest.approx(1.5)
    assert pool.pick(1.5) is a


def test_retry_after_holds_the_refused_load_without_idling_the_server() -> None:
    pool = make_pool("http://a")
    (a,) = pool.endpoints
    for _ in range(4):
        pool.send(a)
    pool.on_overload(a, 0.5, 1.0)  # refused at 4 in flight; 3 remain
    assert pool.pick(1.1) is None  # not back up to the refused load during Retry-After...
    pool.on_success(a, 0.01, 1.1)
    assert pool.pick(1.1) is a  # ...but fed as completions free room below it


def test_growth_slows_near_the_load_the_server_refused() -> None:
    lim = AdaptiveLimit(LimiterConfig(sla_s=SLA, initial=40))
    fill(lim)
    lim.on_overload(0.0)  # refused at 40 in flight
    assert lim.ceiling == 40 and lim.current == 32
    now, seen = 1.0, []
    for _ in range(6):  # latency far below target would double the limit without a ceiling
        now = complete_window(lim, 0.010, now + 1.0)
        seen.append(lim.current)
    assert seen[0] <= 37  # capped just under 90% of the refused load, then one step a window
    assert all(b - a <= 2 for a, b in itertools.pairwise(seen))
    assert seen[-1] > seen[0]  # still probing upward


def test_a_tail_over_the_sla_shrinks_the_limit_despite_a_good_p90() -> None:
    lim = AdaptiveLimit(LimiterConfig(sla_s=SLA, initial=40))
    fill(lim)
    now = 0.0
    for i in range(20):  # p90 of 10 ms, far below target, but 1 of 20 over the SLA
        lim.on_success(0.300 if i == 7 else 0.010, now)
        lim.on_send()
    assert lim.current < 40
    assert lim.ceiling == 40


def test_target_follows_the_tail_spread() -> None:
    lim = AdaptiveLimit(LimiterConfig(sla_s=SLA, initial=8))
    assert lim.target_s == pytest.approx(0.5 * SLA)  # before any evidence: half the SLA
    now = 0.0
    for i in range(1000):  # p90 20 ms, p99 40 ms: the tail is twice the p90
        lim.on_send()
        lim.on_success(0.040 if i % 100 >= 95 else 0.020, now)
        now += 0.001
    # Aim the p90 so the p99 (2x) lands at 0.9 x SLA.
    assert lim.target_s == pytest.approx(0.9 * SLA / 2, rel=0.01)


def test_refusals_over_budget_stop_the_growth() -> None:
    lim = AdaptiveLimit(LimiterConfig(sla_s=SLA, initial=20))
    now = 0.0
    for _ in range(3):  # fast answers: it grows
        now = complete_window(lim, 0.010, now + 1.0)
    grown = lim.current
    assert grown > 20 and lim.refusal_share == 0.0
    for i in range(5):  # 5 refusals among the next answers: 2-5%, over the 1% budget
        fill(lim)
        lim.on_overload(now + 10.0 * (i + 1))
    now += 100.0
    held = lim.current
    assert lim.refusal_share > 0.01
    for _ in range(3):  # latency far below target, yet no growth while over budget
        now = complete_window(lim, 0.010, now + 1.0)
    assert lim.current == held
