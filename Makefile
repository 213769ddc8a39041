# Two commands on a fresh machine: `make demo` and `make test`.

PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# transformers>=5.2 (the Qwen3.5 reference) conflicts with fairseq2's pins, so
# the tests run it from an isolated overlay in a subprocess.
HF_REFERENCE_DIR ?= .cache/hf-reference
HF_REFERENCE_VERSION ?= 5.24.0
# PEFT, the LoRA reference, and accelerate, which PEFT imports.
PEFT_REFERENCE_VERSION ?= 0.21.2
ACCELERATE_REFERENCE_VERSION ?= 1.15.0

export FAIRSEQ2_EXTENSION_TRACE := 1

# pytest-xdist workers of `make test` and `make test-fast`, each taking a test
# file at a time (tests/parallel_runs.py); PYTEST_WORKERS=0 runs the tests
# serially in one process.
PYTEST_WORKERS ?= 2
PYTEST := $(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile
# The most the tests hold in TMPDIR (or /tmp) at once, with a margin: `make
# test` and `make test-fast` stop first with a clear error when less is free
# (measured peak: docs/performance.md, "Disk").
TEST_FREE_DISK_GIB ?= 8

# Errors only: the machines' pip configuration names find-links directories
# that some of them lack, and pip warns about each one for every package it
# looks up, hundreds of lines that pushed the tests' output out of the part
# of a CI log that is kept.
PIP_INSTALL := $(BIN)/pip install --quiet --quiet

# What pip installs must be byte-compiled: the machines set
# PYTHONDONTWRITEBYTECODE=1, so a module without its .pyc is compiled again
# in every process that imports it (`import qwen35_fs2.recipes.sft.recipe`
# took 72 s instead of 23 s; docs/performance.md, "The test suite's time").
# pip compiles one file at a time; compileall with a process a core compiled
# the venv and the overlay in 233 s instead of about 400 (2 cores, slow
# hours), so pip installs without compiling and this compiles right after.
COMPILEALL := $(BIN)/python -m compileall -q -j 0

# Our own modules byte-compiled before the tests, for the same reason: every
# recipe run, torchrun rank and worker the tests start imports them (4 s, once).
COMPILE_OWN := $(COMPILEALL) src tests scripts benchmarks

.PHONY: setup test test-fast demo gpu-check clean

setup: $(VENV)/.installed $(HF_REFERENCE_DIR)/.installed

$(VENV)/.installed: pyproject.toml
	@bash scripts/check_system_deps.sh
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) --no-compile -e '.[test]'
	$(COMPILEALL) $(VENV)/lib
	touch $@

# --no-warn-conflicts: pip would compare the overlay's transformers 5.x with
# fairseq2's pins in the venv, which the overlay does not touch. PEFT and
# accelerate go in with --no-deps: pip --target would otherwise put a second
# torch (with CUDA, gigabytes) into the overlay, shadowing the venv's; their
# other dependencies are transformers' or the venv's (torch, psutil).
$(HF_REFERENCE_DIR)/.installed: $(VENV)/.installed
	$(PIP_INSTALL) --no-compile --no-warn-conflicts --target $(HF_REFERENCE_DIR) transformers==$(HF_REFERENCE_VERSION)
	$(PIP_INSTALL) --no-compile --no-warn-conflicts --no-deps --target $(HF_REFERENCE_DIR) peft==$(PEFT_REFERENCE_VERSION) accelerate==$(ACCELERATE_REFERENCE_VERSION)
	$(COMPILEALL) $(HF_REFERENCE_DIR)
	touch $@

test: setup
	@bash scripts/check_free_disk.sh $(TEST_FREE_DISK_GIB)
	$(COMPILE_OWN)
	QWEN35_HF_REFERENCE_DIR=$(abspath $(HF_REFERENCE_DIR)) $(PYTEST) tests

# Everything except the tests marked slow.
test-fast: setup
	@bash scripts/check_free_disk.sh $(TEST_FREE_DISK_GIB)
	$(COMPILE_OWN)
	QWEN35_HF_REFERENCE_DIR=$(abspath $(HF_REFERENCE_DIR)) $(PYTEST) tests -m "not slow"

demo: setup
	$(BIN)/python -m qwen35_fs2.demo

# On a machine with a CUDA GPU: the CUDA tests and the training-step
# benchmarks on it, one JSON report (gpu_check_report.json; docs/performance.md,
# "GPU check"). Options go in GPU_CHECK_ARGS, e.g. GPU_CHECK_ARGS="--only dense".
gpu-check: setup
	QWEN35_HF_REFERENCE_DIR=$(abspath $(HF_REFERENCE_DIR)) $(BIN)/python scripts/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .cache
