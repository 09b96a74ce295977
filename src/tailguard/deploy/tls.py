"""Self-signed TLS certificates for loopback fleets, the lab and tests (openssl CLI: it ships
with the OS, so no crypto dependency is added)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tailguard.errors import ConfigError


def self_signed_cert(folder: Path, *, rsa: bool = False, name: str = "tls") -> tuple[Path, Path]:
    """(cert, key) for 127.0.0.1 / localhost in `folder`, made once and then reused.

    EC P-256 by default (cheap handshakes); `rsa=True` makes RSA-2048, what most public
    endpoints use, where a benchmark means to price the handshake realistically.
    """
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / f"{name}-cert.pem", folder / f"{name}-key.pem"
    if cert.is_file() and key.is_file():
        return cert, key
    keyspec = ["rsa:2048"] if rsa else ["ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
    cmd = [
        "openssl", "req", "-x509", "-newkey", *keyspec, "-nodes", "-days", "2",
        "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert),
        "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
    ]  # fmt: skip
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfigError(
            f"could not make a TLS certificate with openssl ({e}); install openssl"
        ) from e
    return cert, key
