# The README's two commands: `make demo` (the recommended profile, titan_memory, beside plain DeepSpeed on the
# reference GPT) and `make test` (the test suite).
# Both bootstrap .venv on a fresh machine: torch==2.13.0 first (the CPU wheel; never let pip resolve plain
# `torch`, which pulls a multi-GB CUDA build), then this package with its test extras.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STEPS  ?= 300
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
export TITAN_CACHE := $(CURDIR)/.cache
export OMP_NUM_THREADS ?= 2

# DeepSpeed JIT-builds its CPU shared-memory all-reduce op on the first init_distributed (2-15 min on 2 cores):
# build it once here, where nothing times it out, rather than inside the first test or demo step.
SHM_OP := $(TORCH_EXTENSIONS_DIR)/deepspeed_shm_comm/deepspeed_shm_comm.so
# titan's own CPU op (the optimizer core's kernel, titan_ds/optim/csrc/core_cpu.cpp; ~35 s): built here too. Where it
# cannot build, titan warns and steps with the eager loop (same results), so a failed build does not stop make.
# Its folder is named by this CPU's flags (core_cpu.build_name), so the rule runs every time (a built op loads in
# seconds) and a shared cache gets one build per CPU.
CORE_OP := core-op

.PHONY: demo demo2 test test-heavy test-fast report bench-baseline clean clean-shm core-op

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

$(SHM_OP): $(VENV)/.installed
	rm -f $(TORCH_EXTENSIONS_DIR)/deepspeed_shm_comm/lock  # left by a build that was killed; loads would wait on it
	$(PY) -c "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('ShareMemCommBuilder').load()"

$(CORE_OP): $(VENV)/.installed
	-$(PY) -c "from titan_ds.optim import core_cpu; core_cpu.available()"

# Free /dev/shm files that earlier DeepSpeed CPU runs leaked (only ones no live process uses).
clean-shm: $(VENV)/.installed
	$(VENV)/bin/titan-ds clean-shm

demo: $(SHM_OP) $(CORE_OP)
	$(PY) launch/demo.py --steps $(STEPS) --out results/tmp/demo

demo2: $(SHM_OP)
	$(VENV)/bin/deepspeed --num_gpus 2 launch/train.py --deepspeed_config launch/experiments/configs/titan_full.json \
	  --steps $(STEPS) --val-batches 16 --summary-out results/demo2/summary.json --plot results/demo2/demo.png

# Two pytest workers (pytest-xdist), one thread each: the 2-core CI machine runs the tiers in ~half the time.
# `make test` is what CI runs (its budget: 25 min on a clean clone); `make test-heavy` runs the long reliability,
# compile and benchmark-resume tests (~15 min more: kill -9 at random points, the soak, the gloo exit race,
# Triton compiles, DeepSpeed's NVMe swapper bug, a ZeRO-Infinity trial), run before a release and by every session before it stops.
XDIST := -n 2
test: $(SHM_OP) $(CORE_OP) clean-shm
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow" tests $(XDIST) --durations=10
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "slow and not heavy" tests $(XDIST) --durations=25

test-heavy: $(SHM_OP) $(CORE_OP) clean-shm
	$(PY) -m pytest -q -m heavy tests --durations=25

test-fast: $(SHM_OP) $(CORE_OP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow" tests $(XDIST) --durations=10

report: $(VENV)/.installed
	$(VENV)/bin/titan-ds report

bench-baseline: $(VENV)/.installed
	$(PY) launch/bench/compare.py --steps 300 --out results/baseline ds_configs/baseline_adamw.json

clean:
	rm -rf $(VENV) .cache results/tmp
