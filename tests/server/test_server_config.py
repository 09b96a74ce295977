"""ServerConfig: defaults, file < flags precedence, refusals that name the fix, --print-config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tailguard.errors import ConfigError
from tailguard.server.config import ServerConfig, field_docs, load_config, settings


def test_defaults_are_the_documented_ones() -> None:
    c = ServerConfig()
    assert (c.host, c.port, c.sla_ms, c.keepalive_timeout_s) == ("127.0.0.1", 8000, 150.0, 75)
    assert c.backlog >= 10_000 and c.engine == "real"


def test_file_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "tailguard.toml"
    f.write_text(
        'sla_ms = 200\nport = 9000\nengine = "stub"\nmax_num_seqs = 32\nengine_threads = 1\n'
    )
    c = load_config(str(f), {"port": 9100})
    assert (c.sla_ms, c.port, c.engine) == (200.0, 9100, "stub")
    assert c.engine_config.max_num_seqs == 32 and c.engine_config.threads == 1


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("sla_ms = -1", "sla_ms=-1"),
        ("slaa_ms = 1", "unknown setting 'slaa_ms'"),
        ("port = 'x'", "port='x': expected int"),
        ("max_num_seqs = 0", "max_num_seqs=0"),
        ('ssl_certfile = "c.pem"', "set both"),
        ('engine = "gpu"', "use real, stub or simulated"),
        ('trusted_proxies = ["10.0.0.0/8", "proxy.local"]', "'proxy.local' is not an IP"),
        ("max_header_bytes = 4096", "raise max_header_bytes to at least 9216"),
        ("send_timeout_s = 0", "send_timeout_s=0"),
    ],
)
def test_bad_settings_name_the_value_and_the_fix(tmp_path: Path, text: str, match: str) -> None:
    f = tmp_path / "t.toml"
    f.write_text(text + "\n")
    with pytest.raises(ConfigError, match=match):
        load_config(str(f), {})


def test_every_setting_is_documented() -> None:
    assert all(doc for (_o, _t, _d, doc) in settings().values()), [
        n for n, v in settings().items() if not v[3]
    ]
    assert "keepalive_timeout_s" in field_docs(ServerConfig)


def test_print_config_has_the_keys_the_drift_check_reads(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tailguard.cli",
            "serve",
            "--print-config",
            "--sla-ms",
            "180",
            "--api-key",
            "secret",
            "--max-num-seqs",
            "32",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    cfg = json.loads(out)
    from tailguard.deploy.drift import SERVER_KEYS

    for key in ("host", "port", *SERVER_KEYS):  # every key the drift check reads
        assert key in cfg, key
    assert cfg["sla_ms"] == 180 and cfg["keepalive_timeout_s"] == 75 and cfg["max_num_seqs"] == 32
    assert cfg["api_key"] == "***"
    # the HTTP limits and timeouts (docs/server.md, "Limits and timeouts")
    assert {k: cfg[k] for k in ("header_timeout_s", "body_timeout_s", "send_timeout_s")} == {
        "header_timeout_s": 10.0,
        "body_timeout_s": 30.0,
        "send_timeout_s": 30.0,
    }
    assert (cfg["max_url_bytes"], cfg["max_header_bytes"], cfg["max_header_count"]) == (
        8192,
        32768,
        100,
    )
    assert cfg["trusted_proxies"] == [] and cfg["linger_timeout_s"] == 5.0


def test_trusted_proxies_flag_is_a_comma_separated_list(tmp_path: Path) -> None:
    from tailguard.server.config import convert

    value = convert("trusted_proxies", "10.0.0.0/8, 127.0.0.1")
    assert value == ("10.0.0.0/8", "127.0.0.1")
    assert load_config(None, {"trusted_proxies": value}).trusted_proxies == value


def test_http_process_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from tailguard.server.cli import build_app\n"
        "from tailguard.server.config import load_config\n"
        "for engine in ('stub', 'simulated'):\n"
        "    build_app(load_config(None, {'engine': engine}))\n"
        "import tailguard.server.http, tailguard.server.handlers\n"
        "try:\n"
        "    import tailguard.engine.client  # the real client must not pull torch in either\n"
        "except ImportError:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported by the HTTP process'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_every_setting_appears_in_the_user_docs() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "server.md").read_text()
    missing = [name for name in settings() if f"`{name}`" not in doc]
    assert not missing, f"document these settings in docs/server.md: {missing}"


def test_flag_strings_and_toml_values_convert_through_the_settings_types() -> None:
    from tailguard.server.config import convert

    assert convert("sla_ms", "150") == 150.0 and convert("backlog", 128.0) == 128
    assert convert("engine_threads", "3") == 3 and convert("access_log", "true") is True
    assert convert("max_model_len", "none") is None and convert("max_model_len", "512") == 512
    assert convert("seq_buckets", "1, 2,4") == (1, 2, 4)
    with pytest.raises(
        ConfigError, match=r"backlog=2\.5: expected int \(Expected `int`, got `float`\)"
    ):
        convert("backlog", 2.5)
    with pytest.raises(ConfigError, match="sla_ms='fast'"):
        convert("sla_ms", "fast")
