#!/usr/bin/env bash
# One real engine + kvprefetch agent round trip on a GPU node: prints TTFT cold, without
# prefetch (the KV loaded from Valkey/S3 on arrival) and after the agent's warm prefetch,
# and exits non-zero unless the warmed request found its KV where the agent put it.
#   --engine vllm (default): vLLM + LMCache; the warmed request must hit LMCache's L1.
#   --engine sglang: SGLang HiCache with kvprefetch as its L3 backend
#     (examples/sglang_node.sh); the warmed request's pages must all come from the
#     node-local tier, none from Valkey/S3.
#
# Needs a GPU node with the engine installed next to kvprefetch, e.g.
#   python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
#   pip install vllm && pip install -e '.[stores,lmcache]'      # --engine vllm
#   pip install 'sglang==0.5.23' && pip install -e '.[stores]'    # --engine sglang
# and a small model the engine can load offline (a local path, or a name in the HF cache):
#   examples/gpu_check.sh /models/Qwen2.5-0.5B-Instruct [--prompt-tokens 16000 ...]
#   examples/gpu_check.sh /models/Qwen2.5-0.5B-Instruct --engine sglang
# (or kvp/gpu_check.sh in a `kvprefetch init kvp` folder: the check's Python files are the
# ones beside this script). Figures go to out/gpu_check.json (out/gpu_check_sglang.json)
# under the current directory; --help lists the options.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
case "${1:-}" in
    -h|--help) exec "$PY" "$HERE/gpu_check.py" --help ;;
esac
MODEL=${1:?usage: $0 MODEL [--engine vllm|sglang] [gpu_check.py options]}
shift
ENGINE=vllm
prev=
for arg in "$@"; do
    case "$arg" in
        --engine=*) ENGINE=${arg#--engine=} ;;
        *) [[ "$prev" == --engine ]] && ENGINE=$arg ;;
    esac
    prev=$arg
done
case "$ENGINE" in
    vllm)
        if ! "$PY" -c 'import vllm, lmcache' 2>/dev/null; then
            echo "gpu_check: $PY cannot import vllm and lmcache; install them first (see the top of $0)" >&2
            exit 2
        fi
        command -v lmcache >/dev/null || { echo "gpu_check: the lmcache command is not on PATH" >&2; exit 2; }
        JSON=out/gpu_check.json ;;
    sglang)
        if ! "$PY" -c 'import sglang' 2>/dev/null; then
            echo "gpu_check: $PY cannot import sglang; install it first (see the top of $0)" >&2
            exit 2
        fi
        JSON=out/gpu_check_sglang.json ;;
    *)
        echo "gpu_check: --engine is vllm or sglang, not '$ENGINE'" >&2
        exit 2 ;;
esac
mkdir -p out
exec "$PY" "$HERE/gpu_check.py" --model "$MODEL" --json "$JSON" "$@"
