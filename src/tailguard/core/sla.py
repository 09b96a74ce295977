"""Latency histogram buckets at the SLA bounds: every tailguard latency histogram uses these,
so "share within 150 ms" is `bucket{le="0.15"} / count` exactly and "none over 200 ms" is
`bucket{le="0.2"} == count` (never `histogram_quantile`, which interpolates)."""

SLA_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.18, 0.2,
    0.25, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
