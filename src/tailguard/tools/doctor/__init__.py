"""`tailguard doctor`: attribute a latency spike to its cause from the evidence of one window.

    collect.py      scrape /metrics, Envoy /stats, Prometheus, or read a recorded folder
    snapshot.py     flat metric snapshots, histogram deltas, the text/JSON parsers
    loadreport.py   a `tailguard load` report as client-side evidence
    observation.py  one window of evidence and the symptom (is there a tail?)
    rules.py        one rule per cause -> Finding (numbers, confidence, fix); diagnose()
    thresholds.py   every threshold, with why it was chosen
    report.py       text and JSON output
    cli.py          the command

Never imports torch, tailguard.engine or tailguard.server: it runs anywhere a client runs.
"""

from tailguard.tools.doctor.collect import CollectConfig, CollectError, collect, load_recorded
from tailguard.tools.doctor.observation import Observation, ServerWindow
from tailguard.tools.doctor.rules import Cause, Diagnosis, Finding, diagnose

__all__ = [
    "Cause",
    "CollectConfig",
    "CollectError",
    "Diagnosis",
    "Finding",
    "Observation",
    "ServerWindow",
    "collect",
    "diagnose",
    "load_recorded",
]
