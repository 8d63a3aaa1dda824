# Two commands do all set-up on a fresh machine:
#   make run    -- create .venv if missing, install, run the main job
#   make test   -- create .venv if missing, install, run the whole test suite
# torch is pinned here (the CPU wheel on the machine); the package metadata keeps a range.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: run test lint format bench clean image-files docs

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_PIN)" -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/steadytrain train --run-dir runs/default-$$(date +%Y%m%d-%H%M%S)
	@echo "the steadytrain command is in $(BIN): run \`. $(BIN)/activate\` or call $(BIN)/steadytrain"

# Two pytest-xdist workers (the CI machine has 2 cores); tests that start ranks of their own share one worker
# (tests/conftest.py groups them), so two 2-rank jobs never share the cores.
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadgroup

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	$(BIN)/pip install --quiet "$(TORCH_PIN)" -e '.[dev,bench]'
	$(BIN)/python bench/clip.py
	$(BIN)/python bench/clip_step.py
	$(BIN)/python bench/ddp_sync.py
	$(BIN)/python bench/loop.py
	$(BIN)/python bench/env_capture.py

# docs/reference/*.md, generated from the config models and the click commands (tests/test_docs.py checks them).
docs: $(STAMP)
	$(BIN)/python -m steadytrain.cli.docgen docs/reference

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache

# The project's own CPU image, produced by steadytrain itself (no Docker engine is needed to generate them).
image-files: $(STAMP)
	$(BIN)/steadytrain env lock --for steadytrain -o requirements.lock
	$(BIN)/steadytrain env dockerfile --base python:3.11.7-slim-bookworm \
		--tag "$$($(BIN)/steadytrain env tag --name steadytrain --version 0.1.0)" -o Dockerfile
