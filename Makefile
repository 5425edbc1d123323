# Two entry points a new machine needs: `make demo` (the main job) and `make test`.
# Both create .venv and install the pinned stack on first use; nothing is downloaded at run time.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test test-fast bench install clean

demo: $(STAMP)
	$(BIN)/python examples/train_digits.py

# Two workers, a module each at a time (module fixtures compile once): a test run uses a little
# over one core on average (LLVM, torch.export), and CI has two. The modules go out in collection
# order, the longest first (tests/conftest.py): by default pytest-xdist hands out the modules with
# the most tests first, the OpInfo sweep (one test of 13 minutes) started last, and one worker ran
# alone for the last ten of the 60 minutes on the 2-vCPU Zen 3.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow"

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

install: $(STAMP)

# torch goes in first and explicitly: the CPU wheel lies on this machine's disk, and letting a
# dependency pull "torch" would fetch a multi-GB CUDA build instead.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev,cross,plot]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) .pytest_cache
