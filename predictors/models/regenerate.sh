#!/usr/bin/env bash
# Regenerate the shipped `default` predictor (predictors/models/default.kvp): the `adaptive`
# model trained on the train half of the public Claude Code set (session-group split,
# --test-fraction 0.5, seed 0), so that `kvprefetch sim --test-split 0.5` and
# `kvprefetch eval-predictor --test-fraction 0.5` score it on sessions it never saw.
# Deterministic: the same traces give the same file. Run from the repository root:
#     predictors/models/regenerate.sh TRACES
# TRACES: a folder of the 360 even-numbered files of the public Claude Code set, the traces/
# folder of github.com/callanjfox/kv-cache-tester (controlplane/data/traces/ATTRIBUTION.md).
set -euo pipefail
TRACES="${1:?usage: predictors/models/regenerate.sh TRACES (the public Claude Code set)}"
exec kvprefetch train --predictor adaptive --trace "$TRACES" --test-fraction 0.5 --seed 0 \
    --no-progress --out predictors/models/default.kvp
