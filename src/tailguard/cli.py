"""`tailguard <command>`: one entry point; each command lives in its own module.

A command module exposes `add_arguments(parser: argparse.ArgumentParser) -> None` and
`run(args: argparse.Namespace) -> int` (the exit code). Modules are imported lazily so
`tailguard load` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("tailguard.server.cli", "start the OpenAI-compatible server"),
    "generate": ("tailguard.engine.cli", "one-shot generation from the command line"),
    "model": ("tailguard.model.cli", "write benchmark checkpoints (model synth)"),
    "load": ("tailguard.tools.load.cli", "open-loop load tester and SLA gate"),
    "batch": ("tailguard.tools.batch.cli", "resumable OpenAI-Batch runner"),
    "doctor": ("tailguard.tools.doctor.cli", "name the cause of a latency spike"),
    "lab": ("tailguard.tools.lab.cli", "reproduce each cause of a spike and prove the fix"),
    "deploy": ("tailguard.deploy.cli", "render Envoy config, check drift"),
    "fleet": ("tailguard.deploy.fleet", "start/stop replicas behind Envoy on this machine"),
    "compiled": ("tailguard.compiled", "build or check the compiled (mypyc) request path"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailguard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = argv[0] if argv else None
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if name == wanted:  # import only the module that will run
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args))


if __name__ == "__main__":
    sys.exit(main())
