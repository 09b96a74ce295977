"""`tailguard fleet up|down|status`: N server replicas behind a real Envoy on this machine.

    tailguard fleet up --replicas 2          # starts replicas + Envoy, waits until all are ready
    tailguard fleet status
    tailguard fleet reload                   # Envoy hot restart (--restart-epoch N+1)
    tailguard fleet down                     # drains Envoy, stops replicas with SIGTERM

`up` starts each replica as `tailguard serve --host 127.0.0.1 --port P ...` (or `--server-cmd`,
any command line with {host} {port} {index} {python} placeholders), waits for every `/ready`,
renders the Envoy config with the same code as `tailguard deploy envoy` (sized from
`tailguard serve --print-config`), starts Envoy and waits until Envoy's health checks see every
replica healthy. Processes run in their own sessions and outlive this command; their pids,
ports and logs are in `--state-dir` (default `.tailguard/fleet`), which `down` reads.

`down` never uses `/quitquitquit`: it fails Envoy's health check (`/healthcheck/fail`) so an
upstream balancer stops sending, drains the listeners (`/drain_listeners?graceful`), waits the
drain time, then sends SIGTERM; replicas get SIGTERM (graceful shutdown) and SIGKILL only after
`--stop-timeout`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tailguard.deploy.envoy import (
    CLUSTER_NAME,
    EnvoySettings,
    Replica,
    ServerLimits,
    find_envoy,
    render_yaml,
)
from tailguard.errors import ConfigError

STATE_FILE = "fleet.json"


@dataclass(frozen=True)
class Proc:
    """One process the fleet started."""

    name: str
    pid: int
    cmd: list[str]
    log: str
    port: int  # replica: HTTP port; envoy: admin port
    start_ticks: int  # /proc/<pid>/stat start time: tells our process from a reused pid


@dataclass(frozen=True)
class FleetState:
    replicas: list[Proc]
    envoy: Proc | None
    listen: str  # URL clients send traffic to
    admin: str  # Envoy admin URL
    drain_time_s: int
    envoy_concurrency: int = 1
    epoch: int = 0  # Envoy hot-restart epoch: 0 at `up`, +1 per `reload`
    retired: list[Proc] = field(default_factory=list)  # earlier epochs, draining or gone

    def save(self, state_dir: Path) -> None:
        (state_dir / STATE_FILE).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, state_dir: Path) -> FleetState:
        path = state_dir / STATE_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(
                f"no fleet in {state_dir} ({path} missing): start one with "
                "`tailguard fleet up` or pass --state-dir"
            ) from exc
        envoy = data.get("envoy")
        return cls(
            replicas=[Proc(**p) for p in data["replicas"]],
            envoy=None if envoy is None else Proc(**envoy),
            listen=data["listen"],
            admin=data["admin"],
            drain_time_s=int(data["drain_time_s"]),
            envoy_concurrency=int(data.get("envoy_concurrency", 1)),
            epoch=int(data.get("epoch", 0)),
            retired=[Proc(**p) for p in data.get("retired", [])],
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="fleet_command", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="start N replicas and Envoy; wait until all are ready")
    down = sub.add_parser("down", help="drain Envoy and stop every process of the fleet")
    status = sub.add_parser("status", help="show the fleet's processes and health")
    reload = sub.add_parser(
        "reload", help="hot-restart Envoy with a new config (no connection dropped)"
    )
    reload.add_argument(
        "--envoy-config",
        default=None,
        help="new Envoy config (default: the state dir's envoy.yaml, e.g. edited in place)",
    )
    for p in (up, down, status, reload):
        p.add_argument(
            "--state-dir",
            default=".tailguard/fleet",
            help="where pids, logs and the Envoy config live",
        )
    up.add_argument("--replicas", type=int, default=2, help="server replicas (default 2)")
    up.add_argument("--model", default=None, help="model folder passed to `tailguard serve`")
    up.add_argument("--sla-ms", type=float, default=None, help="passed to `tailguard serve`")
    up.add_argument("--config", default=None, help="tailguard.toml passed to `tailguard serve`")
    up.add_argument(
        "--base-port",
        type=int,
        default=8001,
        help="first replica port (then +1 each); 0 picks free ports",
    )
    up.add_argument("--listen", default="127.0.0.1:10000", help="Envoy listener HOST:PORT")
    up.add_argument("--admin-port", type=int, default=9901, help="Envoy admin port (loopback)")
    up.add_argument("--tls-cert", default=None)
    up.add_argument("--tls-key", default=None)
    up.add_argument(
        "--server-cmd",
        default=None,
        help="replica command line instead of `tailguard serve`; placeholders "
        "{python} {host} {port} {index}",
    )
    up.add_argument(
        "--envoy-concurrency",
        type=int,
        default=1,
        help="Envoy worker threads (default 1: a small machine)",
    )
    up.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for every replica's /ready (model load + warm-up)",
    )
    up.add_argument(
        "--drain-time-s",
        type=int,
        default=5,
        help="Envoy's drain time in whole seconds, used by `down` and hot restarts",
    )
    down.add_argument(
        "--stop-timeout",
        type=float,
        default=30.0,
        help="seconds to wait after SIGTERM before SIGKILL",
    )


# --- processes ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        # Servers bind with SO_REUSEADDR, so TIME_WAIT leftovers do not make a port busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _start(name: str, cmd: list[str], log: Path, port: int) -> Proc:
    with log.open("ab") as out:
        # Own session: the fleet outlives this command and a Ctrl-C in this terminal.
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return Proc(
        name=name,
        pid=proc.pid,
        cmd=cmd,
        log=str(log),
        port=port,
        start_ticks=_proc_stat(proc.pid)[1],
    )


def _proc_stat(pid: int) -> tuple[str, int]:
    """(state, start time in clock ticks) of a pid; ("", 0) when it does not exist."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return "", 0
    return fields[0], int(fields[19])  # fields 3 and 22 of proc(5), counted after "(comm)"


def _alive(p: Proc) -> bool:
    """True if the pid still runs the process we started (pids are reused)."""
    state, ticks = _proc_stat(p.pid)
    return state not in ("", "Z", "X") and ticks == p.start_ticks


def _http(url: str, method: str = "GET", timeout_s: float = 2.0) -> tuple[int, str]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return int(resp.status), resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, str(exc)


def _tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_until(check: Any, procs: list[Proc], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        for p in procs:
            if not _alive(p):
                raise ConfigError(
                    f"{p.name} exited while waiting for {what}; last log lines "
                    f"({p.log}):\n{_tail(p.log)}"
                )
        time.sleep(0.2)
    raise ConfigError(
        f"timed out after {timeout_s:g} s waiting for {what}; logs in "
        f"{', '.join(p.log for p in procs)}"
    )


def _stop(p: Proc, timeout_s: float) -> str:
    if not _alive(p):
        return f"{p.name}: already gone"
    os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(p):
            return f"{p.name}: stopped (SIGTERM)"
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(p.pid, signal.SIGKILL)
    return f"{p.name}: killed after {timeout_s:g} s (SIGKILL); see {p.log}"


# --- up ----------------------------------------------------------------------------------------
def _serve_args(args: argparse.Namespace) -> list[str]:
    extra: list[str] = []
    if args.model is not None:
        extra += ["--model", args.model]
    if args.sla_ms is not None:
        extra += ["--sla-ms", f"{args.sla_ms:g}"]
    if args.config is not None:
        extra += ["--config", args.config]
    return extra


def _replica_cmd(args: argparse.Namespace, index: int, port: int) -> list[str]:
    if args.server_cmd is not None:
        fields = {"python": sys.executable, "host": "127.0.0.1", "port": port, "index": index}
        return [part.format(**fields) for part in shlex.split(args.server_cmd)]
    return [
        sys.executable,
        "-m",
        "tailguard.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *_serve_args(args),
    ]


def _server_limits(args: argparse.Namespace) -> ServerLimits:
    """The replicas' limits from `tailguard serve --print-config`; defaults if unavailable."""
    if args.server_cmd is not None:
        return ServerLimits()
    cmd = [sys.executable, "-m", "tailguard.cli", "serve", "--print-config", *_serve_args(args)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
        return ServerLimits.from_print_config(json.loads(out))
    except (subprocess.SubprocessError, ValueError, OSError) as exc:
        print(
            f"warning: `tailguard serve --print-config` failed ({exc}); sizing Envoy with "
            "default server limits",
            file=sys.stderr,
        )
        return ServerLimits()


def _all_healthy(admin: str, n: int) -> bool:
    status, body = _http(f"{admin}/clusters")
    healthy = [
        line
        for line in body.splitlines()
        if line.startswith(f"{CLUSTER_NAME}::") and "::health_flags::healthy" in line
    ]
    return status == 200 and len(healthy) == n


def _up(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    if (state_dir / STATE_FILE).exists():
        old = FleetState.load(state_dir)
        if any(_alive(p) for p in [*old.replicas, *([old.envoy] if old.envoy else [])]):
            raise ConfigError(
                f"a fleet is already running from {state_dir}: "
                "`tailguard fleet down` first, or use another --state-dir"
            )
    if args.replicas < 1:
        raise ConfigError(f"--replicas {args.replicas}: need at least 1")
    listen = Replica.parse(args.listen)
    ports = [args.base_port + i if args.base_port else _free_port() for i in range(args.replicas)]
    for port in [*ports, listen.port, args.admin_port]:
        if not _port_free(port):
            raise ConfigError(f"port {port} is in use: choose --base-port/--listen/--admin-port")

    limits = _server_limits(args)
    replicas: list[Proc] = []
    envoy: Proc | None = None
    scheme = "https" if args.tls_cert else "http"
    admin = f"http://127.0.0.1:{args.admin_port}"
    try:
        for i, port in enumerate(ports):
            replicas.append(
                _start(
                    f"replica-{i}",
                    _replica_cmd(args, i, port),
                    state_dir / f"replica-{i}.log",
                    port,
                )
            )
        _save(state_dir, replicas, None, args, scheme, listen, admin)
        _wait_until(
            lambda: all(_http(f"http://127.0.0.1:{p.port}/ready")[0] == 200 for p in replicas),
            replicas,
            args.ready_timeout,
            "every replica's /ready",
        )
        settings = EnvoySettings(
            replicas=tuple(Replica("127.0.0.1", p) for p in ports),
            listen_host=listen.host,
            listen_port=listen.port,
            admin_port=args.admin_port,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            server=limits,
        )
        config = state_dir / "envoy.yaml"
        config.write_text(render_yaml(settings))
        cmd = _envoy_cmd(state_dir, args.envoy_concurrency, args.drain_time_s, epoch=0)
        envoy = _start("envoy", cmd, state_dir / "envoy.log", args.admin_port)
        _save(state_dir, replicas, envoy, args, scheme, listen, admin)
        _wait_until(
            lambda: _all_healthy(admin, len(ports)),
            [*replicas, envoy],
            30.0,
            "Envoy to see every replica healthy",
        )
    except BaseException:
        for p in [*([envoy] if envoy else []), *replicas]:
            _stop(p, 5.0)
        (state_dir / STATE_FILE).unlink(missing_ok=True)
        raise
    print(f"fleet up: {len(ports)} replica(s) ready behind Envoy")
    print(f"  send traffic to  {scheme}://{listen.host}:{listen.port}/v1/...")
    print(f"  envoy admin      {admin}   metrics: {admin}/stats/prometheus")
    for p in replicas:
        print(f"  {p.name:<16} http://127.0.0.1:{p.port}   metrics: /metrics   log: {p.log}")
    print(f"  envoy config     {state_dir / 'envoy.yaml'}   log: {state_dir / 'envoy.log'}")
    print(f"  stop with        tailguard fleet down --state-dir {state_dir}")
    return 0


def _envoy_cmd(state_dir: Path, concurrency: int, drain_time_s: int, epoch: int) -> list[str]:
    base_id = (state_dir / "envoy.base-id").resolve()
    if epoch == 0:
        # A base id of its own, written to a file: a hot restart finds this Envoy by it, and
        # several fleets can share the machine.
        restart = ["--use-dynamic-base-id", "--base-id-path", str(base_id)]
    else:
        # The new epoch takes the listen sockets over from the running one, which drains for
        # --drain-time-s and is told to exit after --parent-shutdown-time-s.
        restart = [
            "--base-id",
            base_id.read_text().strip(),
            "--parent-shutdown-time-s",
            str(drain_time_s + 5),
        ]
    # Envoy exits when its parent does; the keeper stays as its parent (see keeper.py).
    return [
        sys.executable,
        "-m",
        "tailguard.deploy.keeper",
        str(find_envoy()),
        "-c",
        str((state_dir / "envoy.yaml").resolve()),
        "--concurrency",
        str(concurrency),
        "--drain-time-s",
        str(drain_time_s),
        "--restart-epoch",
        str(epoch),
        *restart,
        "-l",
        "warn",
    ]


def _save(
    state_dir: Path,
    replicas: list[Proc],
    envoy: Proc | None,
    args: argparse.Namespace,
    scheme: str,
    listen: Replica,
    admin: str,
) -> None:
    FleetState(
        replicas=replicas,
        envoy=envoy,
        listen=f"{scheme}://{listen.host}:{listen.port}",
        admin=admin,
        drain_time_s=args.drain_time_s,
        envoy_concurrency=args.envoy_concurrency,
    ).save(state_dir)


# --- down / status -----------------------------------------------------------------------------
def _down(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir)
    state = FleetState.load(state_dir)
    if state.envoy is not None and _alive(state.envoy):
        # Fail health checks first (a balancer in front stops sending), then drain: clients get
        # `Connection: close` / GOAWAY after their current request instead of a reset.
        _http(f"{state.admin}/healthcheck/fail", "POST")
        _http(f"{state.admin}/drain_listeners?graceful", "POST")
        time.sleep(min(state.drain_time_s, args.stop_timeout))
        print(_stop(state.envoy, args.stop_timeout))
    for p in state.retired:  # an earlier epoch still draining after a recent reload
        if _alive(p):
            print(_stop(p, args.stop_timeout))
    for p in state.replicas:
        print(_stop(p, args.stop_timeout))
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    print("fleet down")
    return 0


def _reload(args: argparse.Namespace) -> int:
    """Hot restart: never /quitquitquit, which would exit Envoy and drop every connection."""
    state_dir = Path(args.state_dir)
    state = FleetState.load(state_dir)
    if state.envoy is None or not _alive(state.envoy):
        raise ConfigError("Envoy is not running: `tailguard fleet down` then `up` again")
    config = state_dir / "envoy.yaml"
    if args.envoy_config is not None:
        new = Path(args.envoy_config).read_text()
        check = subprocess.run(
            [str(find_envoy()), "--mode", "validate", "--config-yaml", new],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check.returncode != 0:
            raise ConfigError(
                f"{args.envoy_config} does not load in Envoy; nothing changed:\n"
                f"{_last_lines(check.stdout + check.stderr)}"
            )
        config.write_text(new)
    epoch = state.epoch + 1
    cmd = _envoy_cmd(state_dir, state.envoy_concurrency, state.drain_time_s, epoch)
    envoy = _start("envoy", cmd, state_dir / f"envoy-epoch{epoch}.log", state.envoy.port)
    retired = [p for p in [*state.retired, state.envoy] if _alive(p)]
    replaced = replace(state, envoy=envoy, epoch=epoch, retired=retired)

    def live() -> bool:
        status, body = _http(f"{state.admin}/server_info")
        if status != 200:
            return False
        info = json.loads(body)
        return bool(
            info.get("state") == "LIVE"
            and int(info["command_line_options"]["restart_epoch"]) == epoch
        )

    _wait_until(live, [envoy], 30.0, f"Envoy epoch {epoch} to take over")
    replaced.save(state_dir)
    print(
        f"envoy hot-restarted: epoch {epoch} serves; epoch {epoch - 1} drains for "
        f"{state.drain_time_s} s, then exits"
    )
    return 0


def _last_lines(text: str, n: int = 8) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def _status(args: argparse.Namespace) -> int:
    state = FleetState.load(Path(args.state_dir))
    procs = [*state.replicas, *([state.envoy] if state.envoy else [])]
    for p in procs:
        if p.name == "envoy":
            ready = _http(f"{state.admin}/ready")[0] == 200
        else:
            ready = _http(f"http://127.0.0.1:{p.port}/ready")[0] == 200
        alive = _alive(p)
        print(
            f"{p.name:<12} pid {p.pid:<8} {'running' if alive else 'gone':<8} "
            f"{'ready' if ready else 'not ready'}"
        )
    print(f"traffic: {state.listen}   admin: {state.admin}")
    return 0 if all(_alive(p) for p in procs) else 1


def run(args: argparse.Namespace) -> int:
    actions = {"up": _up, "down": _down, "status": _status, "reload": _reload}
    try:
        return actions[args.fleet_command](args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
