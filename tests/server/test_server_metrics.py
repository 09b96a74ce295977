"""The metrics are declared in two tables (REGISTERED, HOT) and created from them."""

from __future__ import annotations

import ast
from pathlib import Path

import tailguard
from tailguard.server.metrics import HOT, REGISTERED, ServerMetrics


def _class_annotations(cls: type) -> dict[str, str]:
    """A class's attribute annotations as written, read from its source file: a compiled
    (mypyc) class keeps no `__annotations__`."""
    pkg = Path(tailguard.__file__).parent  # the source, not the build folder's extension
    source = pkg.joinpath(*cls.__module__.split(".")[1:]).with_suffix(".py")
    tree = ast.parse(source.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    return {
        a.target.id: ast.unparse(a.annotation)
        for a in node.body
        if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
    }


def test_every_declared_metric_is_a_typed_attribute_and_nothing_else_is() -> None:
    declared = {spec.attr: spec.kind.__name__ for spec in REGISTERED}
    assert declared == _class_annotations(ServerMetrics)
    m = ServerMetrics(sla_s=0.15, max_num_seqs=8)
    try:
        for spec in REGISTERED:
            assert isinstance(getattr(m, spec.attr), spec.kind)
    finally:
        m.close()
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
