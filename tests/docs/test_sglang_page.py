"""The SGLang guide's blocks as written: the launch line's backend config is the one the
backend accepts (its ``kvprefetch`` section validated), it names the tier and the stores the
serve snippet names, and the serve snippet, on a real Valkey and S3, passes ``kvprefetch
serve --check``."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pages import blocks

from kvprefetch.agents.agent import RemoteStoreConfig
from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.agents.stores.local import LocalTierConfig

ROOT = Path(__file__).resolve().parents[2]
PAGE = "guides/sglang.md"


def _launch() -> tuple[list[str], dict[str, Any]]:
    (block,) = [b for b in blocks(PAGE) if b.lang == "bash" and "launch_server" in b.code]
    argv = shlex.split(block.code.replace("\\\n", " "))
    extra = json.loads(argv[argv.index("--hicache-storage-backend-extra-config") + 1])
    return argv, extra


def _snippet() -> dict[str, Any]:
    (block,) = [b for b in blocks(PAGE) if b.lang == "yaml" and "backend: sglang" in b.code]
    doc = yaml.safe_load(block.code)
    assert isinstance(doc, dict)
    return doc


def test_the_launch_line_names_the_backend_and_a_valid_kvprefetch_section() -> None:
    argv, extra = _launch()
    assert (extra["backend_name"], extra["module_path"], extra["class_name"]) == (
        "kvprefetch", "kvprefetch.agents.sglang.backend", "KvPrefetchHiCacheStorage")
    source = (ROOT / "agents" / "sglang" / "backend.py").read_text()
    assert "class KvPrefetchHiCacheStorage(" in source
    section = extra["kvprefetch"]
    assert set(section) <= {"local", "local_read_threads", "remote", "stats_dir"}
    local = LocalTierConfig.model_validate(section["local"])
    remote = RemoteStoreConfig.model_validate(section["remote"])
    serve = _snippet()
    agent = serve["agent"]
    assert agent["tier_path"].format(node=0) == local.path
    assert agent["tier_capacity_bytes"] == local.capacity_bytes
    assert remote == RemoteStoreConfig.model_validate(serve["stores"])
    assert agent["sglang"]["model_name"] == argv[argv.index("--model-path") + 1]
    assert agent["sglang"]["page_size"] == int(argv[argv.index("--page-size") + 1])


def test_the_launch_line_section_is_what_the_backend_accepts() -> None:
    """The whole section through the backend's own model (SGLang installed:
    ``make setup-sglang``, as ``make test`` has it)."""
    pytest.importorskip("sglang")
    from kvprefetch.agents.sglang.backend import SGLangStorageConfig

    SGLangStorageConfig.model_validate(_launch()[1]["kvprefetch"])


@pytest.fixture(scope="module")
def stores() -> Iterator[tuple[EmbeddedValkey, EmbeddedS3]]:
    bucket = _snippet()["stores"]["s3"]["bucket"]
    with EmbeddedValkey() as valkey, EmbeddedS3(bucket=bucket) as s3:
        yield valkey, s3


@pytest.mark.servers
def test_the_serve_snippet_passes_the_check(tmp_path: Path,
                                            stores: tuple[EmbeddedValkey, EmbeddedS3]) -> None:
    """The snippet as written, its Valkey and S3 being the ones running here."""
    valkey, s3 = stores
    doc = _snippet()
    doc["stores"]["valkey"].update(host=valkey.host, port=valkey.port)
    doc["stores"]["s3"].update(endpoint_url=s3.endpoint_url, path_style=True,
                               access_key_id=s3.access_key_id,
                               secret_access_key=s3.secret_access_key)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(doc))
    done = subprocess.run([sys.executable, "-m", "kvprefetch", "serve", "--config", str(path),
                           "--check"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KVPREFETCH_API_TOKEN": "a-token-of-24-characters",
                               "AWS_EC2_METADATA_DISABLED": "true"})
    assert done.returncode == 0, done.stderr
    assert "ok config" in done.stdout and "ok valkey" in done.stdout and "ok s3" in done.stdout
