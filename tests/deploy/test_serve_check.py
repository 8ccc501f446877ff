"""``kvprefetch serve --check`` and the gateway's token sources.

The check refuses every REPLACE_ME left in a config (one line per field, by its dotted
path) and probes the stores and the Ray address the config names; the example config as
shipped fails it, and a config pointing at a real Valkey and a real S3 (SeaweedFS) on
loopback and at a listening Ray port passes it. The gateway takes the scheduler's token
from the environment or a file only its owner can read, never from the command line.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey, free_port
from kvprefetch.controlplane.cli import main
from kvprefetch.controlplane.cli.serve_check import placeholders, ray_endpoint

ROOT = Path(__file__).resolve().parents[2]
#: No real cloud: nothing reaches AWS, and boto3 does not wait for an instance profile.
OFFLINE = {"AWS_EC2_METADATA_DISABLED": "true", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "KVPREFETCH_API_TOKEN": "t0ken-of-the-default-tenant"}


def _check(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvprefetch", "serve", "--check",
                           "--config", str(config), *extra], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **OFFLINE})


def test_placeholders_are_found_by_dotted_path() -> None:
    doc = {"a": {"b": "x-REPLACE_ME", "c": 1}, "d": ["ok", "REPLACE_ME_Y"], "e": None}
    assert list(placeholders(doc)) == ["a.b", "d.1"]
    assert ray_endpoint("auto") is None and ray_endpoint("local") is None
    assert ray_endpoint("ray://10.0.0.1:10001") == ("10.0.0.1", 10001)
    assert ray_endpoint("127.0.0.2:6379") == ("127.0.0.2", 6379)
    with pytest.raises(ValueError):
        ray_endpoint("head-without-port")


@pytest.mark.servers
def test_the_shipped_example_fails_the_check_with_one_line_per_placeholder_and_store() -> None:
    done = _check(ROOT / "examples" / "serve.yaml")
    assert done.returncode != 0
    failures = [line for line in done.stderr.splitlines() if " FAIL " in line]
    fields = [line.split(" FAIL ", 1)[1].split(":", 1)[0] for line in failures]
    assert "stores.valkey.host" in fields and "stores.s3.bucket" in fields
    assert "valkey" in fields and "s3" in fields  # REPLACE_ME hosts answer nothing
    assert len(failures) == len(set(fields)), done.stderr  # one line each
    assert "ok config" in done.stdout


@pytest.fixture(scope="module")
def stores() -> Iterator[tuple[EmbeddedValkey, EmbeddedS3]]:
    with EmbeddedValkey() as valkey, EmbeddedS3(backend="seaweedfs") as s3:
        yield valkey, s3


def _config(tmp_path: Path, valkey: EmbeddedValkey, s3: EmbeddedS3, ray_address: str,
            **over: Any) -> Path:
    doc = yaml.safe_load((ROOT / "examples" / "serve.yaml").read_text())
    doc["ray"]["address"] = ray_address
    doc["stores"]["valkey"].update(host=valkey.host, port=valkey.port)
    doc["stores"]["s3"].update(bucket=s3.bucket, endpoint_url=s3.endpoint_url,
                               path_style=True, access_key_id=s3.access_key_id,
                               secret_access_key=s3.secret_access_key)
    doc["service"]["journal_path"] = str(tmp_path / "journal.jsonl")
    for key, value in over.items():
        section, _, field = key.partition("__")
        doc[section][field] = value
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.servers
def test_a_config_naming_live_stores_and_a_listening_ray_port_passes(
        tmp_path: Path, stores: tuple[EmbeddedValkey, EmbeddedS3]) -> None:
    valkey, s3 = stores
    with socket.socket() as ray_port:
        ray_port.bind(("127.0.0.1", 0))
        ray_port.listen()
        address = f"127.0.0.1:{ray_port.getsockname()[1]}"
        done = _check(_config(tmp_path, valkey, s3, address))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[4].rstrip(":") for line in lines] == ["config", "valkey", "s3", "ray"]
    assert all(" ok " in line for line in lines) and " FAIL " not in done.stderr


@pytest.mark.servers
def test_unreachable_stores_and_ray_fail_one_line_each(
        tmp_path: Path, stores: tuple[EmbeddedValkey, EmbeddedS3]) -> None:
    valkey, s3 = stores
    closed = free_port()
    path = _config(tmp_path, valkey, s3, f"ray://127.0.0.1:{closed}")
    doc = yaml.safe_load(path.read_text())
    doc["stores"]["valkey"]["port"] = free_port()
    doc["stores"]["s3"]["bucket"] = "no-such-bucket"
    path.write_text(yaml.safe_dump(doc))
    done = _check(path)
    assert done.returncode == 2
    failed = sorted(line.split(" FAIL ", 1)[1].split(":", 1)[0]
                    for line in done.stderr.splitlines())
    assert failed == ["ray", "s3", "valkey"], done.stderr
    assert "no-such-bucket" in done.stderr and str(closed) in done.stderr


def test_a_token_file_others_can_read_is_refused(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from kvprefetch.controlplane.base.errors import ConfigError
    from kvprefetch.controlplane.live.gateway import read_token_file

    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o644)
    with pytest.raises(ConfigError, match="mode 0644") as err:
        read_token_file(token)
    assert "s3cret" not in str(err.value)
    argv = ["gateway", "--upstream", "http://127.0.0.1:1", "--token-file", str(token),
            "--scheduler", "http://127.0.0.1:1"]
    assert main(argv) == 2
    err_text = capsys.readouterr().err
    assert len(err_text.strip().splitlines()) == 1 and "chmod 600" in err_text
    for mode in (0o600, 0o400):
        token.chmod(mode)
        assert read_token_file(token) == "s3cret"
    token.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        read_token_file(token)


def test_the_gateway_takes_no_token_on_the_command_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kvprefetch.controlplane.live.gateway import scheduler_token

    monkeypatch.setenv("KVPREFETCH_API_TOKEN", "from-env")
    assert scheduler_token(None) == "from-env"
    with pytest.raises(SystemExit):
        main(["gateway", "--upstream", "http://127.0.0.1:1", "--token", "x"])
    assert "unrecognized arguments: --token" in capsys.readouterr().err
