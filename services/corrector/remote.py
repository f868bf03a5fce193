"""Correctors behind the network: any OpenAI-compatible chat endpoint, or a `POST /v1/correct`
service. Both retry with backoff, honour Retry-After, limit concurrency, spend a budget and share
a circuit breaker per endpoint."""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any

import httpx
import openai
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.corrector import prompts
from services.corrector.answers import to_correction
from services.corrector.base import CallTrace, CorrectorError, parse_agent_output, thought_of
from services.corrector.egress import check_destination
from services.corrector.resilience import (
    Budget,
    CircuitBreaker,
    Retryable,
    RetryPolicy,
    breaker_for,
    call_with_retries,
    parse_retry_after,
)
from services.corrector.tools import FIND_ALL_TOOL, card_value, run_tool, solve_text
from shared.schemas import Correction, CorrectionRequest

log = logging.getLogger("gtr.corrector")


class RemoteParams(BaseModel):
    """Settings of a remote corrector (the registry row's `params`)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(
        default=0.4, ge=0, le=2, description="Sampling temperature (GTR: 0.4)"
    )
    max_tokens: int | None = Field(
        default=None, ge=16, le=32_000, description="Answer cap; None = 400, ALFWorld 600"
    )
    timeout_s: float = Field(default=60.0, gt=0, le=600, description="Timeout of one HTTP request")
    max_retries: int = Field(default=4, ge=0, le=20, description="Retries on 429, 5xx, timeouts")
    backoff_base_s: float = Field(
        default=1.0, ge=0, le=60, description="First backoff; doubles per retry"
    )
    backoff_max_s: float = Field(default=15.0, ge=0, le=600, description="Longest backoff")
    retry_after_max_s: float = Field(
        default=60.0, ge=0, le=3600, description="Longest Retry-After honoured"
    )
    concurrency: int = Field(default=8, ge=1, le=1024, description="Requests in flight at once")
    vision: bool = Field(
        default=True, description="Send the image; False = a text description of the state"
    )
    tools: bool = Field(
        default=True,
        description="Points24 solver tool (inlined if the endpoint refuses tool calls); False = "
        "no solver at all, the paper's no-tool ablation",
    )
    json_mode: bool = Field(default=True, description="Ask for response_format json_object")
    max_tool_rounds: int = Field(
        default=3, ge=1, le=10, description="Tool rounds before a tool-less final call"
    )
    breaker_threshold: int = Field(
        default=5, ge=1, le=1000, description="Failed corrections that open the circuit"
    )
    breaker_cooldown_s: float = Field(
        default=30.0, ge=0, le=3600, description="Wait before a half-open trial"
    )

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            self.max_retries, self.backoff_base_s, self.backoff_max_s, self.retry_after_max_s
        )


class _Remote(ABC):
    """What both remote correctors share: breaker, semaphore, budget, timing."""

    def __init__(
        self, base_url: str, params: RemoteParams | dict[str, Any] | None, budget: Budget | None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.params = params if isinstance(params, RemoteParams) else RemoteParams(**(params or {}))
        self.budget = budget
        self.breaker: CircuitBreaker = breaker_for(
            self.base_url, self.params.breaker_threshold, self.params.breaker_cooldown_s
        )
        self._slots = threading.BoundedSemaphore(self.params.concurrency)

    def correct(self, req: CorrectionRequest, trace: CallTrace | None = None) -> Correction:
        trace = trace or CallTrace()
        check_destination(self.base_url)  # every call: the name may resolve elsewhere by now
        start = time.perf_counter()
        self.breaker.before_call()
        try:
            correction = self._correct(req, trace)
        except CorrectorError as e:
            # Only a failing endpoint opens the circuit; a bad answer proves the endpoint is up.
            if e.kind == "transport":
                self.breaker.record_failure()
            elif e.kind == "malformed":
                self.breaker.record_success()
            else:
                self.breaker.release()
            raise
        except BaseException:
            self.breaker.release()
            raise
        self.breaker.record_success()
        return correction.model_copy(
            update={"tokens": trace.tokens, "latency_ms": (time.perf_counter() - start) * 1000}
        )

    @abstractmethod
    def _correct(self, req: CorrectionRequest, trace: CallTrace) -> Correction: ...

    def _charge_tokens(self, n: int, trace: CallTrace) -> None:
        trace.tokens += n
        for spend in (trace.budget, self.budget):
            if spend is not None:
                spend.add_tokens(n)


def _retry_after(headers: Any) -> float | None:
    ms = parse_retry_after(headers.get("retry-after-ms")) if headers is not None else None
    return (
        ms / 1000
        if ms is not None
        else parse_retry_after(headers.get("retry-after") if headers else None)
    )


class Rejected(CorrectorError):
    """HTTP 400/422: the endpoint refused the request as formed."""


@dataclass(frozen=True)
class _Call:
    tools: bool  # offer the solver tool in this request
    json_mode: bool  # ask for response_format json_object
    max_tokens: int


class OpenAICorrector(_Remote):
    """GTR's corrector on any OpenAI-compatible chat endpoint (OpenAI, Azure, vLLM, llama.cpp)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        params: RemoteParams | dict[str, Any] | None = None,
        budget: Budget | None = None,
    ) -> None:
        super().__init__(base_url, params, budget)
        self.model = model
        self._plain = False  # set once the endpoint refused tools or response_format
        self.client = openai.OpenAI(
            api_key=api_key or "not-needed",
            base_url=self.base_url,
            max_retries=0,
            timeout=self.params.timeout_s,
        )

    def _correct(self, req: CorrectionRequest, trace: CallTrace) -> Correction:
        output = parse_agent_output(req.output)
        keys = list(thought_of(output)) if output else ["thoughts"]
        try:
            content = self._ask(req, output, keys, trace, plain=self._plain)
        except Rejected:
            if self._plain or not (self.params.tools or self.params.json_mode):
                raise
            # Many servers (vLLM without tool parsing, older llama.cpp) refuse tools or
            # response_format with a 400: go on without them, with the solver's answer inlined.
            log.warning("%s refused tools/response_format; continuing without", self.base_url)
            self._plain = True
            content = self._ask(req, output, keys, trace, plain=True)
        trace.raw = content[:20_000]  # audit copy; a huge answer must not bloat the table
        return to_correction(req.task, content, keys)

    def _ask(
        self,
        req: CorrectionRequest,
        output: dict[str, Any] | None,
        keys: list[str],
        trace: CallTrace,
        plain: bool,
    ) -> str:
        call = _Call(
            tools=req.task == "points24" and self.params.tools and not plain,
            json_mode=self.params.json_mode and not plain,
            max_tokens=self.params.max_tokens or (600 if req.task == "alfworld" else 400),
        )
        # The solver's answer is inlined only for an endpoint that refused tool calls; with
        # tools off there is no solver at all (the no-tool ablation).
        inline = req.task == "points24" and self.params.tools and not call.tools
        return self._converse(self._messages(req, output, keys, inline), call, trace)

    def _messages(
        self, req: CorrectionRequest, output: dict[str, Any] | None, keys: list[str], inline: bool
    ) -> list[dict[str, Any]]:
        system, text = self._prompt(req, output, keys)
        if not self.params.vision:
            if req.state is None:
                raise CorrectorError(
                    "input", "vision is off and the request has no state to describe"
                )
            text = prompts.describe_state(req.state) + "\n" + text
        if inline and req.state is not None:
            text += "\n" + prompts.inline_solutions(solve_text(_card_numbers(req.state)))
        parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
        if self.params.vision and req.image_png_b64:
            url = f"data:image/png;base64,{req.image_png_b64}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": parts},
        ]

    def _prompt(
        self, req: CorrectionRequest, output: dict[str, Any] | None, keys: list[str]
    ) -> tuple[str, str]:
        """(system, user) texts; ALFWorld's come from its env part, which knows the state."""
        if req.task == "alfworld" and req.state is not None:
            from services.env.alfworld import corrector_prompt

            return corrector_prompt(req.state, req.history, req.output)
        thought: dict[str, Any] | str = thought_of(output) if output else req.output
        formula = _current_formula(req, output)
        target = (req.state or {}).get("target_formula")  # the episode's memory, when kept
        text = prompts.user_prompt(req.task, thought, keys, formula, target, self.params.tools)
        return prompts.SYSTEM[req.task], text

    def _converse(self, messages: list[dict[str, Any]], call: _Call, trace: CallTrace) -> str:
        """Chat rounds until the model answers in text; tool calls are run and fed back."""
        for round_ in range(self.params.max_tool_rounds + 1):
            offer_tools = call.tools and round_ < self.params.max_tool_rounds
            message = self._complete(messages, replace(call, tools=offer_tools), trace)
            calls = getattr(message, "tool_calls", None)
            if not (offer_tools and calls):
                content = getattr(message, "content", None)
                if not isinstance(content, str) or not content.strip():
                    raise CorrectorError("malformed", "the answer has no text content")
                return content
            messages.append(
                {
                    "role": "assistant",
                    "content": message.content or "",
                    "tool_calls": [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {
                                "name": c.function.name,
                                "arguments": c.function.arguments,
                            },
                        }
                        for c in calls
                    ],
                }
            )
            for c in calls:
                result = run_tool(c.function.name, c.function.arguments)
                messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
        raise CorrectorError("malformed", "no answer after the tool rounds")  # unreachable guard

    def _complete(self, messages: list[dict[str, Any]], call: _Call, trace: CallTrace) -> Any:
        kwargs: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": self.params.temperature,
            "max_tokens": call.max_tokens,
        }
        if call.json_mode:
            kwargs["response_format"] = {"type": "json_object"}
        if call.tools:
            kwargs.update(tools=[FIND_ALL_TOOL], tool_choice="auto")

        def send() -> Any:
            with self._slots:
                return self._send(kwargs)

        response = call_with_retries(send, self.params.retry_policy(), trace, self.budget)
        try:
            usage = getattr(response, "usage", None)
            self._charge_tokens(int(getattr(usage, "total_tokens", 0) or 0), trace)
            return response.choices[0].message
        except (AttributeError, IndexError, TypeError) as e:
            raise CorrectorError(
                "malformed", f"not a chat completion ({e})", raw=str(response)[:2000]
            ) from e

    def _send(self, kwargs: dict[str, Any]) -> Any:
        try:
            return self.client.chat.completions.create(**kwargs)
        except openai.APITimeoutError as e:
            raise Retryable("timeout") from e
        except openai.APIConnectionError as e:
            raise Retryable(f"connection failed ({e.__cause__ or e})") from e
        except openai.APIStatusError as e:
            if e.status_code == 429 or e.status_code >= 500:
                raise Retryable(f"HTTP {e.status_code}", _retry_after(e.response.headers)) from e
            body = e.body.get("message", e.message) if isinstance(e.body, dict) else e.message
            reason = f"HTTP {e.status_code}: {str(body)[:300]}"
            if e.status_code in (400, 422):
                raise Rejected("transport", reason) from e
            raise CorrectorError("transport", reason) from e
        except (openai.APIError, ValueError) as e:  # e.g. a 200 whose body is not JSON
            raise CorrectorError("malformed", f"unreadable response ({str(e)[:300]})") from e


class HttpCorrector(_Remote):
    """Any service implementing `POST /v1/correct` (see docs/corrector-protocol.md)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        params: RemoteParams | dict[str, Any] | None = None,
        budget: Budget | None = None,
    ) -> None:
        super().__init__(base_url, params, budget)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=self.params.timeout_s, headers=headers)

    def _correct(self, req: CorrectionRequest, trace: CallTrace) -> Correction:
        body = req.model_dump(mode="json")

        def send() -> httpx.Response:
            with self._slots:
                return self._send(body)

        response = call_with_retries(send, self.params.retry_policy(), trace, self.budget)
        trace.raw = response.text[:20_000]
        try:
            correction = Correction.model_validate_json(response.content)
        except ValidationError as e:
            raise CorrectorError(
                "malformed", f"not a Correction ({e.errors()[0]['msg']})", trace.raw
            ) from e
        self._charge_tokens(correction.tokens, trace)
        return correction

    def _send(self, body: dict[str, Any]) -> httpx.Response:
        try:
            response = self.client.post(f"{self.base_url}/v1/correct", json=body)
        except httpx.TimeoutException as e:
            raise Retryable("timeout") from e
        except httpx.TransportError as e:
            raise Retryable(f"connection failed ({e})") from e
        if response.status_code == 429 or response.status_code >= 500:
            raise Retryable(f"HTTP {response.status_code}", _retry_after(response.headers))
        if response.status_code != 200:
            raise CorrectorError("transport", f"HTTP {response.status_code}: {response.text[:300]}")
        return response


def _current_formula(req: CorrectionRequest, output: dict[str, Any] | None) -> str | None:
    """The formula so far, from the privileged state, else from the agent's own output."""
    if req.task not in ("ezpoints", "points24"):
        return None
    state = req.state or {}
    value = state.get("formula_text", state.get("formula"))
    if value is None and output is not None:
        value = output.get("formula", output.get("current formula"))
    if isinstance(value, list):
        return "".join(str(v) for v in value)
    return None if value is None else str(value)


def _card_numbers(state: dict[str, Any]) -> list[int]:
    """The cards' values from the privileged state."""
    cards = state.get("numbers") or state.get("cards") or []
    return [card_value(c["rank"] if isinstance(c, dict) else c) for c in cards]
