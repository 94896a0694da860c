# Quick start: `make demo`, then `make test`. Both create the virtualenv $(VENV) and install into it.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# The CPU build of torch; any torch >= 2.4 works for the generated code.
TORCH ?= torch==2.13.0

.PHONY: demo test venv clean update-pairs

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	touch $@

demo: venv
	$(PY) examples/demo.py

test: venv
	$(PY) -m pytest -q

# Regenerate the expected outputs in tests/pairs/ after an intended change to templates/ or the codemods.
update-pairs: venv
	MOE_REWRITE_UPDATE_PAIRS=1 $(PY) -m pytest -q tests/test_codemod.py -k fixture_pair

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
