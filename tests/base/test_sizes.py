"""Sizes with units in config files: ``64GiB`` where a field takes bytes."""

from __future__ import annotations

import pytest

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.units import parse_size


@pytest.mark.parametrize(("text", "size"), [("4096", 4096), ("512MiB", 512 << 20),
                                            ("64GiB", 64 << 30), ("1.5GB", 1_500_000_000),
                                            ("2 kib", 2048), (".5KiB", 512)])
def test_sizes_parse_with_and_without_units(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "12 parsecs", "1e9"])
def test_a_size_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


def test_a_fleet_config_takes_sizes_with_units_and_names_the_field() -> None:
    fleet = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": "48GiB",
                                                  "dram_tier_bytes": "64GiB"},
                             "remote": {"valkey_capacity_bytes": "1TiB"}})
    assert fleet.node.hbm_kv_bytes == 48 << 30 and fleet.node.dram_tier_bytes == 64 << 30
    assert fleet.remote.valkey_capacity_bytes == 1 << 40
    with pytest.raises(ConfigError, match=r"node\.hbm_kv_bytes"):
        fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": "48 parsecs"}})
