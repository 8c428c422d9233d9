# harnessrl developer commands. Everything runs inside .venv, which `make venv` creates.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Every package, with its version and hashes, comes from the lock (`make lock` writes it from
# pyproject.toml and requirements/lock.in): what passes here passes on a new machine.
LOCK := requirements/dev.lock
RUNTIME_LOCK := requirements/runtime.lock
# Where pip finds the CPU build of torch the lock names (this machine keeps it on disk under
# /opt/wheels, which its pip.conf lists). Elsewhere: PIP_TORCH="--extra-index-url
# https://download.pytorch.org/whl/cpu".
PIP_TORCH ?=

.PHONY: venv lock protos docs lint test test-full demo bench-bus clean swe-tasks swe-smoke swe-harness swe-coder

venv: $(STAMP)

# A venv made anew whenever the lock changes, so it holds the lock and nothing else: no
# package left over from an earlier lock, none resolved today. pip itself and setuptools are
# locked too; the project is installed without build isolation, so nothing unhashed is
# downloaded to build it. `pip check` proves the set is whole.
$(STAMP): pyproject.toml $(LOCK)
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --require-hashes --only-binary=:all: $(PIP_TORCH) -r $(LOCK)
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation --editable .
	$(BIN)/python -m pip check
	touch $(STAMP)

# Resolve the locks again from pyproject.toml and requirements/lock.in: versions already
# locked stay where they still satisfy; UPGRADE=1 moves every package to its newest release.
# runtime.lock (what the wheel declares; the images install it) takes its versions from
# dev.lock, so the two never disagree. tests/unit/test_lock.py fails when they are stale.
UV_COMPILE = $(BIN)/uv pip compile --quiet --generate-hashes --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --find-links /opt/wheels \
	--custom-compile-command "make lock" $(if $(UPGRADE),--upgrade)
lock: venv
	$(UV_COMPILE) pyproject.toml requirements/lock.in --extra dev -o $(LOCK)
	$(UV_COMPILE) pyproject.toml requirements/lock.in -c $(LOCK) -o $(RUNTIME_LOCK)

protos: venv  ## regenerate libs/harnessrl/v1 from protos/
	$(BIN)/python protos/generate.py

docs: venv  ## regenerate docs/configuration.md from the settings classes
	$(BIN)/harnessrl config reference > docs/configuration.md

lint: venv
	$(BIN)/ruff check libs services apps bench tests protos examples
	$(BIN)/ruff format --check libs services apps bench tests protos examples
	$(BIN)/python tests/typecheck.py

# bubblewrap, which the sandbox of local harness runs needs (tests/integration/
# test_harness_sandbox.py; skipped without it unless CI=true). CI starts as root on a clean
# Debian machine: install it there when it is missing.
.PHONY: sandbox-tools
sandbox-tools:
	command -v bwrap >/dev/null || { apt-get install -y bubblewrap || { apt-get update && apt-get install -y bubblewrap; }; }

# What the tests need besides the venv, made at once (-j): lint and the model build use the
# CPU while npm, pip and apt download (the CLIs, mini-swe-agent's venv, bubblewrap), which
# the tests would otherwise install one after the other.
TEST_NEEDS := lint qwen3-tiny sandbox-tools harness-clis swe-harness

# Two workers (pytest-xdist), each taking a whole test file at a time (module fixtures stay
# in one process): most integration tests wait on real servers and subprocesses, so two
# files at once finish in ~15 minutes on 2 cores instead of ~21. One OpenMP thread per
# process (the services the tests start inherit it): two workers each training a tiny
# model with a thread per core would oversubscribe the cores many times over.
TEST_ENV := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
test: venv
	$(MAKE) --no-print-directory -j5 $(TEST_NEEDS)
	$(TEST_ENV) $(BIN)/python -m pytest -n 2 --dist loadfile --durations=25

# The same tests with the long versions of the heaviest suites: the fuzzers send 3x the
# requests, the chaos run lasts five minutes (~35 minutes on 2 cores instead of ~20).
test-full: venv
	$(MAKE) --no-print-directory -j5 $(TEST_NEEDS)
	$(TEST_ENV) HARNESSRL_TEST_FULL=1 $(BIN)/python -m pytest -n 2 --dist loadfile

# The real Qwen3 tokenizer and chat template (npm, pinned with its integrity in the lock
# file) on a tiny random Qwen3 (examples/qwen3-tiny/build.py): the tests of real-template
# behaviour load it through from_pretrained as a real Qwen3. Rebuilt only when the lock or
# the script changes.
QWEN3_TINY := examples/qwen3-tiny/model/.built

.PHONY: qwen3-tiny
qwen3-tiny: $(QWEN3_TINY)

$(QWEN3_TINY): examples/qwen3-tiny/package-lock.json examples/qwen3-tiny/build.py | venv
	npm ci --ignore-scripts --no-audit --no-fund --prefix examples/qwen3-tiny
	$(BIN)/python examples/qwen3-tiny/build.py examples/qwen3-tiny/model
	touch $(QWEN3_TINY)

# The calculator demo: measure the pretrained tiny model on val tasks through the harness,
# train it DEMO_STEPS steps with RL through that harness, measure again, write
# runs/<run-id>/report.html. The last line printed is the JSON summary. DEMO_CONFIG picks the
# stack: examples/calculator/demo-lora.yaml trains LoRA adapters instead of every weight.
DEMO_STEPS ?= 24
DEMO_CONFIG ?= examples/calculator/demo.yaml
demo: venv
	mkdir -p runs
	$(BIN)/python examples/calculator/tasks.py --split train --n 3000 --seed 1 > runs/calculator-train.jsonl
	$(BIN)/python examples/calculator/tasks.py --split val --n 100 > runs/calculator-val.jsonl
	$(BIN)/harnessrl experiment --config $(DEMO_CONFIG) \
		--train runs/calculator-train.jsonl --val runs/calculator-val.jsonl --steps $(DEMO_STEPS)

# The production demo: no controller, no task file. `harnessrl up` serves a help desk app
# (examples/production/app.py) whose simulated users ask and press thumbs for
# PRODUCTION_MINUTES; their feedback trains the model. The last line printed is the JSON
# summary; runs/production-<date-time>/ holds report.json and report.png.
PRODUCTION_MINUTES ?= 5
.PHONY: demo-production
demo-production: venv
	mkdir -p runs
	$(BIN)/python -m examples.production.demo --minutes $(PRODUCTION_MINUTES)

# The canary demo (examples/production/canary.py): the help desk with LoRA versions and
# `production.canary` on. A candidate trained on inverted thumbs is rolled back, the next
# one (honest thumbs) promoted, the gateway and the engine killed while it is judged. The
# last line printed is the JSON summary; RUN_DIR/canary.json has the decisions' evidence.
.PHONY: demo-canary
demo-canary: venv
	mkdir -p runs
	$(BIN)/python -m examples.production.canary

# The real coding-agent CLIs (Codex, Claude Code) that tests/integration/test_harness_clis.py
# runs against the gateway, at the exact versions and integrity hashes of the lock file.
# --ignore-scripts: their postinstall scripts only place the platform binary, which
# tests/harnesses/clis.py finds in the platform package itself. The stamp makes it idempotent.
HARNESS_CLIS := tests/harnesses/node_modules/.installed

.PHONY: harness-clis
harness-clis: $(HARNESS_CLIS)

$(HARNESS_CLIS): tests/harnesses/package.json tests/harnesses/package-lock.json
	npm ci --ignore-scripts --no-audit --no-fund --prefix tests/harnesses
	touch $(HARNESS_CLIS)

# Coding agents (examples/swe). swe-tasks: the whole task pipeline over every pinned project
# (measured on 2 cores without attrs: ~1 hour of synth, 20 minutes of validation; attrs adds
# ~30 s per candidate; resumable: a rerun goes on where it stopped). swe-smoke: the whole
# loop on CPU, mini-swe-agent through the stack on a synthesized six task with the planted
# smoke policy (examples/swe-coder), 4 training steps (~15 minutes with its synth).
SWE_OUT ?= runs/swe
swe-harness: venv
	$(BIN)/python examples/swe/install.py

swe-coder: qwen3-tiny
	test -f examples/swe-coder/model/model.safetensors || $(BIN)/python examples/swe-coder/build.py

swe-tasks: venv
	$(BIN)/harnessrl swe synth --out $(SWE_OUT)/synth
	$(BIN)/harnessrl swe clean $(SWE_OUT)/synth/tasks.jsonl --out $(SWE_OUT)/clean.jsonl \
		--validate --tasks-out $(SWE_OUT)/tasks.jsonl --report $(SWE_OUT)/clean-report.json

swe-smoke: swe-harness swe-coder sandbox-tools
	$(BIN)/harnessrl swe synth --out runs/swe-smoke/synth --projects six --runs 2 \
		--candidates 40 --per-project 3
	$(BIN)/harnessrl swe clean runs/swe-smoke/synth/tasks.jsonl --out runs/swe-smoke/clean.jsonl \
		--validate --tasks-out runs/swe-smoke/tasks.jsonl
	$(BIN)/python examples/swe/smoke_tasks.py runs/swe-smoke/tasks.jsonl runs/swe-smoke
	$(BIN)/harnessrl experiment --config examples/swe/smoke.yaml --run-dir runs/swe-smoke/run \
		--train runs/swe-smoke/train.jsonl --val runs/swe-smoke/val.jsonl --steps 4 \
		--group-size 4 --val-group-size 8 --backlog 1

bench-bus: venv
	$(BIN)/harnessrl bench bus

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .harnessrl
