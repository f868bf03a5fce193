"""Retries with backoff, a circuit breaker and a per-run budget for the remote correctors."""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import TypeVar

from services.corrector.base import CallTrace, CorrectorError, Spend

T = TypeVar("T")


class BudgetExceeded(CorrectorError):
    def __init__(self, reason: str) -> None:
        super().__init__("budget", reason)


class Retryable(Exception):
    """A failure worth retrying (429, 5xx, timeout, connection); may carry the server's wait."""

    def __init__(
        self, reason: str, retry_after: float | None = None, overload: bool = False
    ) -> None:
        super().__init__(reason)
        self.retry_after = retry_after
        self.overload = overload  # the server shed load (timeout, 429, 503): send less at once


class Budget:
    """Calls and tokens a run may spend on its corrector; shared by every thread of the run."""

    def __init__(
        self,
        max_calls: int | None = None,
        max_tokens: int | None = None,
        used_calls: int = 0,
        used_tokens: int = 0,
    ) -> None:
        self.max_calls, self.max_tokens = max_calls, max_tokens
        self.calls, self.tokens = used_calls, used_tokens
        self._lock = threading.Lock()

    def charge_call(self) -> None:
        """Counts one request, or raises BudgetExceeded when none is left."""
        with self._lock:
            if self.max_calls is not None and self.calls >= self.max_calls:
                raise BudgetExceeded(f"call budget of {self.max_calls} spent")
            if self.max_tokens is not None and self.tokens >= self.max_tokens:
                raise BudgetExceeded(f"token budget of {self.max_tokens} spent")
            self.calls += 1

    def add_tokens(self, n: int) -> None:
        with self._lock:
            self.tokens += n


class CircuitBreaker:
    """Opens after `threshold` consecutive failed corrections; after `cooldown_s` lets one trial
    through (half-open): its success closes the circuit, its failure opens it again."""

    def __init__(self, threshold: int = 5, cooldown_s: float = 30.0) -> None:
        self.threshold, self.cooldown_s = threshold, cooldown_s
        self.failures = 0
        self.opened_at: float | None = None
        self._trial_running = False
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        with self._lock:
            return self._state()

    def _state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if time.monotonic() - self.opened_at >= self.cooldown_s else "open"

    def before_call(self) -> None:
        with self._lock:
            state = self._state()
            if state == "closed":
                return
            if state == "half_open" and not self._trial_running:
                self._trial_running = True
                return
        wait = self.cooldown_s - (time.monotonic() - (self.opened_at or 0.0))
        raise CorrectorError(
            "circuit_open",
            f"{self.failures} consecutive failures; next trial in {max(wait, 0):.0f} s",
        )

    def record_success(self) -> None:
        with self._lock:
            self.failures, self.opened_at, self._trial_running = 0, None, False

    def release(self) -> None:
        """Ends a call that proved nothing about the endpoint (no request was answered)."""
        with self._lock:
            self._trial_running = False

    def record_failure(self) -> None:
        with self._lock:
            self.failures += 1
            if self._trial_running or self.failures >= self.threshold:
                self.opened_at = time.monotonic()
            self._trial_running = False


_BREAKERS: dict[str, CircuitBreaker] = {}
_BREAKERS_LOCK = threading.Lock()


def breaker_for(url: str, threshold: int = 5, cooldown_s: float = 30.0) -> CircuitBreaker:
    """One breaker per endpoint (and settings) and process, shared by the correctors calling it."""
    key = f"{url}|{threshold}|{cooldown_s}"
    with _BREAKERS_LOCK:
        if key not in _BREAKERS:
            _BREAKERS[key] = CircuitBreaker(threshold, cooldown_s)
        return _BREAKERS[key]


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After is either seconds or an HTTP date."""
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 4
    backoff_base_s: float = 1.0
    backoff_max_s: float = 15.0
    retry_after_max_s: float = 60.0  # never sleep longer than this, whatever the server says

    def delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self.retry_after_max_s)
        # Jittered exponential backoff keeps many workers from retrying in lockstep.
        return min(self.backoff_base_s * 2**attempt, self.backoff_max_s) * random.uniform(0.5, 1.0)


def call_with_retries(
    send: Callable[[], T], policy: RetryPolicy, trace: CallTrace, budget: Spend | None = None
) -> T:
    """Calls `send` until it succeeds, retrying `Retryable` failures with backoff.

    Each attempt first reserves a call from the run's budget (`trace.budget`) and `budget`.
    """
    last: Retryable | None = None
    for attempt in range(policy.max_retries + 1):
        for spend in (trace.budget, budget):
            if spend is not None:
                spend.charge_call()
        trace.attempts += 1
        try:
            return send()
        except Retryable as e:
            last = e
            if attempt < policy.max_retries:
                time.sleep(policy.delay(attempt, e.retry_after))
    raise CorrectorError("transport", f"gave up after {policy.max_retries + 1} attempts: {last}")


RATE_S = 30.0  # the arrival rate is measured over this many seconds


class AdaptiveLimit:
    """How many requests an endpoint gets at once. Starts at `start`, a probe; once a window of
    `limit` answers came back in time it opens at once to what the run needs (`needed`; it
    doubles while that is unknown): one round trip, not TCP's log2(L) of them (minutes at a
    30 s corrector). An overload (timeout, 429, 503, refused connection) halves it, a latency
    above `slow_factor` x the best seen (requests queue at the server) holds it and restarts the
    window; from the first push-back on, AIMD adds one per window and halves per overload.

    Little's law sizes the need: arrivals per second x latency = requests in flight, or the
    calls waiting now, whichever is more, within `max_limit` and what the provider's rate limits
    let through (`pace`: calls per second); the limit never opens past it, so an endpoint is not
    offered more than the rollout can use. A server that answers one request at a time queues the
    probe (its latency doubles) and settles at the probe's size instead of timing out a queue; a
    hosted API has the need in flight after the probe's round trip. `adaptive=False`: always
    `max_limit`. Retry-After pauses every caller."""

    def __init__(
        self, max_limit: int, start: int = 1, adaptive: bool = True, slow_factor: float = 2.0
    ) -> None:
        self.max_limit, self.adaptive, self.slow_factor = max_limit, adaptive, slow_factor
        self.limit = min(max(start, 1), max_limit) if adaptive else max_limit
        self.slow_start = adaptive  # opening to the need until the first push-back
        self.pace: Callable[[], float | None] | None = None  # calls/s the rate limits sustain
        self.in_flight = 0
        self.waiting = 0  # calls blocked in acquire: the backlog at this endpoint
        self.best_s: float | None = None  # lowest latency seen: the unloaded server
        self.latency_s: float | None = None  # smoothed latency (EWMA)
        self._arrivals: deque[float] = deque()  # when the calls of the last RATE_S came
        self.peak_in_flight = 0  # the most requests ever in flight at once
        self.cuts = 0  # how often the limit was halved
        self.paused_until = 0.0  # monotonic time before which nothing is sent (Retry-After)
        self._window = 0  # calls answered in time since the limit last changed
        self._issued = 0  # tickets handed out, in order
        self._cut_after = 0  # calls issued before the last cut do not cut again
        self._cond = threading.Condition()

    @property
    def rate(self) -> float | None:
        """Calls per second over the last RATE_S seconds (None before two arrived)."""
        if len(self._arrivals) < 2:
            return None
        span = max(time.monotonic() - self._arrivals[0], 1.0)
        return len(self._arrivals) / span

    @property
    def needed(self) -> int | None:
        """Requests in flight that keep up with the arrivals (Little's law: L = lambda W), or
        that clear the calls waiting now within one round trip, whichever is more; at most what
        the provider's rate limits sustain over a round trip (more would wait on the buckets)."""
        rate = self.rate
        if rate is None or self.latency_s is None:
            return None
        need = max(1, math.ceil(rate * self.latency_s), self.in_flight + self.waiting)
        allowed = self.pace() if self.pace is not None else None
        if allowed is not None:
            need = min(need, max(1, math.ceil(allowed * self.latency_s)))
        return need

    def acquire(self) -> int:
        """Waits for a slot; returns the call's ticket for `release`."""
        with self._cond:
            now = time.monotonic()
            self._arrivals.append(now)
            while self._arrivals and self._arrivals[0] < now - RATE_S:
                self._arrivals.popleft()
            self.waiting += 1
            while self.in_flight >= self.limit:
                self._cond.wait()
            self.waiting -= 1
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            self._issued += 1
            return self._issued

    def release(self) -> None:
        with self._cond:
            self.in_flight -= 1
            self._cond.notify_all()

    def pause(self, seconds: float) -> None:
        """The endpoint asked for a wait (Retry-After): nothing is sent before it is over."""
        with self._cond:
            self.paused_until = max(self.paused_until, time.monotonic() + seconds)

    def wait_pause(self) -> None:
        while (left := self.paused_until - time.monotonic()) > 0:
            time.sleep(min(left, 1.0))

    def feedback(self, ticket: int, latency_s: float | None, overloaded: bool) -> None:
        """How one request of the call holding `ticket` went: its latency when it was answered,
        `overloaded` when the server shed it."""
        with self._cond:
            if latency_s is not None:
                lat = self.latency_s
                self.latency_s = latency_s if lat is None else 0.8 * lat + 0.2 * latency_s
            if self.adaptive:
                self._adapt(ticket, latency_s, overloaded)
            self._cond.notify_all()

    def _adapt(self, ticket: int, latency_s: float | None, overloaded: bool) -> None:
        if overloaded:
            # Calls sent at the old limit fail together: one cut per round trip, as TCP does.
            if ticket > self._cut_after:
                self.limit, self.cuts = max(1, self.limit // 2), self.cuts + 1
                self._cut_after, self._window, self.slow_start = self._issued, 0, False
            return
        if latency_s is None:
            return
        self.best_s = latency_s if self.best_s is None else min(self.best_s, latency_s)
        if latency_s > self.slow_factor * self.best_s:
            # Requests queue at the server: hold; growing takes a window of answers in time.
            self.slow_start, self._window = False, 0
            return
        self._window += 1
        if self._window >= self.limit and self.limit < self.max_limit:
            grow = self.limit + 1
            if self.slow_start:
                need = self.needed or 2 * self.limit
                # A window of fewer than 4 answers says little about the server: double.
                # Otherwise the need at once: its latency held while the probe was out.
                grow = max(grow, need if self.limit >= 4 else min(need, 2 * self.limit))
            self.limit, self._window = min(self.max_limit, grow), 0


class RateLimit:
    """A provider's requests and tokens per minute (RPM, TPM), as token buckets refilled
    continuously. A request waits for one request and the tokens a call has cost on average."""

    def __init__(self, rpm: int | None, tpm: int | None) -> None:
        self.rpm, self.tpm = rpm, tpm
        self.requests = float(rpm or 0)
        self.tokens = float(tpm or 0)
        self.per_call = 0.0  # tokens per call, smoothed
        self._at = time.monotonic()
        self._lock = threading.Lock()

    def _refill(self, now: float) -> None:
        dt, self._at = now - self._at, now
        if self.rpm:
            self.requests = min(float(self.rpm), self.requests + dt * self.rpm / 60)
        if self.tpm:
            self.tokens = min(float(self.tpm), self.tokens + dt * self.tpm / 60)

    def wait(self) -> float:
        """Blocks until a request may go; returns the tokens reserved for it."""
        while True:
            with self._lock:
                self._refill(time.monotonic())
                need = min(self.per_call, float(self.tpm or 0))
                ok_r = not self.rpm or self.requests >= 1
                ok_t = not self.tpm or self.tokens >= need
                if ok_r and ok_t:
                    self.requests -= 1 if self.rpm else 0
                    self.tokens -= need if self.tpm else 0
                    return need
                short = []
                if not ok_r:
                    short.append((1 - self.requests) * 60 / self.rpm)  # type: ignore[operator]
                if not ok_t:
                    short.append((need - self.tokens) * 60 / self.tpm)  # type: ignore[operator]
            time.sleep(min(max(max(short), 0.01), 0.5))

    def per_s(self) -> float | None:
        """Calls a second the buckets sustain (None: no limit, or no call's tokens known)."""
        caps = [self.rpm / 60] if self.rpm else []
        if self.tpm and self.per_call:
            caps.append(self.tpm / 60 / self.per_call)
        return min(caps) if caps else None

    def spent(self, reserved: float, tokens: int) -> None:
        """A call's real token count replaces what was reserved for it."""
        with self._lock:
            if self.tpm:
                self.tokens -= tokens - reserved
            if tokens:
                self.per_call = tokens if not self.per_call else 0.8 * self.per_call + 0.2 * tokens


_LIMITS: dict[str, AdaptiveLimit] = {}


def limit_for(url: str, max_limit: int, start: int, adaptive: bool) -> AdaptiveLimit:
    """One limit per endpoint (and settings) and process: all its callers share the server."""
    key = f"{url}|{max_limit}|{start}|{adaptive}"
    with _BREAKERS_LOCK:
        if key not in _LIMITS:
            _LIMITS[key] = AdaptiveLimit(max_limit, start, adaptive)
        return _LIMITS[key]


_RATES: dict[str, RateLimit] = {}


def rate_for(url: str, rpm: int | None, tpm: int | None) -> RateLimit | None:
    """One RPM/TPM bucket per endpoint (and settings) and process; None when none is set."""
    if not rpm and not tpm:
        return None
    key = f"{url}|{rpm}|{tpm}"
    with _BREAKERS_LOCK:
        if key not in _RATES:
            _RATES[key] = RateLimit(rpm, tpm)
        return _RATES[key]
