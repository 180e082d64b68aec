"""A token bucket that paces a worker's outer-round traffic to a link's bandwidth.

``cluster.lane_bandwidth_mbps`` caps what each worker sends over its lanes: a transfer of n
bytes may complete only once the bucket has had the tokens for them, so on loopback the job
behaves as over a slower link (and on a real one it stays polite to others sharing it). A
bucket holds at most ``burst_s`` worth of tokens, so an idle link does not save up for a
burst longer than that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class TokenBucket:
    """Tokens are bytes; ``rate_bytes_s`` of them arrive per second, up to ``burst_s`` seconds' worth."""

    def __init__(self, rate_bytes_s: float, burst_s: float = 0.05, clock: Callable[[], float] = time.monotonic):
        if rate_bytes_s <= 0 or burst_s < 0:
            raise ValueError(f"need a positive rate and a non-negative burst, got {rate_bytes_s}, {burst_s}")
        self.rate_bytes_s = rate_bytes_s
        self.capacity = rate_bytes_s * burst_s
        self._clock = clock
        self._tokens = self.capacity
        self._at = clock()
        self._lock = threading.Lock()  # an outer round's background thread and the training thread share it

    def reserve(self, nbytes: int) -> float:
        """Take ``nbytes`` of tokens (going into debt if need be); the clock time at which the
        transfer may be complete: now if the bucket held them, later by the debt over the rate."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate_bytes_s)
            self._at = now
            self._tokens -= nbytes
            return now + max(0.0, -self._tokens / self.rate_bytes_s)

    def wait_until(self, ready_at: float) -> None:
        """Sleep until ``ready_at`` (a time ``reserve`` returned) on the bucket's clock."""
        delay = ready_at - self._clock()
        if delay > 0:
            time.sleep(delay)


def bucket_for(mbps: float) -> TokenBucket | None:
    """The bucket for ``cluster.lane_bandwidth_mbps`` (megabits per second); None: unlimited (0)."""
    return TokenBucket(mbps * 1e6 / 8) if mbps > 0 else None
