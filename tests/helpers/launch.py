"""Run a script under the ``deepspeed`` launcher with N CPU ranks (for multi-rank tests)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from titan_ds.utils import free_port

ROOT = Path(__file__).resolve().parents[2]


DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")


def clean_env() -> dict:
    """This process's environment without the one-process world the test session set up (a child must not
    rendezvous on the port the parent's process group holds)."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    # one intra-op thread: the tests compare runs bit for bit, and multithreaded CPU reductions do not always sum
    # in the same order (fresh-clone CIs saw two identical runs differ in the 7th digit at step 2, before any
    # checkpoint: tests/test_compose.py's titan_balanced resume at ZeRO-3, launch/train.py's resume test)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run(cmd, *, timeout: float, check: bool = False, capture_output: bool = False, text: bool = False,
        **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` that, on timeout, kills the child's whole process group (the launcher's ranks, a
    JIT build's ninja and compilers), not only the child: an orphaned build keeps its lock file and every later
    load of that op would wait on it forever."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with subprocess.Popen(cmd, start_new_session=True, text=text, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    r = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check:
        r.check_returncode()
    return r


PORT_TAKEN = ("EADDRINUSE", "Address already in use", "address already in use")


def port_was_taken(p: subprocess.CompletedProcess) -> bool:
    """The run failed because its rendezvous port was bound by someone else between ``free_port``'s probe and
    the store's bind (a race with the other xdist worker's launches; seen once in CI)."""
    return p.returncode != 0 and any(m in (p.stdout or "") + (p.stderr or "") for m in PORT_TAKEN)


def run_on_free_port(build, *, attempts: int = 3, **kwargs) -> subprocess.CompletedProcess:
    """``run(build(port), **kwargs)`` on a fresh ``free_port()``, again on a new port (at most ``attempts`` times)
    when the rendezvous lost its port to another process; any other failure is returned at once."""
    for _ in range(attempts):
        p = run(build(free_port()), capture_output=True, text=True, **kwargs)
        if not port_was_taken(p):
            return p
    return p


def run_deepspeed(script: str | Path, *args: str, num_ranks: int = 2, timeout: float = 600) -> subprocess.CompletedProcess:
    ds = Path(sys.executable).with_name("deepspeed")
    return run_on_free_port(lambda port: [str(ds), "--num_gpus", str(num_ranks), "--master_port", str(port),
                                          str(script), *args], cwd=ROOT, env=clean_env(), timeout=timeout)
