"""Whether the job's lighthouse still answers.

A lighthouse that hangs (SIGSTOP, a deadlock) looks alive to ``poll()`` while every group's
request waits out its timeout; a group's other workers then time out in their collectives and
the group crashes, again after each restart. So the launcher asks the lighthouse for
``/alive`` (its pid) in the background, and the supervisor replaces one that stayed silent for
``cluster.timeouts.lighthouse`` seconds, as it replaces a dead one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from diloco.launch.local_cluster import serving_pid

ASK_EVERY_S = 0.5


class LighthouseWatch:
    """Asks ``url`` for /alive every ``ASK_EVERY_S`` in a daemon thread. Silence is counted from
    the first question left unanswered, not from the last answer: a launcher that was itself
    stopped for a while (SIGSTOP, a suspended laptop) asked nothing meanwhile and blames no one.
    ``clock`` (seconds) times the silence; a test moves its own by hand."""

    def __init__(self, url: str, limit_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self.limit_s = limit_s
        self._clock = clock
        self._answered_by: int | None = None  # the pid that answered the last question answered
        self._unanswered_since: float | None = None  # the first question unanswered since then
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
        """How long the lighthouse ``pid`` has left questions unanswered, once that is more than
        the limit (a ``pid`` that never answered: counted from the first question about it); else None."""
        now = self._clock()
        with self._lock:
            since = self._watched_since.setdefault(pid, now)
            if self._unanswered_since is None and self._answered_by == pid:
                return None
            if self._unanswered_since is not None:
                since = max(since, self._unanswered_since)
        return now - since if now - since > self.limit_s else None

    def heard_from(self, pid: int) -> None:
        """The lighthouse ``pid`` answered just now."""
        with self._lock:
            self._answered_by, self._unanswered_since = pid, None

    def unanswered(self) -> None:
        """A question went unanswered (refused, reset, or no answer within a second)."""
        with self._lock:
            if self._unanswered_since is None:
                self._unanswered_since = self._clock()

    def _ask_forever(self) -> None:
        while not self._stop.is_set():
            pid = serving_pid(self.url)  # at most 1 s: an answer slower than that counts as silence
            if pid is None:
                self.unanswered()
            else:
                self.heard_from(pid)
            self._stop.wait(ASK_EVERY_S)
