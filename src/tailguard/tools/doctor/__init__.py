"""`tailguard doctor`: attribute a latency spike to its cause from the evidence of one window.

    collect.py      scrape /metrics, Envoy /stats, Prometheus, or read a recorded folder
    snapshot.py     flat metric snapshots, histogram deltas, the text/JSON parsers
    loadreport.py   a `tailguard load` report as client-side evidence
    vllm.py         a vLLM server's names mapped onto tailguard's
    observation.py  one window of evidence and the symptom (was the SLA missed?)
    finding.py      Cause, Evidence, Finding: what every rule returns
    rules.py        fragmentation, starvation, churn
    rules_engine.py overload, admission mis-calibration, prefill-heavy, KV exhaustion
    rules_host.py   noisy neighbour, GC pauses
    diagnosis.py    run the rules: causes (SLA missed) or risks (met); exit codes
    thresholds.py   every threshold, with why it was chosen
    report.py       text and JSON output
    cli.py          the command

Never imports torch, tailguard.engine or tailguard.server: it runs anywhere a client runs.
"""

from tailguard.tools.doctor.collect import CollectConfig, CollectError, collect, load_recorded
from tailguard.tools.doctor.diagnosis import Diagnosis, diagnose
from tailguard.tools.doctor.finding import Cause, Finding
from tailguard.tools.doctor.observation import Observation, ServerWindow

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
