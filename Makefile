# Two commands do all the set-up on a fresh machine:
#   make demo   - run the main example (a 2-rank MoE model, serial vs dbo.overlap)
#   make test   - lint, type-check and run the whole test suite
#
# Both create a virtual environment in $(VENV) if there is none and install the project
# with its test extras, at the exact versions in constraints.txt (the same on every
# machine; `make upgrade-pins` moves them, only after every check passes). Torch:
#   - default: the version constraints.txt pins (a CPU build on the project's machines);
#   - your own torch (e.g. a CUDA build): reuse an environment that already has it with
#     `make test VENV=/path/to/env`, or let a new venv see the system one with
#     `make test VENV_ARGS=--system-site-packages`; torch is only installed when the
#     environment cannot import it, and the torch found is kept (it must be in dbo's
#     supported range, pyproject.toml). TORCH_SPEC / TORCH_PIP_ARGS pick another build.

PYTHON ?= python3
VENV ?= .venv
VENV_ARGS ?=
CONSTRAINTS := constraints.txt
TORCH_SPEC ?= $(shell grep "^torch==" $(CONSTRAINTS))
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.dbo-installed

.PHONY: demo demo-hf demo-generate demo-train demo-train-fsdp demo-workspace test lint typecheck pytest bench \
	upgrade-pins clean

# Each install step prints one line; pip's own output is shown only when a step fails.
QUIET_PIP = $(BIN)/python -m pip install --disable-pip-version-check -q

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(BIN)/python || { echo "creating $(VENV)"; $(PYTHON) -m venv $(VENV_ARGS) $(VENV); }
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "using the torch already in $(VENV): $$($(BIN)/python -c 'import torch; print(torch.__version__)')"; \
	else \
		echo "installing $(TORCH_SPEC)"; \
		$(QUIET_PIP) $(TORCH_PIP_ARGS) "$(TORCH_SPEC)" > $(VENV)/pip.log 2>&1 \
			|| { cat $(VENV)/pip.log; exit 1; }; \
	fi
	@echo "installing dbo with its test extras (pytest, ruff, mypy, hypothesis, matplotlib, transformers) at the pinned versions"
	@sed "s/^torch==.*/torch==$$($(BIN)/python -c 'import torch; print(torch.__version__.split("+")[0])')/" \
		$(CONSTRAINTS) > $(VENV)/constraints.txt  # the torch found is kept
	@$(QUIET_PIP) -c $(VENV)/constraints.txt -e ".[test]" > $(VENV)/pip.log 2>&1 \
		|| { cat $(VENV)/pip.log; exit 1; }
	@touch $@

demo: $(STAMP)
	$(BIN)/python examples/moe_overlap.py --spawn 2

demo-hf: $(STAMP)
	$(BIN)/python examples/hf_moe.py --spawn 2

demo-generate: $(STAMP)
	$(BIN)/python examples/generate.py --spawn 2

demo-train: $(STAMP)
	$(BIN)/python examples/train_moe.py --spawn 2

demo-train-fsdp: $(STAMP)
	$(BIN)/python examples/train_fsdp.py --spawn 2

demo-workspace: $(STAMP)
	$(BIN)/python examples/workspace_demo.py

lint: $(STAMP)
	$(BIN)/ruff check dbo workspace comm examples tests benchmarks tools

typecheck: $(STAMP)
	$(BIN)/mypy dbo workspace comm

pytest: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

# Newest releases of everything in constraints.txt (torch stays unless TORCH_SPEC names
# another), in a venv of their own; every check (lint, types, tests, the transformers
# families survey) must pass before constraints.txt and the tested ranges are rewritten.
upgrade-pins:
	$(PYTHON) tools/upgrade_pins.py $(if $(filter command line,$(origin TORCH_SPEC)),--torch "$(TORCH_SPEC)")

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
