# `make test`: set up the pinned venv, lint and format-check with ruff, type-check with mypy, and run the suite. `make run`: set up and run the main job.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= jobs/configs/smollm2-quick.yaml

.PHONY: setup test test-fast run clean

# pip's own chatter (index warnings, build-backend notes) goes to a log; it is shown when set-up fails
$(VENV)/.installed: pyproject.toml constraints.txt
	@echo "setting up $(VENV) with the pinned dependencies (log: $(VENV)/setup.log)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@{ $(PY) -m pip install --quiet --upgrade pip && \
	   $(PY) -m pip install --quiet -c constraints.txt -e '.[test]'; } > $(VENV)/setup.log 2>&1 \
	  || { tail -n 40 $(VENV)/setup.log; echo "set-up failed: see $(VENV)/setup.log"; exit 1; }
	@touch $@

setup: $(VENV)/.installed

# speculators for the export test, beside the venv (requirements-speculators.txt says why)
$(VENV)/speculators/.installed: requirements-speculators.txt $(VENV)/.installed
	@rm -rf $(VENV)/speculators
	@$(PY) -m pip install --quiet --no-deps --target $(VENV)/speculators -r requirements-speculators.txt \
	  >> $(VENV)/setup.log 2>&1 || { tail -n 20 $(VENV)/setup.log; echo "speculators set-up failed"; exit 1; }
	@touch $@

# Two pytest-xdist workers, a module at a time: a module's fixtures (a feature store, a deployment, a
# two-node cluster) are built once, and tests/conftest.py hands the longest modules out first. Each worker
# starts its own local Ray. The suite is CPU-bound, mostly on process start-up: two workers keep both
# cores busy. mypy (~40 s of one core on a fresh clone) runs beside the suite, not before it, where the
# other core would idle; its report follows the suite's, and either failing fails the target.
test: setup $(VENV)/speculators/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	  $(PY) -m pytest -q --durations=15 --timeout=300 -p no:cacheprovider -n 2 --dist loadscope --no-loadscope-reorder tests; \
	  suite=$$?; wait $$mypy; typed=$$?; echo "mypy:"; cat $(VENV)/mypy.log; test $$suite -eq 0 -a $$typed -eq 0

# the method tests (griffin/, tiny random models, no Ray) and the import rules: about two minutes on 2 cores
test-fast: setup $(VENV)/speculators/.installed
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests/griffin tests/test_architecture.py

run: setup
	@$(VENV)/bin/griffin run -c $(CONFIG)

clean:
	rm -rf $(VENV) outputs
