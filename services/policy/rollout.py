"""The rollout's inner loop: one response per env from the policy, then every env stepped with
its response; again with the observations that came back.

``rollout_step`` is that loop's body and ``roll`` the loop, whatever serves the policy and the
envs: the controller calls ``rollout_step`` itself (embedded, or when it must act between steps),
and the policy service runs ``roll`` for a controller that asks it to (``POST /rollout``): then
the env service is called from the process that just generated, and a rollout step costs one
round trip between services instead of two (docs/benchmarks.md, "One round trip a rollout
step"). Torch-free, like ``protocol.py``: the controller imports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from services.policy.protocol import ImageLike, RolloutPolicy
from services.policy.schemas import Generation

if TYPE_CHECKING:
    from services.env.service import StepResult


class SteppedEnvs(Protocol):
    """What a rollout needs of the envs: ``EnvPool`` in a process, ``EnvClient`` over HTTP."""

    def step_batch(self, items: Sequence[tuple[str, str]], /) -> list[StepResult]: ...


@dataclass
class RolloutStep:
    """One rollout step of every env: the responses, the env steps they made, and the seconds
    each took where it ran (the controller's stage clock adds them up)."""

    generations: list[Generation]
    results: list[StepResult]
    generate_s: float
    env_s: float


def rollout_step(
    policy: RolloutPolicy,
    envs: SteppedEnvs,
    sessions: Sequence[str],
    images: Sequence[ImageLike],
    prompts: Sequence[str],
    params: dict[str, Any],
) -> RolloutStep:
    """Generate for each (image, prompt) with the sampling ``params``, then step session ``i``
    with response ``i``."""
    start = time.perf_counter()
    gens = policy.generate(images, prompts, **params)
    return _step_envs(envs, sessions, gens, start, time.perf_counter())


def roll(
    policy: RolloutPolicy,
    envs: SteppedEnvs,
    sessions: Sequence[str],
    images: Sequence[ImageLike],
    prompts: Sequence[str],
    steps: int,
    params: dict[str, Any],
) -> Iterator[RolloutStep]:
    """``steps`` rollout steps from the given observations; each one is yielded as it is done.

    The next step's generation is started before a step is yielded, so what the caller does with
    the step (the policy service serialises and sends it) runs beside that generation, where the
    policy can start one without waiting for it (``submit``: the policy service's batcher).

    With a ``seed`` in ``params``, step ``t`` samples with ``seed + t``: reproducible, and no two
    steps drawing the same random numbers."""
    submit = _submitter(policy)
    seed = params.get("seed")

    def at(t: int) -> dict[str, Any]:
        return params if seed is None else {**params, "seed": seed + t}

    started = time.perf_counter()
    pending = submit(images, prompts, **at(0))
    for t in range(steps):
        step = _step_envs(envs, sessions, pending.result(), started, time.perf_counter())
        started = time.perf_counter()
        if t + 1 < steps:
            images = [r.observation.image for r in step.results]
            prompts = [r.observation.prompt for r in step.results]
            pending = submit(images, prompts, **at(t + 1))
        yield step


def _step_envs(
    envs: SteppedEnvs, sessions: Sequence[str], gens: list[Generation], start: float, end: float
) -> RolloutStep:
    """Step session ``i`` with response ``i``; ``start``-``end``: the generation's seconds."""
    results = envs.step_batch([(sid, g.text) for sid, g in zip(sessions, gens, strict=True)])
    return RolloutStep(gens, results, end - start, time.perf_counter() - end)


def _submitter(policy: RolloutPolicy) -> Callable[..., Future[list[Generation]]]:
    """The policy's ``submit``, or one that generates at once (a policy in this process)."""
    submit = getattr(policy, "submit", None)
    if submit is not None:
        return submit  # type: ignore[no-any-return]

    def now(images: Sequence[ImageLike], prompts: Sequence[str], **params: Any) -> Future:
        done: Future[list[Generation]] = Future()
        try:
            done.set_result(policy.generate(images, prompts, **params))
        except Exception as e:  # raised by .result(), where a submitted one would raise
            done.set_exception(e)
        return done

    return now
