# Every target that runs Python installs .venv/ first (once).
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install test demo bench lessons clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: the CPU build (a plain "torch" from PyPI would pull a multi-GB CUDA build)
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: install
	$(PY) -m minisgl demo

bench: install
	$(PY) -m minisgl bench --compare-loops

clean:
	rm -rf $(VENV) build *.egg-info
