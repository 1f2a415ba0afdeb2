"""2-rank training where rank 1 dies (os._exit) at step 3; run under the deepspeed launcher.

The argument (a file path) receives the time of the death, so the test can tell the job's start-up from its
tear-down."""
import os
import sys
import time

import torch

import titan_ds
from tests.helpers.equal_run import TINY, ds_config
from titan_ds.models import GPT

death_file = next(a for a in sys.argv[1:] if not a.startswith("--"))  # the launcher adds --local_rank=N
torch.manual_seed(0)
model = GPT(TINY)
engine, *_ = titan_ds.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                 config=ds_config(2, {}))
x = torch.randint(0, 256, (4, TINY.block_size))
for step in range(1000):
    if step == 3 and engine.global_rank == 1:
        with open(death_file, "w") as f:
            f.write(repr(time.time()))
        os._exit(17)  # the fault: this rank vanishes without a word
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
print("SURVIVOR FINISHED", file=sys.stderr)  # must never be reached on rank 0
