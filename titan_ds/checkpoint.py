"""Crash-safe checkpoints on top of DeepSpeed's ``save_checkpoint``/``load_checkpoint``.

DeepSpeed 0.19.8 writes ``latest`` with a plain ``open(..., 'w')`` after the shards, and never checks what it
loads. titan_ds adds, for engines built by ``titan_ds.initialize``:

1. a manifest ``<tag>/titan_manifest.json`` (size and SHA-256 of every file of the tag), written atomically by
   rank 0 after all ranks finished writing: a tag without a manifest is incomplete and is never loaded;
2. ``latest`` replaced atomically (write to a temp file, fsync, rename, fsync the folder) only after the
   manifest exists, so a process killed at any point leaves ``latest`` on the last complete checkpoint;
3. verification before loading: a missing, truncated or corrupted file raises :class:`CheckpointCorruptError`
   naming the file and the remedy; nothing is loaded;
4. a save that fails on any rank (disk full, I/O error) fails on every rank with :class:`CheckpointSaveError`,
   which names the folder, the free space and the cause; the partial tag is removed, ``latest`` and every earlier
   checkpoint are untouched, and the engine's state in memory is unchanged (training can go on, or save elsewhere).

:func:`save_tag` and :func:`load_tag` are that protocol around DeepSpeed's own calls; ``titan_ds.engine`` wraps
the engine's ``save_checkpoint``/``load_checkpoint`` with them, once. Pillars' save/load callbacks
(:mod:`titan_ds.lifecycle`) run inside it: on save after DeepSpeed wrote the tag on every rank and before the
manifest, so their files are covered by it and their failure is a failed save; on load after DeepSpeed read the tag.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

__all__ = ["CheckpointCorruptError", "CheckpointSaveError", "write_manifest", "verify_tag", "atomic_write_text",
           "complete_tags", "save_failure_message", "remove_partial_tag", "save_tag", "load_tag", "MANIFEST"]

MANIFEST = "titan_manifest.json"
_CHUNK = 8 * 2**20


class CheckpointCorruptError(RuntimeError):
    """A checkpoint that must not be loaded: incomplete, truncated or corrupted."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (on this rank or another); the previous checkpoints are intact."""


log = logging.getLogger("titan_ds")

_FULL_BELOW = 16 * 2**20  # a failed write with less free than this on the filesystem: call it full


def _is_enospc(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _free_bytes(path: Path) -> Optional[int]:
    for p in (Path(path), *Path(path).parents):
        if p.exists():
            return shutil.disk_usage(p).free
    return None


def save_failure_message(save_dir: Path, tag: str, exc: Optional[BaseException], failed_ranks: list[int],
                         removed: bool) -> str:
    """What a failed save tells the user: where, why (disk full or the error), what is intact, what to do."""
    save_dir = Path(save_dir)
    free = _free_bytes(save_dir)
    full = (exc is not None and _is_enospc(exc)) or (free is not None and free < _FULL_BELOW)
    latest = read_latest(save_dir)
    where = f"checkpoint {tag!r} could not be written to {str(save_dir)!r}"
    who = f" (failed on rank{'s' if len(failed_ranks) > 1 else ''} {', '.join(map(str, failed_ranks))})"
    if full:
        why = f": the filesystem is full ({(free or 0) / 2**20:.1f} MiB free)"
        fix = "free space there or pass another save folder, then save again"
    else:
        why = f": {type(exc).__name__}: {exc}" if exc is not None else " (another rank's write failed)"
        fix = "check the folder is writable and healthy, then save again"
    intact = (f"`latest` still names {latest!r}, which is intact" if latest else "no earlier checkpoint exists there")
    partial = ("the partial tag was removed" if removed else
               "the partial tag has no valid manifest and is never loaded")
    return (f"{where}{who}{why}. Nothing was lost: {intact}; {partial}; the training state in memory is "
            f"unchanged. To fix: {fix}.")


def remove_partial_tag(tag_dir: Path) -> bool:
    """Delete the tag folder a failed save created (call it only for a folder that did not exist before the save:
    an earlier save of the same tag is left alone, and its manifest no longer matches, so it is never loaded)."""
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        return False
    shutil.rmtree(tag_dir, ignore_errors=True)
    return not tag_dir.exists()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` so that a reader sees either the old or the new content, never a torn file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_manifest(tag_dir: Path) -> dict:
    tag_dir = Path(tag_dir)
    files = {}
    for p in sorted(tag_dir.rglob("*")):
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(f".{MANIFEST}"):
            with open(p, "rb") as f:
                os.fsync(f.fileno())
            files[p.relative_to(tag_dir).as_posix()] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    manifest = {"version": 1, "files": files}
    atomic_write_text(tag_dir / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def verify_tag(load_dir: Path, tag: str) -> None:
    """Raise :class:`CheckpointCorruptError` unless every file of ``tag`` matches its manifest."""
    tag_dir = Path(load_dir) / tag
    others = [t for t in complete_tags(load_dir) if t != tag]
    remedy = (f"resume from an earlier complete checkpoint (tag= one of {others})" if others else
              "no other complete checkpoint exists in this folder; start without --load-dir")
    mpath = tag_dir / MANIFEST
    if not mpath.is_file():
        raise CheckpointCorruptError(f"checkpoint {str(tag_dir)!r} has no {MANIFEST}: its save did not complete "
                                     f"(killed or out of disk). Not loading it; {remedy}.")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointCorruptError(f"{str(mpath)!r} is unreadable ({e}); {remedy}.") from None
    for rel, meta in manifest["files"].items():
        p = tag_dir / rel
        if not p.is_file():
            raise CheckpointCorruptError(f"checkpoint file {str(p)!r} is missing; {remedy}.")
        if p.stat().st_size != meta["bytes"]:
            raise CheckpointCorruptError(f"checkpoint file {str(p)!r} is truncated or grown: {p.stat().st_size} "
                                         f"bytes, manifest says {meta['bytes']}; {remedy}.")
        if _sha256(p) != meta["sha256"]:
            raise CheckpointCorruptError(f"checkpoint file {str(p)!r} fails its SHA-256 check (corrupted on disk); "
                                         f"{remedy}.")


def complete_tags(load_dir: Path) -> list[str]:
    d = Path(load_dir)
    if not d.is_dir():
        return []
    return sorted((p.name for p in d.iterdir() if (p / MANIFEST).is_file()), key=lambda t: (p_mtime(d / t), t))


def p_mtime(p: Path) -> float:
    return (p / MANIFEST).stat().st_mtime


def read_latest(load_dir: Path) -> Optional[str]:
    f = Path(load_dir) / "latest"
    return f.read_text().strip() if f.is_file() else None


def _ranks_where(flag: bool, device: Any = "cpu") -> list[int]:
    """The global ranks on which ``flag`` holds (a collective: every rank must call it). ``device`` is the
    engine's: NCCL reduces only device tensors."""
    import deepspeed.comm as dist
    import torch
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [0] if flag else []
    flags = torch.zeros(dist.get_world_size(), device=device)
    flags[dist.get_rank()] = float(flag)
    dist.all_reduce(flags)
    return [i for i, f in enumerate(flags.tolist()) if f]


def _attempt(fn: Callable[[], Any]) -> Optional[BaseException]:
    try:
        fn()
    except Exception as e:  # disk full, I/O error: the ranks agree on it before anyone raises
        return e
    return None


def save_tag(engine: Any, save: Callable[..., Any], save_dir: str, tag: str, client_state: dict, save_latest: bool,
             after_write: Callable[[str, str], None], **kw: Any) -> Any:
    """Crash-safe ``save(save_dir, tag=tag, client_state=client_state, save_latest=False, **kw)`` (DeepSpeed's).

    1. DeepSpeed writes the shards; a rank that failed joins DeepSpeed's closing barrier, then all ranks agree.
    2. ``after_write(save_dir, tag)`` (the pillars' save callbacks) on every rank; the ranks agree again.
    3. Rank 0 writes the manifest and, with ``save_latest``, replaces ``latest`` atomically; the ranks agree.
    A failure at any point on any rank removes a tag folder the save created and raises CheckpointSaveError on
    every rank.
    """
    import deepspeed.comm as dist
    tag_dir = Path(save_dir) / str(tag)
    existed = tag_dir.exists()
    out: list[Any] = [None]

    def write() -> None:
        out[0] = save(save_dir, tag=tag, client_state=client_state, save_latest=False, **kw)

    err = _attempt(write)
    if err is not None:
        dist.barrier()  # the ranks that did not fail wait in DeepSpeed's closing barrier
    failed = _ranks_where(err is not None, engine.device)  # every rank has finished writing past here
    if not failed:
        err = _attempt(lambda: after_write(str(save_dir), str(tag)))
        failed = _ranks_where(err is not None, engine.device)
    if not failed:
        if engine.global_rank == 0:
            err = _attempt(lambda: _commit(Path(save_dir), tag_dir, str(tag), save_latest))
        failed = _ranks_where(err is not None, engine.device)
    if failed:
        removed = False
        if engine.global_rank == 0 and not existed:
            removed = remove_partial_tag(tag_dir)
        dist.barrier()
        msg = save_failure_message(Path(save_dir), str(tag), err, failed, removed)
        log.error("titan: %s", msg)
        raise CheckpointSaveError(msg) from err
    return out[0]


def _commit(save_dir: Path, tag_dir: Path, tag: str, save_latest: bool) -> None:
    write_manifest(tag_dir)
    if save_latest:
        atomic_write_text(save_dir / "latest", tag)


def load_tag(load: Callable[..., Any], load_dir: str, tag: Optional[str],
             after_read: Callable[[str, str, Mapping[str, Any]], None], restore_state: Callable[[dict], None],
             **kw: Any) -> tuple[Any, Any]:
    """Verify ``tag`` (default: ``latest``) against its manifest, then ``load(load_dir, tag=tag, **kw)``
    (DeepSpeed's), then ``after_read(load_dir, tag, kw)`` (the pillars' load callbacks), then
    ``restore_state(client_state["titan"])``. Nothing to load: ``(None, None)``."""
    tag = tag or read_latest(load_dir)
    if tag is None:
        return None, None
    verify_tag(Path(load_dir), str(tag))
    path, client = load(load_dir, tag=tag, **kw)
    if path is not None:
        after_read(str(load_dir), str(tag), kw)
        restore_state((client or {}).get("titan", {}))
    return path, client
