"""Dynamic batching: concurrent generate requests share one model call."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from PIL import Image

from services.policy.schemas import Generation
from shared import observe


@dataclass
class _Job:
    images: list[Image.Image]
    prompts: list[str]
    params: dict[str, Any]
    future: asyncio.Future[list[Generation]]


@dataclass
class BatchStats:
    batches: int = 0  # model calls
    requests: int = 0
    samples: int = 0
    largest_batch: int = 0


class Batcher:
    """Gathers requests for up to `max_wait_ms` (or `max_batch` samples) and runs them together.

    Requests with different sampling settings (or a seed) never share a call, so every caller gets
    exactly what a solo call with its own settings would sample from.
    """

    def __init__(self, policy: Any, max_batch: int = 32, max_wait_ms: float = 5.0) -> None:
        self.policy = policy
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000
        self.stats = BatchStats()
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def submit(
        self, images: list[Image.Image], prompts: list[str], params: dict[str, Any]
    ) -> list[Generation]:
        """Queue one request; resolves with its own generations, in order."""
        job = _Job(images, prompts, params, asyncio.get_running_loop().create_future())
        self.stats.requests += 1
        await self._queue.put(job)
        return await job.future

    async def _run(self) -> None:
        while True:
            jobs = await self._gather()
            for group in _groups(jobs, self.max_batch):
                await self._call(group)

    async def _gather(self) -> list[_Job]:
        jobs = [await self._queue.get()]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait
        while sum(len(j.prompts) for j in jobs) < self.max_batch:
            try:
                jobs.append(await asyncio.wait_for(self._queue.get(), deadline - loop.time()))
            except TimeoutError:
                break
        return jobs

    async def _call(self, group: list[_Job]) -> None:
        images = [im for j in group for im in j.images]
        prompts = [p for j in group for p in j.prompts]
        self.stats.batches += 1
        self.stats.samples += len(prompts)
        self.stats.largest_batch = max(self.stats.largest_batch, len(prompts))
        observe.POLICY_BATCH.observe(len(prompts))
        try:
            gens = await asyncio.to_thread(self.policy.generate, images, prompts, **group[0].params)
        except Exception as e:  # every caller of the failed call hears about it
            for j in group:
                if not j.future.done():
                    j.future.set_exception(e)
            return
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
