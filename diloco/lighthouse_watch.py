"""Whether the job's lighthouse still answers.

A lighthouse that hangs (SIGSTOP, a deadlock) looks alive to ``poll()`` while every group's
request waits out its timeout; a group's other workers then time out in their collectives and
the group crashes, again after each restart. So the launcher asks the lighthouse for
``/status`` in the background, and the supervisor replaces one that stayed silent for
``cluster.timeouts.lighthouse`` seconds, as it replaces a dead one.
"""

from __future__ import annotations

import threading
import time

from diloco.local_cluster import serving_pid

ASK_EVERY_S = 0.5


class LighthouseWatch:
    """Asks ``url`` for /status every ``ASK_EVERY_S`` in a daemon thread and remembers, for each
    pid that answered, when it last did."""

    def __init__(self, url: str, limit_s: float) -> None:
        self.url = url
        self.limit_s = limit_s
        self._answered: dict[int, float] = {}  # pid -> monotonic time of its last answer
        self._watched_since: dict[int, float] = {}  # pid -> when the supervisor first asked about it
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._ask_forever, name="lighthouse-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started (a job without a lighthouse never starts it)
            self._thread.join(timeout=5.0)

    def hung_for(self, pid: int) -> float | None:
        """How long the lighthouse ``pid`` has been silent, once that is more than the limit
        (counted from the first question about ``pid`` if it never answered); else None."""
        now = time.monotonic()
        with self._lock:
            since = self._watched_since.setdefault(pid, now)
            silent = now - max(since, self._answered.get(pid, since))
        return silent if silent > self.limit_s else None

    def heard_from(self, pid: int) -> None:
        """The lighthouse ``pid`` answered just now."""
        with self._lock:
            self._answered[pid] = time.monotonic()

    def _ask_forever(self) -> None:
        while not self._stop.is_set():
            pid = serving_pid(self.url)  # at most 1 s: an answer slower than that counts as silence
            if pid is not None:
                self.heard_from(pid)
            self._stop.wait(ASK_EVERY_S)
