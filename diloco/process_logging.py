"""Every process of a job logs the same way: time, level, logger name, message."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_process_logging(level: int = logging.INFO) -> None:
    """Configure the process's root logger, unless its entry point (hydra, a test) already did."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
