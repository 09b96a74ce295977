"""`tailguard lab`: reproduce each cause of a latency spike on this machine and prove the fix.

    scenarios.py   the five scenarios: broken side, fixed side, load, SLA
    setups.py      a side as data (server, optional Envoy in front) and `launch`
    procs.py       child processes, readiness, TLS certificate, CUDA check
    runner.py      run one side: start, load, doctor window, result
    report.py      side-by-side tails, confusion matrix, acceptance
    cli.py         the command
    naive_server.py  the runbook's FastAPI + thread-pool server (the server engineer's)

Never imports torch, tailguard.engine or tailguard.server: every server runs as a process.
"""
