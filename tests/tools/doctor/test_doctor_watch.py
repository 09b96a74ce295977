"""The doctor's own evidence: the /health probe and /proc samples of a local server."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

from tests.tools.doctor.doctor_testkit import Replay

from tailguard.tools.doctor.watch import (
    Watcher,
    _cpu_and_threads,
    host_processes,
    neighbours_between,
    pid_listening_on,
    process_tree,
    runq_wait,
)

BUSY = "import threading\nx=0\nwhile True: x+=1\n"


def test_finds_the_listening_process_and_its_children() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert pid_listening_on(port) == os.getpid()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in process_tree(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert pid_listening_on(1) is None  # nothing listens on port 1


def test_counts_runnable_threads_of_a_busy_process() -> None:
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        time.sleep(0.3)
        samples = []
        for _ in range(10):
            samples.append(_cpu_and_threads([busy.pid]))
            time.sleep(0.02)
        cpu, threads, _ = samples[-1]
        assert threads >= 1 and cpu > 0.1
        assert max(r for _, _, r in samples) >= 1  # a spinning thread is in state R
    finally:
        busy.kill()
        busy.wait()


async def test_watcher_probes_and_samples_a_local_server() -> None:
    server = Replay({"/health": ["ok"]})
    with server.running() as url:
        w = Watcher(url, url, "/health", server.port, timeout_s=2.0)
        await w.start()
        await asyncio.sleep(0.6)
        watch = await w.stop()
    assert len(watch.probe_latencies) >= 3
    assert all(0 < x < 1 for x in watch.probe_latencies)
    assert watch.proc is not None and watch.proc.pids[0] == os.getpid()
    assert watch.proc.samples >= 3 and watch.proc.threads_max >= 2  # the replay thread


def test_neighbours_are_other_processes_busiest_first() -> None:
    before = {1: (10.0, "server"), 2: (5.0, "load"), 3: (0.0, "hog"), 4: (1.0, "idle")}
    after = {1: (14.0, "server"), 2: (7.0, "load"), 3: (3.0, "hog"), 4: (1.001, "idle"),
             5: (0.5, "born in the window")}  # fmt: skip
    got = neighbours_between(before, after, exclude={1}, window_s=2.0)
    assert [(n.pid, n.cpu_cores) for n in got] == [(3, 1.5), (2, 1.0), (5, 0.25)]


def test_runq_wait_and_host_processes_read_this_host() -> None:
    procs = host_processes()
    assert os.getpid() in procs and "pytest" in procs[os.getpid()][1]
    waited = runq_wait([os.getpid()])
    assert waited is None or waited >= 0.0
