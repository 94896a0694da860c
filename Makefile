# Quick start: `make demo`, then `make test`. Both create the virtualenv $(VENV) and install into it: the demo what it
# needs, the tests their extra on top.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
# The CPU build of torch; any torch >= 2.5 works for the generated code.
TORCH ?= torch==2.13.0

# transformers releases the compat tests run on, each in .venv-tf/RELEASE beside the main environment (whose
# transformers, from the test extra, is the fourth). Each shares the main environment's torch through a .pth line.
COMPAT_RELEASES ?= 4.46.3 4.57.6 5.12.1 5.24.0
COMPAT_ENVS := $(foreach v,$(COMPAT_RELEASES),.venv-tf/$(v)/.installed)
# On transformers 5.x peft wraps the fused expert parameters for target_modules too, and converts (or, for remote
# code, does not convert) per-expert adapters: those LoRA tests run again on the newest compat release.
LORA_RELEASE := $(lastword $(COMPAT_RELEASES))
LORA_V5_TESTS := target_modules or per_expert_adapter

.PHONY: demo test test-fast venv demo-venv compat-envs clean update-pairs

venv: $(VENV)/.installed
demo-venv: $(VENV)/.demo-installed

# What the demo needs (torch, then moe-rewrite with the demo extra); the tests add the test extra below.
$(VENV)/.demo-installed: pyproject.toml
	@echo "==> creating the virtualenv $(VENV)"
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	@echo "==> installing $(TORCH) (CPU build; the largest download)"
	$(PY) -m pip install --disable-pip-version-check --progress-bar on "$(TORCH)"
	@echo "==> installing moe-rewrite and transformers (the demo extra)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[demo]"
	touch $@

$(VENV)/.installed: $(VENV)/.demo-installed
	@echo "==> installing the test dependencies (the test extra: pytest, ruff, peft, accelerate, pre-commit)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	touch $@

demo: demo-venv
	@echo "==> running examples/demo.py"
	$(PY) examples/demo.py

compat-envs: $(COMPAT_ENVS)

.venv-tf/%/.installed: $(VENV)/.installed
	@echo "==> installing transformers $* in .venv-tf/$* (compat tests)"
	rm -rf .venv-tf/$*
	$(PYTHON) -m venv .venv-tf/$*
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$(.venv-tf/$*/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_moe_rewrite_base.pth"
	.venv-tf/$*/bin/python -m pip install -q --disable-pip-version-check "transformers==$*"
	touch $@

# pytest-xdist processes for `make test` (CI's machine has 2 cores; the suite's tests are independent).
TEST_WORKERS ?= 2

# ruff (pinned in the test extra) lints and checks the format of everything, moe_rewrite/runtime/ included, before the tests.
test: venv compat-envs
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/ruff format --check --no-cache .
	MOE_REWRITE_COMPAT_RELEASES="$(COMPAT_RELEASES)" $(PY) -m pytest -q -n $(TEST_WORKERS) --durations=15
	.venv-tf/$(LORA_RELEASE)/bin/python -m pytest -q tests/test_lora_parameters.py -k "$(LORA_V5_TESTS)"

# The inner loop (under 3 minutes on CI's 2 cores): ruff, then the tests not marked slow or gpu (pyproject.toml's
# markers); `make test` runs them all. Only `make test` covers: torch.compile, the Trainer and examples/ runs,
# use_mla=False, gradient checkpointing of the default model, the hub's cache fallback, the fp8-compute banner,
# ESFT's per-expert default, expert parallelism's processes, the pre-commit hooks and the installed wheel.
test-fast: venv
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/ruff format --check --no-cache .
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not slow and not gpu"

# Regenerate the goldens in tests/pairs/ (diffs and section hashes) after an intended change to moe_rewrite/runtime/ or the
# codemods; the tests that wrote a golden skip ("updated ..."): review them with git diff. Then the generated code's
# fingerprint is recorded with the version (tests/test_version.py), which must have moved if the code did.
update-pairs: venv
	MOE_REWRITE_UPDATE_PAIRS=1 $(PY) -m pytest -q tests/test_codemod.py -k "fixture_pair or fixture_under_options or section_hashes"
	MOE_REWRITE_UPDATE_PAIRS=1 $(PY) -m pytest -q tests/test_version.py

clean:
	rm -rf $(VENV) .venv-tf build dist *.egg-info .pytest_cache
