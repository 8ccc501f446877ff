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
import time
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
    assert [line.split()[4].rstrip(":") for line in lines] == [
        "config", "valkey", "s3", "lmcache", "journal", "ray"]
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


@pytest.mark.servers
def test_the_check_report_is_its_lines_only(tmp_path: Path,
                                            stores: tuple[EmbeddedValkey, EmbeddedS3]) -> None:
    """The stores' clients log their connects at INFO: none of it enters the report."""
    valkey, s3 = stores
    done = _check(_config(tmp_path, valkey, s3, "auto"))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert all(line.startswith("kvprefetch serve --check: ok ")
               for line in done.stdout.splitlines()), done.stdout


@pytest.mark.servers
def test_the_check_probes_the_lmcache_server_and_the_journal_directory(
        tmp_path: Path, stores: tuple[EmbeddedValkey, EmbeddedS3]) -> None:
    valkey, s3 = stores
    closed = free_port()
    path = _config(tmp_path, valkey, s3, "local")
    doc = yaml.safe_load(path.read_text())
    doc["agent"]["lmcache"]["http_url"] = f"http://127.0.0.1:{closed}"
    (tmp_path / "a-file").write_text("")
    doc["service"]["journal_path"] = str(tmp_path / "a-file" / "journal.jsonl")
    path.write_text(yaml.safe_dump(doc))
    done = _check(path)
    assert done.returncode == 2
    failed = {line.split(" FAIL ", 1)[1].split(":", 1)[0]: line
              for line in done.stderr.splitlines()}
    assert sorted(failed) == ["journal", "lmcache"], done.stderr
    assert f"127.0.0.1:{closed}" in failed["lmcache"] and "a-file" in failed["journal"]
    # on a cluster the node's server is the node's: checked there, by its agent
    done = _check(path, "--address", "auto")
    assert "ok lmcache" in done.stdout and " lmcache" not in done.stderr


def test_serve_refuses_a_config_that_fails_the_check_before_ray_starts(tmp_path: Path) -> None:
    """Placeholders left in: one line per problem, exit 2, and Ray never imported."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kvprefetch", "serve", "--config",
         str(ROOT / "examples" / "serve.yaml"), "--address", "local"], cwd=ROOT,
        capture_output=True, text=True, timeout=120, env={**os.environ, **OFFLINE})
    assert done.returncode == 2
    report = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert report and all(line.startswith("kvprefetch serve: FAIL ") for line in report), report
    fields = [line.split(" FAIL ", 1)[1].split(":", 1)[0] for line in report]
    assert {"stores.valkey.host", "stores.s3.bucket", "valkey", "s3", "lmcache"} <= set(fields)
    # each probe's line names the config field that points at what did not answer
    named = {line.split(" FAIL ", 1)[1].split(": ", 2)[1] for line in report
             if line.split(" FAIL ", 1)[1].split(":", 1)[0] in ("valkey", "s3", "lmcache")}
    assert named == {"stores.valkey", "stores.s3", "agent.lmcache.http_url"}, report
    assert "Traceback" not in done.stderr
    assert not any(line.endswith(" ray") for line in done.stderr.splitlines()
                   if line.startswith("import time:"))
    assert done.stdout == "" and time.monotonic() - started < 60


def test_the_embedded_profile_of_the_shipped_example_passes_the_check() -> None:
    """``--embedded``: the stores are the ones serve starts, the agent its own local tier,
    the journal beside the config; the shipped file's placeholders (all in stores) and its
    LMCache server do not count."""
    done = _check(ROOT / "examples" / "serve.yaml", "--embedded")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[4].rstrip(":") for line in lines] == [
        "config", "valkey", "s3", "journal", "ray"], lines
    assert "starts with serve" in lines[1] and "starts with serve" in lines[2]
    assert str(ROOT / "examples" / "journal.jsonl") in lines[3]


@pytest.mark.servers
def test_the_embedded_profile_keeps_the_file_but_its_stores_backend_and_journal(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        stores: tuple[EmbeddedValkey, EmbeddedS3]) -> None:
    from kvprefetch.agents.agent import RemoteStoreConfig
    from kvprefetch.controlplane.cli.serve_config import (
        EMBEDDED_TIER_BYTES,
        load_serve_config,
        with_embedded_stores,
    )

    monkeypatch.setenv("KVPREFETCH_API_TOKEN", OFFLINE["KVPREFETCH_API_TOKEN"])
    cfg = load_serve_config(ROOT / "examples" / "serve.yaml", embedded=True)
    assert cfg.ray.address == "local" and cfg.agent.backend == "local"
    assert cfg.agent.lmcache is None
    tier = cfg.agent.dram(0)
    assert tier is not None and tier.capacity_bytes == EMBEDDED_TIER_BYTES
    assert cfg.service["journal_path"] == str(ROOT / "examples" / "journal.jsonl")
    assert cfg.service["policy"] == "predictive" and "default" in cfg.tenants
    assert cfg.stores.tiered.write_mode == "write-through"
    valkey, s3 = stores
    live = with_embedded_stores(cfg, valkey, s3)
    assert isinstance(live.stores, RemoteStoreConfig)
    assert live.stores.valkey is not None and live.stores.valkey.port == valkey.port
    assert live.stores.s3 is not None and live.stores.s3.endpoint_url == s3.endpoint_url
    # --embedded is this machine's runtime, no other
    assert main(["serve", "--config", str(ROOT / "examples" / "serve.yaml"), "--embedded",
                 "--address", "auto"]) == 2
    assert "--embedded runs on a local Ray runtime" in capsys.readouterr().err


def test_serve_refuses_a_taken_http_port_in_one_line_before_ray_starts(tmp_path: Path) -> None:
    """The shipped example's embedded profile with its HTTP port held by another socket:
    one line naming the fields and the cause, exit 2, and Ray never imported."""
    doc = yaml.safe_load((ROOT / "examples" / "serve.yaml").read_text())
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        doc["http"].update(host="127.0.0.1", port=port)
        config = tmp_path / "serve.yaml"
        config.write_text(yaml.safe_dump(doc))
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "kvprefetch", "serve", "--config",
             str(config), "--embedded"], cwd=ROOT, capture_output=True, text=True,
            timeout=120, env={**os.environ, **OFFLINE})
    assert done.returncode == 2
    report = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert report == [f"kvprefetch serve: FAIL http: http.host/http.port: cannot listen on "
                      f"127.0.0.1:{port} (Address already in use): stop what holds the port, "
                      "or set another"], report
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert "ray" not in imported and "uvicorn" not in imported
