# The two commands of the README: `make run` (the main job) and `make test` (the whole suite,
# after `make lint`).
# Both install what they need first (scripts/install.sh is idempotent: a stamp skips it).
PY := .venv/bin/python

.PHONY: install run lint test bench-speed

install:
	@./scripts/install.sh

# the server on 127.0.0.1:8000 with the embedded default model, started again if its engine dies
# (server/supervisor.py); `make run ARGS="--help"` for flags
run: install
	$(PY) -m rope_plugins.server.supervisor $(ARGS)

# ruff ([tool.ruff] in pyproject.toml) and no function over 60 lines; .pre-commit-config.yaml
# runs both before a commit too
lint: install
	$(PY) -m ruff check .
	$(PY) scripts/function_lengths.py
	$(PY) scripts/readme_flags.py --check

# the 30 slowest tests at the end: the suite has a budget (CONTRIBUTING.md)
test: install lint
	@./scripts/install_browser.sh
	$(PY) -m pytest --durations=30

bench-speed: install
	$(PY) -m bench speed
