# The project's front door: `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install lock demo test test-fast test-slow test-bench test-extended bench bench-quick chaos lint proto metrics-table docs docs-reference clean

install: $(STAMP)

# Exact versions of every package, tested together; pyproject.toml keeps ranges, so that
# `pip install .` fits into a user's environment. `make lock` writes it again.
LOCK := requirements.lock
TORCH_VERSION := $(shell sed -n 's/^torch==//p' $(LOCK))
# torch comes first, from TORCH_INDEX: the CPU build unless asked otherwise, so nobody gets
# the several GB of CUDA libraries they did not ask for. For a CUDA build:
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cu128
# With the default, a torch wheel already in pip's find-links is used without a download
# (its own dependencies come with the project's, from the lock).
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(TORCH_CPU_INDEX)

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	if [ "$(TORCH_INDEX)" = "$(TORCH_CPU_INDEX)" ] \
		&& $(PIP) install --quiet --no-index --no-deps torch==$(TORCH_VERSION) 2>/dev/null; then :; \
	else $(PIP) install --quiet --index-url $(TORCH_INDEX) torch==$(TORCH_VERSION); fi
	$(PIP) install --quiet -c $(LOCK) -e '.[test,docs]'
	touch $(STAMP)

# Resolve pyproject.toml's ranges again in a fresh environment and pin the result.
lock:
	rm -rf build/lock-venv
	$(PYTHON) -m venv build/lock-venv
	build/lock-venv/bin/pip install --quiet torch==$(TORCH_VERSION) --index-url $(TORCH_INDEX) \
		--extra-index-url https://pypi.org/simple
	build/lock-venv/bin/pip install --quiet '.[test,docs]'
	( echo "# Exact versions installed by make (pip install -c $(LOCK)); regenerate with make lock."; \
	  build/lock-venv/bin/pip freeze --exclude disttrain | sed -E 's/^(torch==[^+]*)\+.*/\1/' ) > $(LOCK)
	rm -rf build/lock-venv

# Compares the strategies on the digits data set shipped with disttrain (real data, no download):
# the table at the end, and runs/demo/report.html with the plots.
DEMO_STRATEGIES := baseline,ps-sync,ps-async,ddp,ps-sync+topk
demo: install
	rm -rf runs/demo
	$(VENV)/bin/disttrain compare --dataset digits --workers 2 --num-epochs 10 \
		--strategies $(DEMO_STRATEGIES) --output-dir runs/demo

# The import contracts and style first (make lint), then every test, in TEST_WORKERS
# processes (pytest-xdist): a test spends most of its time waiting on the processes it
# starts, so two share two cores well. Each test file stays in one process (its
# module-wide fixtures run once). TEST_WORKERS=0 runs them in this one process. The tests
# marked `serial` (speeds or clocks measured in the run decide what they check) run after
# the others, alone. The tests marked `bench` run the benchmark scripts end to end (their
# quick modes, minutes each): `make test-bench` runs them, `make test` leaves them out, and
# so it does the tests marked `extended` (more variants of a capability the suite already
# runs end to end: another compressor, mode or rank on the same path): `make test-extended`.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q --durations=20
PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
# $(1): the marker expression of the tests to run (none: every test).
# The serial phase may select nothing (every serial test is slow, so test-fast has none):
# pytest's exit 5, "no tests collected", is then no failure.
define run_tests
	$(PYTEST) $(PARALLEL) -m "$(if $(1),($(1)) and )not serial and not bench and not extended"
	$(PYTEST) -m "$(if $(1),($(1)) and )serial and not bench and not extended" || test $$? -eq 5
endef

test: lint
	$(call run_tests)

test-fast: install
	$(call run_tests,not slow)

test-slow: install
	$(call run_tests,slow)

test-bench: install
	$(PYTEST) $(PARALLEL) -m bench

test-extended: install
	$(PYTEST) $(PARALLEL) -m "extended and not bench"

# Every script of benchmarks/ but the helper modules they import.
BENCHMARKS := $(filter-out common ps_helpers chaos_ddp,$(basename $(notdir $(wildcard benchmarks/*.py))))

# Runs every benchmark with the flags $(2), its JSON into $(1)/NAME.json (each also prints
# it), and says how long each took (also in $(1)/wall_times.txt); then checks that the
# JSON has the keys of the full runs' recorded in benchmarks/shapes.json.
define run_benchmarks
	mkdir -p $(1)
	rm -f $(1)/wall_times.txt
	for name in $(BENCHMARKS); do \
		start=$$(date +%s); \
		$(PY) benchmarks/$$name.py $(2) --output $(1)/$$name.json || exit 1; \
		echo "$$name: $$(( $$(date +%s) - start )) s" | tee -a $(1)/wall_times.txt; \
	done
	$(PY) tools/bench_shapes.py $(1)
endef

# The full measurements (an hour or more on 2 cores): MNIST where a copy is found
# ($DISTTRAIN_DATA_DIR, ./data, ../shared/data), JSON under runs/bench/.
bench: install
	$(call run_benchmarks,runs/bench,)

# Every benchmark's quick mode (smaller sizes, digits or synthetic data, about 12 and a half minutes in
# all): the same JSON keys as `make bench`, under runs/bench-quick/.
bench-quick: install
	$(call run_benchmarks,runs/bench-quick,--quick)

# Generated fault schedules over real runs (`disttrain chaos --help`): CHAOS_SCHEDULES of
# them over every scenario in turn, from seed CHAOS_SEED; the campaign's JSON (schedules
# run, finished, stopped with a reason, invariant violations, slowdown, longest recovery)
# in runs/chaos/chaos.json. About 30 s a schedule on 2 cores; a broken invariant fails it.
CHAOS_SCHEDULES ?= 204
CHAOS_SEED ?= 0
chaos: install
	rm -rf runs/chaos
	$(VENV)/bin/disttrain chaos --schedules $(CHAOS_SCHEDULES) --seed $(CHAOS_SEED) --work-dir runs/chaos \
		--output runs/chaos/chaos.json

# Style, and the import contracts of pyproject.toml (layers; strategies as peers).
lint: install
	$(VENV)/bin/ruff check src tests benchmarks tools
	$(VENV)/bin/lint-imports
	$(PY) tools/test_names.py

# Regenerate src/disttrain/proto/ from proto/disttrain/v1/*.proto (commit the result;
# tests/unit/test_proto_stubs.py fails while the committed stubs are stale).
proto: install
	$(PY) tools/proto.py

# Rewrite docs/metrics.md's tables from src/disttrain/metrics/keys.py (commit the result;
# tests/unit/test_metrics.py fails while they differ).
metrics-table: install
	$(PY) tools/metrics_table.py

# Rewrite docs/reference/config.md and flags.md from the config schema, the usage rules and
# the command line's parsers (commit the result; tests/unit/test_docs_reference.py fails
# while they differ).
docs-reference: install
	$(PY) tools/docs_reference.py

# The docs site (mkdocs.yml: docs/, the README as its home page, the changelog) into
# build/site, with --strict: a broken link or anchor fails it. The generated pages are
# checked first.
docs: install
	$(PY) tools/docs_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The GPU check (tools/gpu_check.sh): on a CUDA machine every CUDA path once, in one go, into
# one JSON ($OUT/gpu_check.json, else runs/gpu_check/); without CUDA, one line and exit 0.
# GPU_CHECK_FLAGS=--cpu runs its steps on the CPU. Needs no install: a GPU machine has no network.
.PHONY: gpu-check gpu-wheels
gpu-check:
	tools/gpu_check.sh $(GPU_CHECK_FLAGS)

# The wheels gpu-check installs on a GPU machine (what its image lacks), into .whl/ (git-ignored).
gpu-wheels:
	tools/gpu_wheels.sh

# The project's image and the compose cluster (docs/deploy.md, "Containers"), with the
# engine found here: podman, else docker (ENGINE=... to choose). The base is a minimal
# Debian made by debootstrap (docker/base.sh, as root, once; BASE_IMAGE=python:3.11-slim
# builds on a registry's instead), the wheels are fetched with this machine's pip
# (docker/wheels.sh: none when nothing changed), and the engine's layer cache keeps a
# build after a change to src/ under a minute (TORCH_INDEX as for install).
.PHONY: image cluster-up cluster-down
ifndef ENGINE
ENGINE = $(eval ENGINE := $(shell for engine in podman docker; do \
	$$engine info >/dev/null 2>&1 && { echo $$engine; break; }; done))$(ENGINE)
endif
COMPOSE ?= $(if $(filter podman,$(ENGINE)),podman-compose,$(ENGINE) compose)
IMAGE ?= disttrain:latest
DEBIAN_BASE := localhost/disttrain-base:bookworm
BASE_IMAGE ?= $(DEBIAN_BASE)
# The uid the containers run as: the owner of the cluster's shared folders (root's become its).
APP_UID ?= $(if $(filter 0,$(shell id -u)),1000,$(shell id -u))
NO_ENGINE = { echo "make: no container engine runs here (podman info and docker info both fail):" \
	"install one (docker/podman_host.sh sets up podman on Debian) or name it: ENGINE=docker" >&2; exit 2; }

image:
	@test -n "$(ENGINE)" || $(NO_ENGINE)
	if [ "$(BASE_IMAGE)" = "$(DEBIAN_BASE)" ]; then docker/base.sh $(ENGINE) $(BASE_IMAGE); fi
	PYTHON=$(PYTHON) TORCH_INDEX=$(TORCH_INDEX) docker/wheels.sh $(ENGINE) $(BASE_IMAGE)
	$(ENGINE) build -f docker/Dockerfile -t $(IMAGE) --build-arg BASE_IMAGE=$(BASE_IMAGE) \
		--build-arg TORCH_INDEX=$(TORCH_INDEX) --build-arg APP_UID=$(APP_UID) .

# The run's credentials (docker/cluster_env.sh: the secret for the coordinator and the
# server, its own node token for each worker), then the cluster, in the background; its
# checkpoints, logs and summary in runs/cluster/ (DISTTRAIN_RUN_DIR), its config
# DISTTRAIN_CONFIG's (ps_sync_mnist unless set). `$(COMPOSE) logs` shows what it did.
cluster-up: image
	docker/cluster_env.sh $(ENGINE) $(IMAGE) $(APP_UID)
	$(COMPOSE) up -d --no-build

cluster-down:
	@test -n "$(ENGINE)" || $(NO_ENGINE)
	$(COMPOSE) down

clean:
	rm -rf runs .pytest_cache build
