# Two commands on a fresh machine: `make run` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install run test bench clean

install: $(STAMP)

# torch is pinned first: a bare `torch` requirement could pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/oxserve generate --prompt "The engine serves" --prompt "Hello" --max-tokens 32

test: $(STAMP)
	$(PY) -m pytest -q -x

bench: $(STAMP)
	$(VENV)/bin/oxserve bench throughput

clean:
	rm -rf $(VENV) *.egg-info
