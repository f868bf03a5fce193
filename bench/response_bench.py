"""Milliseconds a batch response costs a FastAPI route: the model returned for FastAPI to check
against ``response_model``, against the model's own JSON (``shared/responses.py``).

    .venv/bin/python bench/response_bench.py [--batch 16] [--tokens 64] [--rounds 5]

Two routes of one app, served by uvicorn in a thread of this process, each answering a batch of
generations like the policy service's ``POST /generate`` (``--batch`` records of ``--tokens``
tokens); the client times each request, the routes alternated. The records are built once: what
is timed is the response's path from the route to the client's parsed JSON.

``--wait-ms N`` makes each route wait N ms first (as a model call would) and reports the time
over N: what the round trip costs once both ends have sat idle through a generation.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import click
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from policy_bench import serve_in_thread  # noqa: E402 - a sibling script, not a package


def _records(batch: int, tokens: int) -> list[object]:
    from services.policy.schemas import Generation

    return [
        Generation(
            text="x" * 4 * tokens,
            token_ids=list(range(tokens)),
            logprobs=[-0.123456789 * (i + 1) for i in range(tokens)],
            value=0.5,
            thought_mask=[i < tokens // 2 for i in range(tokens)],
            action_mask=[i >= tokens // 2 for i in range(tokens)],
            entropy=[1.23456789] * tokens,
            has_action=True,
            finished=True,
        )
        for _ in range(batch)
    ]


@click.command()
@click.option("--batch", default=16, show_default=True)
@click.option("--tokens", default=64, show_default=True)
@click.option("--rounds", default=5, show_default=True)
@click.option("--requests", "per_round", default=50, show_default=True, help="per route and round")
@click.option("--wait-ms", default=0.0, show_default=True, help="each route waits this long first")
def main(batch: int, tokens: int, rounds: int, per_round: int, wait_ms: float) -> None:
    import dataclasses

    from fastapi import FastAPI

    from services.policy.schemas import GenerateResponse, GenerationOut
    from shared.responses import model_response

    gens = _records(batch, tokens)
    app = FastAPI()

    @app.get("/checked", response_model=GenerateResponse)
    def checked() -> GenerateResponse:  # what the routes did before
        time.sleep(wait_ms / 1000)
        return GenerateResponse(generations=[GenerationOut(**dataclasses.asdict(g)) for g in gens])

    @app.get("/direct", response_model=GenerateResponse)
    def direct() -> object:  # what they do now
        time.sleep(wait_ms / 1000)
        out = [GenerationOut.model_validate(g, from_attributes=True) for g in gens]
        return model_response(GenerateResponse(generations=out))

    url, stop = serve_in_thread(app)
    client = httpx.Client(base_url=url)
    assert client.get("/checked").json() == client.get("/direct").json()
    ms: dict[str, list[float]] = {"checked": [], "direct": []}
    for _ in range(rounds):
        for route in ms:
            t0 = time.perf_counter()
            for _ in range(per_round):
                client.get(f"/{route}").json()
            ms[route].append(1e3 * (time.perf_counter() - t0) / per_round - wait_ms)
    stop()
    click.echo(
        f"{batch} generations of {tokens} tokens, {rounds} rounds of {per_round} requests, "
        f"each route waiting {wait_ms:g} ms first"
    )
    click.echo("| route returns | ms per request over the wait (rounds) | median |")
    click.echo("|---|---|---:|")
    for route, label in (("checked", "the model (FastAPI checks it)"), ("direct", "its JSON")):
        xs = ms[route]
        rounds_s = ", ".join(f"{x:.2f}" for x in xs)
        click.echo(f"| {label} | {rounds_s} | {statistics.median(xs):.2f} |")


if __name__ == "__main__":
    main()
