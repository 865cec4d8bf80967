# The two commands of the README quick start, and the benchmarks; all set up everything themselves.
#   make demo   run the reference job on the embedded default (2 emulated nodes x 2 ranks, CPU)
#   make test   run the whole test suite (installs Slurm for the end-to-end tests)
#   make bench  run every benchmark here (under 30 min) and regenerate docs/benchmarks.md (BENCH_ARGS="--parts a,b")

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.accelpact-installed
RUN_DIR ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)

.PHONY: demo test bench venv clean

venv: $(STAMP)

# torch first, pinned: the CPU build that lies on this machine (a bare "torch" pulls a CUDA build).
$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[train,test,plot]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/accelpact-run examples/decoder/job.yaml --run-dir $(RUN_DIR) --inject-fault boundary:15:1

test: $(STAMP)
	ACCELPACT_REQUIRE_SLURM=$${ACCELPACT_REQUIRE_SLURM:-1} $(PY) -m pytest tests $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) scripts/bench_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
