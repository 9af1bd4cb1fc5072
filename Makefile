# make demo | test | test-fast | lab | figures | notebooks | recorded — each creates .venv and
# installs the package first (pinned: requirements/constraints.txt). Needs only make and Python 3.11
# or newer (and, for the browser test, Debian's chromium). The Python is PY: `make test
# PY=/usr/bin/python3.12` names one; by default the first of python3.11, python3.12 and python3 on
# PATH that is 3.11 or newer (3.11 first: the one CI and the pins were checked with).
PY ?= $(firstword $(foreach python,python3.11 python3.12 python3,$(shell $(python) -c \
	'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && command -v $(python))))
VENV := .venv
BIN := $(VENV)/bin

# CPU (TPU interpret mode) unless this machine has a TPU: a TPU VM exposes /dev/accel* or /dev/vfio.
ifeq ($(wildcard /dev/accel0 /dev/vfio),)
export JAX_PLATFORMS ?= cpu
endif

NOTEBOOK_SOURCES := $(sort $(wildcard notebooks/[0-9][0-9]_*.py))
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9][0-9]_*.ipynb))

define new_venv
	@test -x $(BIN)/python || test -n "$(PY)" || { echo "make: no Python 3.11 or newer on PATH" \
		"(python3.11, python3.12, python3): install one, or name it: make $(or $(MAKECMDGOALS),venv) PY=/path/to/python3"; \
		exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip==26.3
endef

# Everything: the library, its extras (plots, notebooks, tpu, checkpoints) and the test tools.
$(BIN)/.installed: pyproject.toml requirements/constraints.txt
	$(new_venv)
	$(BIN)/python -m pip install -q -c requirements/constraints.txt -e ".[dev]"
	touch $@ $(BIN)/.installed-core

# The library alone with its runtime dependencies (JAX, NumPy, ml_dtypes, tqdm): `make demo`.
$(BIN)/.installed-core: pyproject.toml requirements/constraints.txt
	$(new_venv)
	$(BIN)/python -m pip install -q -c requirements/constraints.txt -e .
	touch $@

venv: $(BIN)/.installed

# venv plus the optional `hf` extra (torch CPU, transformers) for tests/test_checkpoint_hf.py; CI runs it
venv-hf: venv
	$(BIN)/python -m pip install -q -c requirements/constraints.txt -e ".[dev,hf]"

# The product: a short greedy decode of kimi-k3-mini with the megakernel (one pallas_call per
# step), checked against the reference, and the full model's predicted TPU7x step.
# Installs only the library (no Jupyter, plots or test tools) unless .venv has everything already.
demo: $(BIN)/.installed-core
	$(BIN)/mkresearch decode kimi-k3-mini --prompt-len 8 --steps 16 --batch 1 --seed 0

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

# A second XLA:CPU configuration that computes the floats in another way: YNNPACK dots (another
# summation order), one Eigen thread, and on x86 no FMA in the vectorised exp/tanh (AVX without
# AVX2). The committed outputs come from runs as users run them; `make test` checks every notebook
# whose facts come from XLA's float results under this configuration instead, so each such fact
# must come out the same under both, as on another machine (notebooks/conftest.py picks the
# notebooks: 00, 07 and 09 check shapes, byte counts, DMA logs and pure-Python predictions).
OTHER_XLA_FLAGS := --xla_cpu_experimental_ynn_fusion_type=dot --xla_cpu_multi_thread_eigen=false
ifeq ($(shell uname -m),x86_64)
OTHER_XLA_FLAGS += --xla_cpu_max_isa=AVX
endif
# pytest over tests/ without the nbval plugin: importing it (jsonschema's format grammars) costs
# each pytest process seconds of CPU, and tests/ has no notebook. Test modules go to the two
# workers in collection order, which tests/conftest.py makes the longest first (xdist would
# otherwise hand out the modules with the most tests first, and a long module of few tests
# handed out last leaves one worker idle while the other finishes it).
PYTEST := $(BIN)/python -m pytest -p no:nbval -n 2 --dist loadfile --no-loadscope-reorder
NBVAL := $(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --nbval-lax --nbval-sanitize-with notebooks/nbval_sanitize.cfg

# `make test`: pytest over tests/ in two worker processes (one per core: interpret mode is mostly
# one Python thread; each test file stays in one worker, so module fixtures are shared), then
# nbval, also in two workers, over every committed notebook (fact cells are compared; each
# notebook's run time is reported, never asserted: notebooks/conftest.py), compiled as the
# conftests set it (cheap_compiles.cheap_cpu_compiles), the float-fact notebooks under
# OTHER_XLA_FLAGS too. `make test-exhaustive`: also the sweeps marked `exhaustive` (every
# combination of cases whose named ones `make test` runs), the whole sharded matrix of
# tests/test_sharded.py, and nbval over every notebook under this machine's switches alone (the
# committed outputs' way of summing, which `make test` leaves to the commit): over an hour here.
test-exhaustive: venv
	rm -rf $(JAX_CACHE)
	MKRESEARCH_EXHAUSTIVE=1 MKRESEARCH_SHARDED_FULL=1 $(PYTEST) tests
ifneq ($(NOTEBOOKS),)
	$(NBVAL) $(NOTEBOOKS)
endif

# One run's XLA executables, shared by its processes (xdist workers, the 8-device child, the
# notebooks' kernels): a program compiled once is read back by the next process that builds it
# instead of compiled again (the reference's jitted steps; the interpret-mode kernels call back
# into Python and are never written). Emptied at the start of each run, so a run is a cold run.
JAX_CACHE := build/jax-cache
test test-fast test-exhaustive bench-notebooks: export JAX_COMPILATION_CACHE_DIR = $(CURDIR)/$(JAX_CACHE)
test test-fast test-exhaustive bench-notebooks: export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS = 0.5

test: venv browser
	rm -rf $(JAX_CACHE)
	$(PYTEST) --durations=30 tests
ifneq ($(NOTEBOOKS),)
	MKRESEARCH_NBVAL_OTHER_XLA_FLAGS="$(OTHER_XLA_FLAGS)" $(NBVAL) $(NOTEBOOKS)
endif

# On a TPU VM: the tests marked tpu, compiled on the chip present (one process: one program at a
# time holds a TPU). Elsewhere they run in make test, in interpret mode. A machine with its own
# JAX and no venv: .ci/tpu-run python -m pytest -p no:nbval -m tpu tests
test-tpu: venv
	$(BIN)/python -m pytest -p no:nbval -m tpu -q tests

# Day-to-day: every test not marked slow (no nbval), about 3 minutes on 2 cores (cold cache).
test-fast: venv
	rm -rf $(JAX_CACHE)
	$(PYTEST) -m "not slow" tests

# Speed is measured here, never asserted in a test: each notebook's nbval run time and its slowest
# cells (build/notebook-times.md), and the speed targets the tests once asserted (benchmarks/speed.py).
bench-notebooks: venv
	rm -rf $(JAX_CACHE)
	mkdir -p build
	MKRESEARCH_NOTEBOOK_TIMES=build/notebook-times.md $(NBVAL) $(NOTEBOOKS)
	cat build/notebook-times.md

bench-speed: venv
	$(BIN)/python benchmarks/speed.py

# As root (a TPU VM's or a container's usual user) Jupyter refuses to start without --allow-root.
# LAB_ARGS passes more options: make lab LAB_ARGS="--no-browser --port=8890".
LAB_ARGS ?=
lab: venv
	$(BIN)/jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

figures: venv
	$(BIN)/mkresearch figures --out figures

# Re-record the slow results notebooks show instead of recomputing (mkresearch.cli.record writes
# mkresearch.measurement.recorded's records): the megakernel compiled for TPU7x at kimi-k3-rank
# shapes (the one-device stand-in for one rank of the release layout), at one rank of each other
# family (get_config("<preset>-rank")) and sharded over 32 ranks.
recorded: venv
	$(BIN)/python -m mkresearch.cli.record

# The package as users install it (.ci/wheel-check, run by .ci/run): the wheel built from a clean
# copy of the tree resolves for macOS arm64, Linux aarch64 and Windows; under Python 3.11 with
# every runtime dependency at its floor it imports every module and decodes; a Colab-like runtime
# (Python 3.12, Colab's pins) runs notebooks 00 and 06 on the first run, its first cell installing
# from the git repository and keeping the runtime's jax and numpy; the cell's restart paths.
wheel-check: venv
	bash .ci/wheel-check

.PHONY: wheel-check

# Re-execute every notebook from its jupytext .py twin (the .py is the source of truth).
notebooks: venv
	cd notebooks && for nb in $(notdir $(NOTEBOOK_SOURCES)); do \
		../$(BIN)/jupytext --sync --execute $$nb || exit 1; done

.PHONY: venv venv-hf demo browser test test-exhaustive test-fast test-tpu bench-notebooks bench-speed lab figures \
	recorded notebooks
