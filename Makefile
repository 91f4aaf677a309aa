# Two entry points on a fresh machine (each installs what it needs into .venv first):
#   make demo   - build a tiny Qwen3 model locally (tokenizer + a few seconds of training) and generate from it
#   make test   - install the test dependencies (HF transformers is the reference) and run the test suite
VENV ?= .venv
BIN := $(VENV)/bin
TINY ?= build/tiny-qwen3

.PHONY: demo test install install-test gpu-check clean

install:
	VENV=$(VENV) bash scripts/install.sh

install-test:
	VENV=$(VENV) bash scripts/install.sh test

demo: install
	$(BIN)/orinfer make-tiny $(TINY) 
	$(BIN)/orinfer generate -m $(TINY) -p "Alice was beginning to get very" --max-tokens 48 --temperature 0
	$(BIN)/orinfer generate -m $(TINY) -p "Who is Alice?" --chat --no-think --max-tokens 32 --seed 0

test: install-test
	$(BIN)/python -m pytest -q

clean:
	rm -rf build .pytest_cache
