#!/usr/bin/env bash
# One GPU node of a kvprefetch cluster: the node-local LMCache MP server, its L2 kvprefetch's
# adapter over Valkey in front of S3, then vLLM with the LMCache MP connector pointing at it.
# The node's prefetch agent is placed by `kvprefetch serve` (serve.yaml: agent.backend
# lmcache-mp, agent.lmcache.http_url http://127.0.0.1:$LMCACHE_HTTP_PORT).
#
#   VALKEY_HOST=10.0.0.5 S3_BUCKET=kv S3_REGION=us-east-1 examples/vllm_node.sh MODEL [vllm options]
#
# Optional: VALKEY_PORT (6379), S3_ENDPOINT (an S3-compatible endpoint URL), LMCACHE_PORT
# (6555), LMCACHE_HTTP_PORT (6556), L1_GB (64), CHUNK_SIZE (256), VLLM (the vllm command).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# From a clone (examples/ beside the package's folders), kvprefetch imports from it too.
if [[ -d "$HERE/../kvprefetch" ]]; then export PYTHONPATH="$HERE/..${PYTHONPATH:+:$PYTHONPATH}"; fi
MODEL=${1:?usage: VALKEY_HOST=... S3_BUCKET=... examples/vllm_node.sh MODEL [vllm serve options]}
shift
: "${VALKEY_HOST:?set VALKEY_HOST}" "${S3_BUCKET:?set S3_BUCKET}"
LMCACHE_PORT=${LMCACHE_PORT:-6555}
LMCACHE_HTTP_PORT=${LMCACHE_HTTP_PORT:-6556}
PY=${PYTHON:-python3}
ADAPTER=$("$PY" - <<'PYEOF'
import json, os
from kvprefetch.agents.lmcache.l2.adapter import plugin_adapter_json
s3 = {"bucket": os.environ["S3_BUCKET"], "region": os.environ.get("S3_REGION", "us-east-1")}
if os.environ.get("S3_ENDPOINT"):
    s3["endpoint_url"] = os.environ["S3_ENDPOINT"]
valkey = {"host": os.environ["VALKEY_HOST"], "port": int(os.environ.get("VALKEY_PORT", "6379"))}
print(json.dumps(plugin_adapter_json(valkey=valkey, s3=s3)))
PYEOF
)
lmcache server --host 127.0.0.1 --port "$LMCACHE_PORT" --http-port "$LMCACHE_HTTP_PORT" \
    --l1-size-gb "${L1_GB:-64}" --eviction-policy LRU --chunk-size "${CHUNK_SIZE:-256}" \
    --hash-algorithm blake3 --supported-transfer-mode auto --l2-adapter "$ADAPTER" &
LMCACHE_PID=$!
trap 'kill "$LMCACHE_PID" 2>/dev/null || true' EXIT
for _ in $(seq 180); do
    curl -sf "http://127.0.0.1:$LMCACHE_HTTP_PORT/status" >/dev/null && break
    kill -0 "$LMCACHE_PID" 2>/dev/null || { echo "vllm_node: lmcache server exited" >&2; exit 1; }
    sleep 1
done
echo "vllm_node: lmcache server up (ZMQ :$LMCACHE_PORT, HTTP :$LMCACHE_HTTP_PORT)" >&2
# --enable-prompt-tokens-details: the cached-token count the gateway reports to the
# scheduler (a prefetch read counts as used, not wasted).
${VLLM:-vllm} serve "$MODEL" --enable-prompt-tokens-details --kv-transfer-config \
    "{\"kv_connector\":\"LMCacheMPConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"lmcache.mp.host\":\"tcp://127.0.0.1\",\"lmcache.mp.port\":$LMCACHE_PORT}}" \
    "$@"
