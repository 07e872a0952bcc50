# The two commands of the README. Both set up the environment first (scripts/setup_env.sh:
# seconds when everything is in place; ~10 minutes on a fresh machine, mostly building Horovod).
# The default stack is TensorFlow 2.18.1 in .venv; DAPPLE_TF=2.15 selects TensorFlow 2.15.1 in
# .venv-tf2.15 (scripts/test_tf215.sh runs the suite there).
VENV := $(or $(DAPPLE_VENV),$(if $(filter 2.15 2.15.1,$(DAPPLE_TF)),.venv-tf2.15,.venv))
PY := $(VENV)/bin/python

.PHONY: demo test test-all setup

setup:
	@bash scripts/setup_env.sh

demo: setup
	@$(VENV)/bin/dapple demo

test: setup
	@$(PY) -m pytest

test-all: setup
	@$(PY) -m pytest -m ""
