# Two entry points on a fresh machine (each installs what it needs into .venv first):
#   make demo   - build a tiny Qwen3 model locally (tokenizer + half a minute of training) and generate from it
#   make test   - install the test dependencies (HF transformers is the reference) and run the default test tier
# then make test-heavy (the default tier's costliest checks, which CI runs after it), and on demand (not in CI):
# make test-slow (the slow tier: the rest of the kernel test matrices), make test-matrix (the
# costliest matrices beyond a pairwise cover) and make test-all (everything).
VENV ?= .venv
BIN := $(VENV)/bin
TINY ?= build/tiny-qwen3

.PHONY: demo test test-heavy test-slow test-matrix test-all install install-test clean

install:
	VENV=$(VENV) bash scripts/install.sh

install-test:
	VENV=$(VENV) bash scripts/install.sh test

demo: install
	$(BIN)/orinfer make-tiny $(TINY) 
	$(BIN)/orinfer generate -m $(TINY) -p "Alice was beginning to get very" --max-tokens 48 --temperature 0
	$(BIN)/orinfer generate -m $(TINY) -p "Who is Alice?" --chat --no-think --max-tokens 32 --seed 0

# The tiers split by the `slow` marker (pyproject.toml, tests/conftest.py). pytest exits with 5 when it selects no
# test at all (a tier with nothing in it): that is no failure.
# TEST_WORKERS: pytest-xdist worker processes (CI's machine has two cores; each worker runs torch on one thread);
# files stay whole on one worker, so module fixtures are made once. TEST_WORKERS=0 runs in this process.
# Compiled modules (and pytest's rewritten test modules) are cached in __pycache__ even where the environment says not
# to: each pytest process (the xdist controller and each worker) otherwise compiles all of orinfer and tests/ again.
TEST_WORKERS ?= 2
PYTEST = PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile
# CI's two tiers load no pytest plugin they do not use: schemathesis's (its fuzz test is in the slow tier) has pytest
# rewrite and import its whole package in every process, ~20 s each on CI's machine; the unraisable-exception
# plugin's five garbage collections at each worker's end take seconds over a heap of torch and transformers objects.
CI_TIER_OPTS = -p no:schemathesis -p no:hypothesispytest -p no:anyio -p no:unraisableexception

test: install-test
	$(PYTEST) $(CI_TIER_OPTS) -m "not slow and not heavy" || [ $$? -eq 5 ]

# The default tier's costliest checks (tests/cpu_heavy_cases.txt, and every check of a trained prebuilt model of
# tests/prebuilt.py), split off so that `make test` ends in minutes; CI runs them right after it.
test-heavy: install-test
	$(PYTEST) $(CI_TIER_OPTS) -m "heavy and not slow" || [ $$? -eq 5 ]

test-slow: install-test
	$(PYTEST) -m "slow and not matrix" || [ $$? -eq 5 ]

# The rest of the costliest interpreter matrices (`matrix`: cases beyond a pairwise cover of their parameters).
test-matrix: install-test
	$(PYTEST) -m matrix || [ $$? -eq 5 ]

test-all: install-test
	$(PYTEST) || [ $$? -eq 5 ]

clean:
	rm -rf build .pytest_cache
