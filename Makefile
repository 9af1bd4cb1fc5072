# make demo | test | lab | figures | notebooks | recorded — each creates .venv and installs the
# package first. Needs only Python 3.11 and make (and, for the browser test, Debian's chromium).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

# CPU (TPU interpret mode) unless this machine has a TPU: a TPU VM exposes /dev/accel* or /dev/vfio.
ifeq ($(wildcard /dev/accel0 /dev/vfio),)
export JAX_PLATFORMS ?= cpu
endif

NOTEBOOK_SOURCES := $(sort $(wildcard notebooks/[0-9][0-9]_*.py))
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))

$(BIN)/.installed: pyproject.toml requirements/constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip==26.3
	$(BIN)/python -m pip install -q -c requirements/constraints.txt -e ".[dev]"
	touch $@

venv: $(BIN)/.installed

# The main job: a short greedy decode of kimi-k3-mini with the reference model.
demo: venv
	$(BIN)/mkresearch decode --model kimi-k3-mini --prompt-len 8 --steps 16 --batch 2 --seed 0 --backend reference

# Headless Chromium and its driver for tests/test_browser.py, from Debian's packages when this is
# a Debian machine and we are root (CI is); otherwise, or if apt fails, that test skips and says why.
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
				chromium chromium-driver >/dev/null) \
			|| echo "make browser: apt-get could not install chromium; the browser test will skip"; \
		else \
			echo "make browser: no chromium, and no apt-get as root; the browser test will skip"; \
		fi; \
	fi

# pytest over tests/, then nbval over every committed notebook (fact cells are compared, and each
# notebook's run time against its budget: notebooks/conftest.py).
test: venv browser
	$(BIN)/python -m pytest tests
ifneq ($(NOTEBOOKS),)
	$(BIN)/python -m pytest --nbval-lax --nbval-sanitize-with notebooks/nbval_sanitize.cfg $(NOTEBOOKS)
endif

lab: venv
	$(BIN)/jupyter lab --notebook-dir=notebooks

figures: venv
	$(BIN)/mkresearch figures --out figures

# Re-record the slow results notebooks show instead of recomputing (mkresearch.recorded): the
# megakernel compiled for TPU7x at kimi-k3-rank shapes.
recorded: venv
	$(BIN)/python -m mkresearch.recorded

# Re-execute every notebook from its jupytext .py twin (the .py is the source of truth).
notebooks: venv
	cd notebooks && for nb in $(notdir $(NOTEBOOK_SOURCES)); do \
		../$(BIN)/jupytext --sync --execute $$nb || exit 1; done

.PHONY: venv demo browser test lab figures recorded notebooks
