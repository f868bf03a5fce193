"""Dynamic batching: concurrent generate requests share one model call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from services.policy.protocol import ImageLike, RolloutPolicy
from services.policy.schemas import Generation
from shared import observe


@dataclass
class _Job:
    images: list[ImageLike]
    prompts: list[str]
    params: dict[str, Any]
    future: asyncio.Future[list[Generation]]


@dataclass
class BatchStats:
    batches: int = 0  # model calls
    requests: int = 0
    samples: int = 0
    largest_batch: int = 0
    windows: int = 0  # gathers that held the window open for more requests


class Batcher:
    """Gathers requests for up to `max_wait_ms` (or `max_batch` samples) and runs them together.

    The window opens only when it can pay: while callers have lately been concurrent (a request
    came while another was queued, decoding or generating, within `memory_s`), or while requests
    already received are still decoding their images (then it is held for them, up to
    `max_wait_ms` more). An open window stays open while requests keep arriving less than
    `max_wait_ms` apart, up to `max_hold_ms` (default 10 windows): sixteen callers posting at
    once reach the server over more than one window, and a model call of one that starts before
    the rest arrive makes them wait a whole generation. A lone caller that sends a whole batch
    per request (the controller's rollout step) is served at once instead of waiting out the
    window on every call.

    Requests with different sampling settings (or a seed) never share a call, so every caller gets
    exactly what a solo call with its own settings would sample from.
    """

    def __init__(
        self,
        policy: RolloutPolicy,
        max_batch: int = 32,
        max_wait_ms: float = 5.0,
        memory_s: float = 30.0,
        max_hold_ms: float | None = None,
    ) -> None:
        self.policy = policy
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000
        self.max_hold = (10 * max_wait_ms if max_hold_ms is None else max_hold_ms) / 1000
        self.memory_s = memory_s
        self.stats = BatchStats()
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.incoming_now = 0  # requests received whose images are still being decoded
        self._generating = False
        self._concurrent_until = float("-inf")  # loop time up to which callers count as concurrent

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @asynccontextmanager
    async def incoming(self) -> AsyncIterator[None]:
        """Around a request's decoding, before ``submit``: the window waits for such requests."""
        self._seen_concurrent(self.incoming_now > 0 or self._busy())
        self.incoming_now += 1
        try:
            yield
        finally:
            self.incoming_now -= 1

    async def submit(
        self, images: list[ImageLike], prompts: list[str], params: dict[str, Any]
    ) -> list[Generation]:
        """Queue one request; resolves with its own generations, in order."""
        job = _Job(images, prompts, params, asyncio.get_running_loop().create_future())
        self.stats.requests += 1
        self._seen_concurrent(self.incoming_now > 0 or self._busy())
        await self._queue.put(job)
        return await job.future

    def _busy(self) -> bool:
        return self._generating or not self._queue.empty()

    def _seen_concurrent(self, concurrent: bool) -> None:
        if concurrent:
            self._concurrent_until = asyncio.get_running_loop().time() + self.memory_s

    async def _run(self) -> None:
        while True:
            jobs = await self._gather()
            for group in _groups(jobs, self.max_batch):
                await self._call(group)

    async def _gather(self) -> list[_Job]:
        jobs = [await self._queue.get()]
        loop = asyncio.get_running_loop()
        start = last = loop.time()
        window = self.max_wait if start < self._concurrent_until else 0.0
        self.stats.windows += bool(window or self.incoming_now)
        while sum(len(j.prompts) for j in jobs) < self.max_batch:
            if not self._queue.empty():
                jobs.append(self._queue.get_nowait())
                last = loop.time()
                continue
            # A window from the last arrival, not the first; requests already received are
            # worth waiting for (their images are decoding); never longer than max_hold.
            limit = last + (window + self.max_wait if self.incoming_now else window)
            limit = min(limit, start + max(self.max_hold, window))
            if loop.time() >= limit:
                break
            try:
                jobs.append(await asyncio.wait_for(self._queue.get(), limit - loop.time()))
                last = loop.time()
            except TimeoutError:
                continue  # the limit is looked at again: a request may have come in meanwhile
        return jobs

    async def _call(self, group: list[_Job]) -> None:
        images = [im for j in group for im in j.images]
        prompts = [p for j in group for p in j.prompts]
        self.stats.batches += 1
        self.stats.samples += len(prompts)
        self.stats.largest_batch = max(self.stats.largest_batch, len(prompts))
        self._generating = True
        observe.POLICY_BATCH.observe(len(prompts))
        try:
            gens = await asyncio.to_thread(self.policy.generate, images, prompts, **group[0].params)
        except Exception as e:  # every caller of the failed call hears about it
            for j in group:
                if not j.future.done():
                    j.future.set_exception(e)
            return
        finally:
            self._generating = False
        observe.POLICY_TOKENS.inc(sum(len(g.token_ids) for g in gens))
        start = 0
        for j in group:
            if not j.future.done():  # a cancelled caller (client went away) is skipped
                j.future.set_result(gens[start : start + len(j.prompts)])
            start += len(j.prompts)


def _groups(jobs: list[_Job], max_batch: int) -> list[list[_Job]]:
    """Split jobs into model calls: same sampling settings, at most `max_batch` samples each."""
    by_key: dict[tuple[Any, ...], list[list[_Job]]] = {}
    for job in jobs:
        key: tuple[Any, ...] = tuple(sorted(job.params.items()))
        if job.params.get("seed") is not None:
            key += (id(job),)  # seeded sampling is reproducible only alone
        calls = by_key.setdefault(key, [[]])
        if calls[-1] and sum(len(j.prompts) for j in calls[-1]) + len(job.prompts) > max_batch:
            calls.append([])
        calls[-1].append(job)
    return [call for calls in by_key.values() for call in calls]


class BatchedPolicy:
    """``generate`` through the batcher from a thread that is not the event loop's: a rollout
    driven inside the service (``POST /rollout``) shares model calls with every other request."""

    def __init__(self, batcher: Batcher, loop: asyncio.AbstractEventLoop) -> None:
        self.batcher, self.loop = batcher, loop

    def submit(
        self, images: Sequence[ImageLike], prompts: Sequence[str], **params: Any
    ) -> Future[list[Generation]]:
        """Queue a generation; its future resolves when the model call it joined is done."""
        job = self.batcher.submit(list(images), list(prompts), params)
        return asyncio.run_coroutine_threadsafe(job, self.loop)

    def generate(
        self, images: Sequence[ImageLike], prompts: Sequence[str], **params: Any
    ) -> list[Generation]:
        return self.submit(images, prompts, **params).result()

    def load_weights(self, directory: object, /) -> None:
        raise NotImplementedError("the service loads checkpoints through POST /checkpoints/load")
