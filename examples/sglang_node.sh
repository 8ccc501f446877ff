#!/usr/bin/env bash
# One GPU node: SGLang with HiCache (GPU -> host memory -> L3) and kvprefetch as its L3
# storage backend (node-local DRAM tier the agent warms, then Valkey, then S3).
#
#   VALKEY_HOST=10.0.0.5 S3_BUCKET=kv examples/sglang_node.sh meta-llama/Llama-3.1-8B-Instruct \
#       [more SGLang arguments, e.g. --mem-fraction-static 0.8; later ones override]
#
# Environment (defaults in brackets): VALKEY_HOST [127.0.0.1], VALKEY_PORT [6379],
# S3_BUCKET (required), S3_REGION [us-east-1], S3_ENDPOINT (for non-AWS S3), DRAM_DIR
# [/dev/shm/kvprefetch-$NODE] and DRAM_BYTES [64 GiB]: the tier the node's agent warms (serve's
# agent.tier_path, /dev/shm/kvprefetch-{node} by default, backend: sglang; NODE [0]: this
# node's number in serve's order, `kvprefetch serve --nodes-file`), READ_THREADS [4]:
# threads one batch's pages are read and verified on from that tier, PAGE_SIZE [64], TP [1],
# PORT [30000], SGLANG [python -m sglang.launch_server]; SGLANG=echo prints the command.
# STORAGE_CONFIG: the backend's whole "kvprefetch" section as JSON (SGLangStorageConfig),
# used instead of the one built from the variables above (examples/gpu_check.sh sets it).
# write_back: the host pool gets a context when the device evicts it (the demote-on-evict
# of the sglang-hicache engine profile, as `kvprefetch serve --engine` plans with).
# Needs: SGLang (GPU build) and kvprefetch importable by the same Python.
set -euo pipefail
MODEL=${1:?usage: $0 MODEL [SGLang arguments]}
shift
[[ -n "${STORAGE_CONFIG:-}" ]] || : "${S3_BUCKET:?set S3_BUCKET}"
PY=${PYTHON:-python}
EXTRA=$("$PY" - "$MODEL" <<'PYEOF'
import json, os, sys
from kvprefetch.agents.agent import RemoteStoreConfig
from kvprefetch.agents.sglang.backend import SGLangStorageConfig, dynamic_extra_config
from kvprefetch.agents.stores.local import LocalTierConfig
from kvprefetch.agents.stores.s3 import S3StoreConfig
from kvprefetch.agents.stores.valkey import ValkeyStoreConfig
env = os.environ.get
if env("STORAGE_CONFIG"):
    config = SGLangStorageConfig.model_validate_json(env("STORAGE_CONFIG"))
else:
    config = SGLangStorageConfig(
        local=LocalTierConfig(path=env("DRAM_DIR", "/dev/shm/kvprefetch-" + env("NODE", "0")),
                              capacity_bytes=int(env("DRAM_BYTES", str(64 << 30)))),
        local_read_threads=int(env("READ_THREADS", "4")),
        remote=RemoteStoreConfig(
            valkey=ValkeyStoreConfig(host=env("VALKEY_HOST", "127.0.0.1"),
                                     port=int(env("VALKEY_PORT", "6379"))),
            s3=S3StoreConfig(bucket=env("S3_BUCKET"), region=env("S3_REGION", "us-east-1"),
                             endpoint_url=env("S3_ENDPOINT"))))
print(json.dumps(dynamic_extra_config(config)))  # validated by pydantic above
PYEOF
)
read -r -a SGLANG_CMD <<< "${SGLANG:-$PY -m sglang.launch_server}"
exec "${SGLANG_CMD[@]}" --model-path "$MODEL" --port "${PORT:-30000}" --tp "${TP:-1}" \
    --page-size "${PAGE_SIZE:-64}" --enable-hierarchical-cache \
    --hicache-write-policy write_back --hicache-storage-prefetch-policy timeout \
    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config "$EXTRA" "$@"
