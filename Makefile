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
	$(VENV)/bin/lightning-rl run $(RECIPE)

test: venv
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) outputs
