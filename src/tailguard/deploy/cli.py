"""`tailguard deploy envoy|check|baseline`: render Envoy config, check it for drift.

    tailguard deploy envoy --replicas 127.0.0.1:8001 127.0.0.1:8002 > envoy.yaml
    tailguard deploy check --baseline deploy/baseline/tail.yaml --config envoy.yaml
    tailguard deploy check --baseline deploy/baseline/tail.yaml --live http://127.0.0.1:9901 \\
        --server-config <(tailguard serve --print-config)
    tailguard deploy baseline --config envoy.yaml --server-config server.json > tail.yaml

Exit codes: 0 no drift, 1 drift (the report says which settings and why they matter),
2 bad input (unreadable file, not an Envoy config).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from tailguard.deploy import drift
from tailguard.deploy.envoy import EnvoySettings, Replica, ServerLimits, load_config, render_yaml
from tailguard.errors import ConfigError


def _host_port(text: str) -> tuple[str, int]:
    r = Replica.parse(text)
    return r.host, r.port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="deploy_command", metavar="ACTION", required=True)

    env = sub.add_parser("envoy", help="render an Envoy v3 config for replicas (stdout)")
    env.add_argument(
        "--replicas",
        nargs="+",
        required=True,
        metavar="HOST:PORT",
        help="tailguard servers; a DNS name (e.g. a headless Service) is resolved "
        "by Envoy (STRICT_DNS)",
    )
    env.add_argument(
        "--listen",
        default="127.0.0.1:10000",
        metavar="HOST:PORT",
        help="where clients connect (default 127.0.0.1:10000)",
    )
    env.add_argument(
        "--admin",
        default="127.0.0.1:9901",
        metavar="HOST:PORT",
        help="Envoy admin (default 127.0.0.1:9901; keep it on loopback)",
    )
    env.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="extra listener serving only /stats/prometheus, for remote scrapes",
    )
    env.add_argument("--tls-cert", default=None, help="PEM certificate chain for the listener")
    env.add_argument("--tls-key", default=None, help="PEM private key for the listener")
    env.add_argument(
        "--server-config",
        default=None,
        metavar="JSON",
        help="`tailguard serve --print-config` output: sizes circuit breakers and "
        "idle timeouts from the replicas' real limits (default: the server's defaults)",
    )
    env.add_argument(
        "--fleet-size",
        type=int,
        default=None,
        help="replicas to size breakers for (default: number of --replicas)",
    )
    env.add_argument(
        "--upstream-http2",
        action="store_true",
        help="h2c to the replicas (needs an h2c-capable server)",
    )
    env.add_argument(
        "--max-requests-per-connection",
        type=int,
        default=None,
        help="ONLY to reproduce connection churn: caps requests per connection "
        "downstream and upstream; the drift check fails such a config",
    )
    env.add_argument("-o", "--output", default="-", help="file to write (default stdout)")

    for name, help_ in (
        ("check", "compare a config (or live Envoy) with the baseline"),
        ("baseline", "print a baseline from a reviewed config"),
    ):
        p = sub.add_parser(name, help=help_)
        if name == "check":
            p.add_argument("--baseline", required=True, help="baseline YAML (deploy/baseline/)")
        src = p.add_mutually_exclusive_group(required=True)
        src.add_argument(
            "--config",
            help="Envoy config (YAML/JSON bootstrap, a ConfigMap "
            "manifest holding one, or a saved /config_dump); - for stdin",
        )
        src.add_argument(
            "--live",
            metavar="ADMIN_URL",
            help="a running Envoy's admin, e.g. http://127.0.0.1:9901",
        )
        p.add_argument(
            "--server-config",
            default=None,
            metavar="JSON",
            help="`tailguard serve --print-config` output; - for stdin",
        )


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from exc


def _server_dump(path: str) -> dict[str, Any]:
    try:
        data = json.loads(_read(path))
    except ValueError as exc:
        raise ConfigError(
            f"{path}: not JSON ({exc}); pass the output of `tailguard serve --print-config`"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def _render(args: argparse.Namespace) -> int:
    listen_host, listen_port = _host_port(args.listen)
    admin_host, admin_port = _host_port(args.admin)
    server = ServerLimits.server_defaults()
    if args.server_config is not None:
        server = ServerLimits.from_print_config(_server_dump(args.server_config))
    cap = args.max_requests_per_connection
    if cap is not None:
        print(
            f"warning: max_requests_per_connection={cap} forces reconnects (churn); use only to "
            "reproduce the problem",
            file=sys.stderr,
        )
    settings = EnvoySettings(
        replicas=tuple(Replica.parse(r) for r in args.replicas),
        listen_host=listen_host,
        listen_port=listen_port,
        admin_host=admin_host,
        admin_port=admin_port,
        metrics_port=args.metrics_port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        server=server,
        fleet_size=args.fleet_size,
        upstream_http2=args.upstream_http2,
        downstream_max_requests_per_connection=cap,
        upstream_max_requests_per_connection=cap,
    )
    text = render_yaml(settings)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
    return 0


def _envoy_settings(args: argparse.Namespace) -> dict[str, drift.Value]:
    if args.live is not None:
        return drift.envoy_settings(drift.from_config_dump(drift.fetch_config_dump(args.live)))
    text = _read(args.config)
    first = next(iter(yaml.safe_load_all(text)), None) if text.lstrip().startswith("{") else None
    if isinstance(first, dict) and "configs" in first:  # a saved /config_dump
        return drift.envoy_settings(drift.from_config_dump(first))
    return drift.envoy_settings(load_config(text))


def _check(args: argparse.Namespace) -> int:
    baseline = drift.load_baseline(_read(args.baseline), args.baseline)
    envoy = _envoy_settings(args)
    server = None
    if args.server_config is not None:
        server = drift.server_settings(_server_dump(args.server_config))
    report = drift.run_check(baseline, envoy, server)
    print(drift.format_report(report, args.baseline))
    return 0 if report.ok else 1


def _baseline(args: argparse.Namespace) -> int:
    server = None
    if args.server_config is not None:
        server = drift.server_settings(_server_dump(args.server_config))
    sys.stdout.write(drift.dump_baseline(_envoy_settings(args), server))
    return 0


def run(args: argparse.Namespace) -> int:
    actions = {"envoy": _render, "check": _check, "baseline": _baseline}
    try:
        return actions[args.deploy_command](args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
