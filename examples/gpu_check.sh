#!/usr/bin/env bash
# One real vLLM + LMCache + kvprefetch agent round trip on a GPU node: prints TTFT cold,
# without prefetch (LMCache loads L2 on arrival) and after the agent's warm prefetch, and
# exits non-zero unless the warmed request found its KV in LMCache's L1.
#
# Needs a GPU node with vLLM installed next to kvprefetch, e.g.
#   python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
#   pip install vllm && pip install -e '.[stores,lmcache]'
# and a small model vLLM can load offline (a local path, or a name in the HF cache):
#   examples/gpu_check.sh /models/Qwen2.5-0.5B-Instruct [--prompt-tokens 16000 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: examples/gpu_check.sh MODEL [gpu_check.py options]}
shift
PY=${PYTHON:-python3}
if ! "$PY" -c 'import vllm, lmcache' 2>/dev/null; then
    echo "gpu_check: $PY cannot import vllm and lmcache; install them first (see the top of $0)" >&2
    exit 2
fi
command -v lmcache >/dev/null || { echo "gpu_check: the lmcache command is not on PATH" >&2; exit 2; }
mkdir -p out
exec "$PY" examples/gpu_check.py --model "$MODEL" --json out/gpu_check.json "$@"
