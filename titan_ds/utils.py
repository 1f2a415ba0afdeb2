"""Small process helpers shared by the trainer, launch scripts and tests."""
from __future__ import annotations

import atexit
import logging
import os
import socket
import time

__all__ = ["ensure_dist_env", "free_port", "rank", "get_logger", "release_deepspeed_shm",
           "stale_deepspeed_shm", "guard_interpreter_exit", "after_init_distributed"]


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A free TCP port for a rendezvous, chosen at random *below* the kernel's ephemeral range. A port handed out
    by ``bind(0)`` comes from that range, so any outgoing connection made before the store listens can take it
    (CI failed once that way: EADDRINUSE in ``TCPStore``); ports outside it are only taken by explicit binds."""
    import random
    lo, _ = _ephemeral_range()
    low, high = (20000, lo) if lo > 21000 else (1024, lo)
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every probe was taken: fall back on the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_dist_env() -> None:
    """Outside the ``deepspeed`` launcher, describe a one-process world so deepspeed.initialize does not try MPI
    discovery. Inside the launcher the variables are already set and nothing changes."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})


SHM_DIR = "/dev/shm"
GLOO_SETTLE_S = 0.25  # how long, at exit, gloo's worker threads get the GIL to drop their last collectives

_exit_guarded = False


def _gloo_worker_threads() -> int:
    """How many of this process's threads are gloo's (``pt_gloo_runloop``); -1 where /proc cannot say."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return -1
    n = 0
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().startswith("pt_gloo")
        except OSError:  # the thread ended meanwhile
            continue
    return n


def _settle_gloo_workers(settle_s: float = GLOO_SETTLE_S) -> bool:
    """The atexit half of :func:`guard_interpreter_exit`: sleep (GIL released) where gloo threads exist."""
    if settle_s <= 0 or _gloo_worker_threads() == 0:
        return False
    time.sleep(settle_s)
    return True


def guard_interpreter_exit() -> bool:
    """Keep a CPU (gloo) job from aborting with SIGABRT as the interpreter exits.

    torch 2.13's ``ProcessGroupGloo`` runs each collective on a worker thread (``pt_gloo_runloop``). It signals
    the caller *before* it drops its own reference to the work. When the caller has already let go of the
    result, the worker's drop is the last one: it destroys the work's tensors and, for a tensor whose Python
    object was kept alive (one with attributes, as DeepSpeed's parameters and flat buffers have), it must take
    the GIL to free it. If the main thread reaches interpreter finalization first (a script that ends right
    after its last collective), CPython 3.11 ends any thread that asks for the GIL with ``pthread_exit``; the
    unwind passes a ``noexcept`` destructor and libstdc++ calls ``std::terminate``: "terminate called without
    an active exception", exit code 134, after the job finished. Seen in 3 of 22 runs of a 2-rank DeepSpeed job
    here, and in 8 of 30 of a plain ``torch.distributed`` one (no DeepSpeed); gdb shows the worker in
    ``AsyncAllgatherWork::~AsyncAllgatherWork`` -> ``decref`` -> ``take_gil`` -> ``PyThread_exit_thread``.

    The guard registers an atexit handler, which runs while the interpreter is still whole: where the process
    has gloo worker threads it sleeps ``GLOO_SETTLE_S`` with the GIL released, so a worker waiting for the GIL
    takes it and finishes. It does not destroy process groups (a user's own atexit handlers may still use
    them) and never blocks on a peer, so a rank that fails still exits at once. Idempotent; returns whether it
    registered the handler now.
    """
    global _exit_guarded
    if _exit_guarded:
        return False
    atexit.register(_settle_gloo_workers)
    _exit_guarded = True
    return True


def after_init_distributed() -> None:
    """What every process does once ``deepspeed.init_distributed`` has run: unlink DeepSpeed's leaked shm
    file (:func:`release_deepspeed_shm`) and guard the interpreter's exit (:func:`guard_interpreter_exit`)."""
    guard_interpreter_exit()
    release_deepspeed_shm()


def release_deepspeed_shm() -> bool:
    """Unlink the shared-memory file DeepSpeed 0.19.8 leaks on every CPU process.

    ``deepspeed.init_distributed`` on the CPU accelerator runs ``shm_initialize``
    (``ops/csrc/cpu/comm/shm.cpp``): each rank creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``
    (66 MB), maps its peers' files, and never unlinks its own (``shared_close`` is never called). The files
    outlive the process, so every run, even a killed one, leaves 66 MB per rank in RAM until reboot; a few
    hundred runs fill a 24 GB machine. Once every rank has mapped its peers (the barrier), the names are no
    longer needed: unlinking this rank's own name frees it when the last mapping goes, at process exit or kill.

    Call on every rank after ``deepspeed.init_distributed`` (``titan_ds.initialize`` does). Returns whether a
    file was unlinked; a second call, or a world without the shm all-reduce, does nothing.
    """
    import deepspeed.comm as dist

    if not dist.is_initialized():
        return False
    me = dist.get_rank()
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    path = os.path.join(SHM_DIR, f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{me}")
    if not os.path.exists(path):  # same answer on every rank: they all create theirs in init_distributed
        return False
    if dist.get_world_size() > 1:
        dist.barrier()  # every peer has mapped this rank's buffer before its name goes
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _paths_in_use() -> set[str]:
    """Every file some live process maps or holds open (what /proc shows this user)."""
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                used.update(line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and "/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                used.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except (OSError, IndexError):  # the process ended, or is another user's
            continue
    return {u.removesuffix(" (deleted)") for u in used}


def stale_deepspeed_shm(remove: bool = False) -> list[str]:
    """This user's ``deepspeed_allreduce_buffer_*`` files in /dev/shm that no live process maps or holds open:
    the leak of earlier runs (see :func:`release_deepspeed_shm`). With ``remove`` they are unlinked. A file a
    running job still uses is never listed."""
    if not os.path.isdir(SHM_DIR):
        return []
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_"
    names = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    if not names:
        return []
    used = _paths_in_use()
    stale = [os.path.join(SHM_DIR, n) for n in names if os.path.join(SHM_DIR, n) not in used]
    if remove:
        unlink_quietly(stale)
    return stale


def unlink_quietly(paths: list[str]) -> None:
    """Unlink each path; one already gone (another cleaner, the job's own exit) is not an error."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = rank()
        return True


def get_logger(name: str = "titan_ds") -> logging.Logger:
    """The package logger; messages carry ``[rank N]``. Library code logs, never prints."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        logger.addFilter(_RankFilter())
    return logger
