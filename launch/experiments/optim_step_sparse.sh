#!/usr/bin/env bash
# Answered: ASDT's sparse step before and after the chunked core; the tables: results/optim_step_sparse/.
# ASDT's sparse step before (the flat path: main at c5ab55e, with this branch's launch/bench/optim_step.py for the
# two density-0.1 8-bit rows) and after (this branch: sparse.py over core.py's chunks), 2^24 fp32 elements, 1 thread.
# Run from the worktree root, under the timed-run lock:
#   flock /tmp/titan_timed.lock nice -n 10 bash launch/experiments/optim_step_sparse.sh
# BEFORE: a checkout of c5ab55e (git clone --shared /work/main /tmp/strat-before; git -C /tmp/strat-before checkout
# c5ab55e; cp launch/bench/optim_step.py /tmp/strat-before/launch/bench/).
set -euo pipefail
HERE=$(pwd)
BEFORE=${BEFORE:-/tmp/strat-before}
ROWS=asdt_sign_8bit_d0.1,asdt_adaptive_8bit_d0.1,asdt_sign_bf16_d0.1
COMMON=(--sizes 16777216 --dtypes fp32 --rows "$ROWS")
export OMP_NUM_THREADS=1
for side in before after; do
  dir=$([ "$side" = before ] && echo "$BEFORE" || echo "$HERE")
  (cd "$dir" && PYTHONPATH="$dir" "$HERE/.venv/bin/python" launch/bench/optim_step.py "${COMMON[@]}" --what temp \
     --out "$HERE/results/optim_step_sparse/$side")
  (cd "$dir" && PYTHONPATH="$dir" "$HERE/.venv/bin/python" launch/bench/optim_step.py "${COMMON[@]}" --what speed \
     --repeats 1 --steps 3 --warmup 1 --out "$HERE/results/optim_step_sparse/$side")
done
