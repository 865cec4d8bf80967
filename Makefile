# The two commands of the README quick start, and the benchmarks; all set up everything themselves.
#   make demo   run the reference job on the embedded default (2 emulated nodes x 2 ranks, CPU)
#   make test   run the whole test suite (installs Slurm for the end-to-end tests) in two lanes side by side,
#               then the torch-internals tests on every other supported torch release (make test-releases)
#   make check  in minutes: mypy over accelpact_slurm and ckpt_service (pyproject.toml [tool.mypy]), then the
#               unit lane
# The lanes of make test, each test in exactly one (pytest markers, pyproject.toml):
#   make test-unit      no rank spawned, no Slurm, not marked slow
#   make test-e2e       multiproc or slow (spawned ranks, whole jobs), not slurm
#   make test-slurm     slurm: jobs on the real Slurm dev cluster
#   make test-releases  the torch-internals tests on every supported torch release
#   make campaign  inject one fault per run into the decoder job, every run checked (scripts/campaign.py;
#               CAMPAIGN_ARGS="--seed 7"); writes runs/campaign-<date>.json and its table (outside git)
#   make bench  run every benchmark here (about 100 min: the parts ~35, scale ~45, the campaign's 50 runs ~20), commit-
#               ready summaries in benchmarks/summaries/<date>/, raw results in runs/bench/ (outside git), and
#               regenerate docs/benchmarks.md and the README's figures from the summaries (BENCH_ARGS="--parts a,b";
#               the parts are benchmarks/parts/<part>.py, listed in benchmarks/harness/run.py: e.g. --parts
#               store,control; --parts campaign runs only the campaign; --render only regenerates the docs)

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.accelpact-installed
RUN_DIR ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)
# The supported torch releases (accelpact_slurm/runtime/job/envelope.py SUPPORTED_RELEASES): the pinned one runs the
# whole suite; each other one runs RELEASE_TESTS in a venv of its own (scripts/torch_venv.py, cached).
TORCH_PINNED := 2.13.0
TORCH_RELEASES ?= 2.14.1 2.15.0
# What reaches into torch's internals: the repair shim, the runtime, snapshot capture and restore, ckpt_service's
# shim (compat), both examples end to end (an L1 boundary, an L1 backward and an L2 restart each, digests against
# the uninterrupted run) and the shipped envelope's keys earned again by accelpact-qualify trials.
EARNED_TEST := tests/e2e/test_envelope_earned.py
RELEASE_TESTS := tests/repair tests/runtime tests/ckpt_service/test_ckpt_capture.py tests/ckpt_service/test_compat.py \
                 tests/ckpt_service/test_inplace.py \
                 tests/e2e/test_examples.py \
                 $(EARNED_TEST)
# The examples' mixed-precision variants and their negative controls run on the pinned release only (the same
# paths, in bf16; the controls break this project's code, not torch's).
RELEASE_SKIP := not mixed_precision and not negative_control
# The lanes' markers: together they select every test of make test's pytest run once.
UNIT_MARKS := not multiproc and not slurm and not slow
E2E_MARKS  := (multiproc or slow) and not slurm

.PHONY: demo test test-unit test-e2e test-slurm test-releases check bench campaign venv clean envelope

venv: $(STAMP)

# torch first, pinned: the CPU build that lies on this machine (a bare "torch" pulls a CUDA build).
$(STAMP): setup.cfg pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PY) -m pip install --quiet --disable-pip-version-check torch==$(TORCH_PINNED)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[train,test,plot,hydra]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/accelpact-run examples/decoder/job.yaml --run-dir $(RUN_DIR) --inject-fault boundary:15:1

# make test runs the suite in two pytest processes side by side (every test once): the side lane takes the Slurm
# lane (mostly waiting on Slurm's scheduling and requeues), then SIDE_FILES; the main lane everything else. The side
# lane's output follows the main lane's; make test fails when either fails. Then make test-releases.
# ACCELPACT_CKPTD_IDLE=0: the lanes' jobs share the 2 cores, where a daemon's SCHED_IDLE writers would run only when
# both lanes idle (docs/checkpoints.md); make test-releases runs alone, at the default.
SIDE_FILES := tests/e2e/test_examples.py tests/e2e/test_bn_models.py tests/e2e/test_l2_reload_e2e.py tests/test_campaign.py \
              tests/e2e/test_heal_local.py
SIDE_LOG   := runs/test/side-lane.log

test: $(STAMP)
	@mkdir -p $(dir $(SIDE_LOG))
	@export ACCELPACT_REQUIRE_SLURM=$${ACCELPACT_REQUIRE_SLURM:-1} ACCELPACT_CKPTD_IDLE=$${ACCELPACT_CKPTD_IDLE:-0}; \
	start=$$(date +%s); \
	( $(PY) -m pytest tests --ignore=$(EARNED_TEST) -m slurm --durations=15 -p no:cacheprovider $(PYTEST_ARGS); a=$$?; \
	  $(PY) -m pytest $(SIDE_FILES) -m "not slurm" --durations=15 -p no:cacheprovider $(PYTEST_ARGS); b=$$?; \
	  test $$a -eq 0 -a $$b -eq 0 ) > $(SIDE_LOG) 2>&1 & side=$$!; \
	trap 'kill $$side 2>/dev/null' INT TERM; \
	echo "== make test: the main lane here; the side lane (-m slurm, then $(SIDE_FILES)) beside it, in $(SIDE_LOG)"; \
	$(PY) -m pytest tests --ignore=$(EARNED_TEST) $(foreach f,$(SIDE_FILES),--ignore=$(f)) -m "not slurm" \
	  --durations=30 -p no:cacheprovider $(PYTEST_ARGS); main=$$?; \
	echo "== the main lane ended ($$main) after $$(( $$(date +%s) - start )) s; waiting for the side lane"; \
	wait $$side; side_rc=$$?; \
	echo "== the side lane ($$side_rc), its output:"; cat $(SIDE_LOG); \
	echo "== both lanes ended after $$(( $$(date +%s) - start )) s"; \
	test $$main -eq 0 -a $$side_rc -eq 0
	$(MAKE) test-releases

test-unit: $(STAMP)
	$(PY) -m pytest tests --ignore=$(EARNED_TEST) -m "$(UNIT_MARKS)" $(PYTEST_ARGS)

test-e2e: $(STAMP)
	$(PY) -m pytest tests --ignore=$(EARNED_TEST) -m "$(E2E_MARKS)" $(PYTEST_ARGS)

test-slurm: $(STAMP)
	ACCELPACT_REQUIRE_SLURM=$${ACCELPACT_REQUIRE_SLURM:-1} $(PY) -m pytest tests --ignore=$(EARNED_TEST) -m slurm $(PYTEST_ARGS)

check: $(STAMP)
	$(PY) -m mypy
	$(PY) -m pytest tests -q --ignore=$(EARNED_TEST) -m "$(UNIT_MARKS)" $(PYTEST_ARGS)

# The envelope's keys earned again on the pinned release; then each other release: its venv (built once, then
# cached) and RELEASE_TESTS, run from this checkout.
test-releases: $(STAMP)
	@echo "== torch $(TORCH_PINNED): $(EARNED_TEST)"
	$(PY) -m pytest $(EARNED_TEST) $(PYTEST_ARGS)
	@set -e; for v in $(TORCH_RELEASES); do \
	  py=$$($(PYTHON) scripts/torch_venv.py $$v | tail -n 1); \
	  echo "== torch $$v: $(RELEASE_TESTS)"; \
	  PYTHONPATH=$(CURDIR) $$py -m pytest $(RELEASE_TESTS) -k "$(RELEASE_SKIP)" $(PYTEST_ARGS); \
	done

# Earn the shipped envelope's keys again on every supported release and write them (scripts/earn_envelope.py).
envelope: $(STAMP)
	$(PY) scripts/earn_envelope.py --write --python $(PY) \
	  $(foreach v,$(TORCH_RELEASES),--python $$($(PYTHON) scripts/torch_venv.py $(v) | tail -n 1))

bench: $(STAMP)
	$(PY) -m benchmarks.harness.run $(BENCH_ARGS)

# The fault campaign: CAMPAIGN_RUNS faults (the kinds in turn), each run against the uninterrupted run's digest.
CAMPAIGN_RUNS ?= 50
CAMPAIGN_ARGS ?=
CAMPAIGN_DATE := $(shell date +%Y-%m-%d)
campaign: $(STAMP)
	$(PY) scripts/campaign.py --runs $(CAMPAIGN_RUNS) --json runs/campaign-$(CAMPAIGN_DATE).json \
	  --markdown runs/campaign-$(CAMPAIGN_DATE).md $(CAMPAIGN_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
