PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export JAX_PLATFORMS ?= cpu

$(BIN)/.installed: pyproject.toml requirements/constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip==26.3
	$(BIN)/python -m pip install -q -c requirements/constraints.txt -e ".[dev]"
	touch $@

venv: $(BIN)/.installed
.PHONY: venv
