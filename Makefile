# The two commands of the README. Both set up .venv first (scripts/setup_env.sh: seconds when
# everything is in place; ~10 minutes on a fresh machine, mostly building Horovod).
PY := .venv/bin/python

.PHONY: demo test test-all setup

setup:
	@bash scripts/setup_env.sh

demo: setup
	@.venv/bin/dapple demo

test: setup
	@$(PY) -m pytest

test-all: setup
	@$(PY) -m pytest -m ""
