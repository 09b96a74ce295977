"""The metrics are declared in two tables (REGISTERED, HOT) and created from them."""

from __future__ import annotations

import typing

from tailguard.server.metrics import HOT, REGISTERED, ServerMetrics


def test_every_declared_metric_is_a_typed_attribute_and_nothing_else_is() -> None:
    hints = typing.get_type_hints(ServerMetrics)
    declared = {spec.attr: spec.kind for spec in REGISTERED}
    assert declared == {name: hints[name] for name in hints}
    names = [spec.name for spec in REGISTERED] + [spec.name for spec in HOT.values()]
    assert len(names) == len(set(names))


def test_a_fresh_server_exposes_every_declared_family() -> None:
    m = ServerMetrics(sla_s=0.15, max_num_seqs=8)
    try:
        m.answered("infer", "ok", 0.01)
        text = m.render().decode()
    finally:
        m.close()
    for spec in REGISTERED:
        if not spec.labels:  # a labelled family shows once it has a child
            assert f"# TYPE {spec.name}" in text, spec.name
    for spec in HOT.values():
        assert f"# TYPE {spec.name} histogram" in text, spec.name
    assert 'tailguard_requests_total{endpoint="infer",outcome="ok"} 1.0' in text
    assert "tailguard_sla_seconds 0.15" in text
