# The README's two commands: `make demo` (train the reference GPT) and `make test` (the test suite).
# Both bootstrap .venv on a fresh machine: torch==2.13.0 first (the CPU wheel; never let pip resolve plain
# `torch`, which pulls a multi-GB CUDA build), then this package with its test extras.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STEPS  ?= 300
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
export TITAN_CACHE := $(CURDIR)/.cache
export OMP_NUM_THREADS ?= 2

.PHONY: demo demo2 test test-fast report bench-baseline clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/deepspeed --num_gpus 1 launch/train.py --deepspeed_config ds_configs/demo.json \
	  --steps $(STEPS) --val-every 100 --val-batches 16 --metrics-out results/demo/metrics.jsonl \
	  --summary-out results/demo/summary.json --plot results/demo/demo.png --save-dir results/demo/checkpoints \
	  --save-every 100

demo2: $(VENV)/.installed
	$(VENV)/bin/deepspeed --num_gpus 2 launch/train.py --deepspeed_config ds_configs/titan_full.json \
	  --steps $(STEPS) --val-batches 16 --summary-out results/demo2/summary.json --plot results/demo2/demo.png

test: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" tests
	$(PY) -m pytest -q -m slow tests

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow" tests

report: $(VENV)/.installed
	$(VENV)/bin/titan-ds report

bench-baseline: $(VENV)/.installed
	$(PY) launch/bench/compare.py --steps 300 --out results/baseline ds_configs/baseline_adamw.json

clean:
	rm -rf $(VENV) .cache results/tmp
