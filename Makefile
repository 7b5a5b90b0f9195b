# The two commands of the README: `make run` (the main job) and `make test` (the whole suite).
# Both install what they need first (scripts/install.sh is idempotent: a stamp skips it).
PY := .venv/bin/python

.PHONY: install run test bench-base-bound bench-speed

install:
	@./scripts/install.sh

run: install
	$(PY) -m rope_plugins base-bound

test: install
	$(PY) -m pytest

bench-speed: install
	$(PY) bench/speed.py

bench-base-bound: install
	$(PY) bench/base_bound_row.py
