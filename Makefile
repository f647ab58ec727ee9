# Two commands on a fresh machine: `make run` and `make test`.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install run test bench clean

install: $(STAMP)

# torch is pinned first: a bare `torch` requirement could pull a multi-GB CUDA build.
# A C compiler builds the native CPU kernels (oxserve/kernels/native) on first use; libffi's
# header, the replay of captured decode steps (oxserve/kernels/call_list.py).
# Debian's chromium is the browser of the dashboard's test (Playwright's own download is unreachable).
$(STAMP): pyproject.toml
	command -v cc >/dev/null || (apt-get update -q && apt-get install -y -q gcc)
	echo '#include <ffi.h>' | cc -E - >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q libffi-dev)
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# The main job: the OpenAI-compatible server on the embedded default model (trained, shipped in the repo).
run: $(STAMP)
	@echo 'oxserve: serving the default model (a small Python code model) at http://127.0.0.1:8000/v1 -- try:'
	@echo "  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d '{\"prompt\": \"def fibonacci(n):\", \"max_tokens\": 48}'"
	@echo '  or, in Python: openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x").completions.create(model="oxserve-default", prompt="import os")'
	$(VENV)/bin/oxserve serve --host 127.0.0.1 --port 8000 --tool-call-parser glm --enable-auto-tool-choice --reasoning-parser glm

# Bytecode first: the suite starts many Python processes (servers, parallel ranks), and where
# PYTHONDONTWRITEBYTECODE is set each would compile oxserve again (importing the experiment
# worker: 2.0 -> 1.65 s on this machine, `time python -c "import oxserve.experiment.worker"`).
test: $(STAMP)
	$(PY) -m compileall -q oxserve >/dev/null
	$(PY) -m pytest -q -x

bench: $(STAMP)
	$(VENV)/bin/oxserve bench throughput

clean:
	rm -rf $(VENV) *.egg-info
