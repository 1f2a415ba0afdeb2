"""Small process helpers shared by the trainer, launch scripts and tests."""
from __future__ import annotations

import logging
import os
import socket

__all__ = ["ensure_dist_env", "free_port", "rank", "get_logger"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_dist_env() -> None:
    """Outside the ``deepspeed`` launcher, describe a one-process world so deepspeed.initialize does not try MPI
    discovery. Inside the launcher the variables are already set and nothing changes."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})


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
