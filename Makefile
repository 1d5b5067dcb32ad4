# The README's two commands: `make example` and `make test`. Each sets up everything it needs
# (a virtual environment in .venv with tightfit installed editable) on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
EXAMPLE := python/tightfit/examples/convnet_dynamic.onnx

.PHONY: example test bench clean

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch builds the zoo's PyTorch-exported models in tests; 2.13.0 is a CPU build.
	$(BIN)/pip install --quiet -e '.[test]' 'torch==2.13.0' onnxscript
	touch $@

example: $(INSTALLED)
	$(BIN)/tightfit compile $(EXAMPLE) -o out/convnet_dynamic.tfpkg
	$(BIN)/tightfit run out/convnet_dynamic.tfpkg --reference $(EXAMPLE) --shape image=1,3,96,96 --check
	$(BIN)/tightfit run out/convnet_dynamic.tfpkg --reference $(EXAMPLE) --shape image=4,3,160,128 --check

# one pytest worker per CPU: most tests compile a model, which keeps one core busy
test: $(INSTALLED)
	$(BIN)/python -m pytest -q -n logical --dist loadgroup

bench: $(INSTALLED)
	$(BIN)/tightfit bench --zoo --out bench/results

clean:
	rm -rf $(VENV) out
