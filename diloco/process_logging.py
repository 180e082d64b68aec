"""Every process of a job logs the same way: time, level, logger name, message."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_process_logging(level: int = logging.INFO) -> None:
    """Configure the process's root logger, unless its entry point (hydra, a test) already did."""
    logging.basicConfig(level=level, format=LOG_FORMAT)


def output_to(log_path: Path) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2) to the end of ``log_path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
