"""The gateway's token store is the serve config's ``stores`` section, read by the model
serve reads it with: a Valkey with a password and a key prefix of its own gets the token
ids under the keys the agents read; a store given as a bare host:port is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("fastapi")

from kvprefetch.agents.backends.tokens import get_session_tokens
from kvprefetch.agents.embedded import EmbeddedValkey
from kvprefetch.agents.stores.valkey.store import ValkeyStore
from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.cli import build_parser, main
from kvprefetch.controlplane.cli.serve_config import load_serve_config
from kvprefetch.controlplane.live.gateway import store_sink
from kvprefetch.controlplane.live.gateway_options import (
    stores_of_serve_config,
    token_store,
)

MIB = 1 << 20


def _serve_config(tmp_path: Path, stores: dict[str, Any]) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"stores": stores,
                                    "agent": {"tier_capacity_bytes": 64 * MIB}}))
    return path


@pytest.mark.servers
def test_the_gateway_writes_token_ids_where_the_agents_read_them(tmp_path: Path) -> None:
    with EmbeddedValkey(password="s3cret-pw") as valkey:
        path = _serve_config(tmp_path, {"valkey": {
            "host": valkey.host, "port": valkey.port, "password": "s3cret-pw",
            "key_prefix": "team-a:"}})
        args = build_parser().parse_args(["gateway", "--upstream", "http://127.0.0.1:1",
                                          "--config", str(path)])
        store = token_store(stores_of_serve_config(args.config))
        store.start()
        try:
            store_sink(store)("acme", "s1", [5, 6, 7, 8])
        finally:
            store.close()
        agents = load_serve_config(path).stores.build()  # what serve gives every agent
        agents.start()
        try:
            assert get_session_tokens(agents, "acme", "s1") == [5, 6, 7, 8]
        finally:
            agents.close()
        other = ValkeyStore(valkey.store_config(key_prefix="kvp:"))
        other.start()
        try:  # the default prefix would have split gateway and agents
            assert get_session_tokens(other, "acme", "s1") is None
        finally:
            other.close()


def test_a_bare_valkey_address_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["gateway", "--upstream", "http://127.0.0.1:1", "--valkey", "valkey:6379"])
    assert exit_.value.code == 2
    assert "--config SERVE_YAML" in capsys.readouterr().err


def test_a_bad_stores_section_names_the_file_and_the_field(tmp_path: Path) -> None:
    path = _serve_config(tmp_path, {"valkey": {"host": "h", "port": "x"}})
    with pytest.raises(ConfigError, match=r"serve.yaml: field 'stores.valkey.port'"):
        stores_of_serve_config(path)
    with pytest.raises(ConfigError, match="field 'stores'"):
        stores_of_serve_config(_serve_config(tmp_path, {}))
