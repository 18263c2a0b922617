# The project's front door: `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast test-slow bench lint proto metrics-table clean

install: $(STAMP)

# torch is pinned and installed first, so no resolver ever pulls a CUDA build of several GB.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	touch $(STAMP)

# Compares the strategies on scikit-learn's bundled digits (real data, no download):
# the table at the end, and runs/demo/report.html with the plots.
DEMO_STRATEGIES := baseline,ps-sync,ps-async,ddp,ps-sync+topk
demo: install
	rm -rf runs/demo
	$(VENV)/bin/disttrain compare --dataset digits --workers 2 --num-epochs 10 \
		--strategies $(DEMO_STRATEGIES) --output-dir runs/demo

# The import contracts and style first (make lint), then every test.
test: lint
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

test-slow: install
	$(PY) -m pytest -q -m slow

BENCHMARKS := $(filter-out common ps_helpers,$(basename $(notdir $(wildcard benchmarks/*.py))))

# Each benchmark prints its JSON and writes it under runs/bench/.
bench: install
	mkdir -p runs/bench
	for name in $(BENCHMARKS); do \
		$(PY) benchmarks/$$name.py --output runs/bench/$$name.json || exit 1; \
	done

# Style, and the import contracts of pyproject.toml (layers; strategies as peers).
lint: install
	$(VENV)/bin/ruff check src tests benchmarks tools
	$(VENV)/bin/lint-imports

# Regenerate src/disttrain/proto/ from proto/disttrain/v1/*.proto (commit the result;
# tests/unit/test_proto_stubs.py fails while the committed stubs are stale).
proto: install
	$(PY) tools/proto.py

# Rewrite the README's metrics tables from src/disttrain/metrics/keys.py (commit the result;
# tests/unit/test_metrics.py fails while they differ).
metrics-table: install
	$(PY) tools/metrics_table.py

clean:
	rm -rf runs .pytest_cache build
