"""Correctors behind the network: any OpenAI-compatible chat endpoint, or a `POST /v1/correct`
service. Both retry with backoff, honour Retry-After, limit concurrency, spend a budget and share
a circuit breaker per endpoint."""

from __future__ import annotations

import json
import logging
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.corrector import prompts
from services.corrector.answers import answer_schema, to_correction
from services.corrector.base import (
    FAILURE_KINDS,
    CallTrace,
    CorrectorError,
    parse_agent_output,
    thought_of,
)
from services.corrector.egress import check_destination, http_client, openai_http_client
from services.corrector.resilience import (
    AdaptiveLimit,
    Budget,
    CircuitBreaker,
    RateLimit,
    Retryable,
    RetryPolicy,
    breaker_for,
    call_with_retries,
    limit_for,
    parse_retry_after,
    rate_for,
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
    concurrency: int = Field(
        default=256,
        ge=1,
        le=1024,
        description="Most requests in flight at once, per process (a hosted API takes hundreds)",
    )
    concurrency_start: int = Field(
        default=4,
        ge=1,
        le=1024,
        description="Requests in flight at first (a probe); once they are answered in time, "
        "the limit opens to the rollout's need",
    )
    adaptive: bool = Field(
        default=True,
        description="After the probe's round trip, open to the rollout's need (Little's law: "
        "arrivals x latency, or the backlog); then AIMD: halve on timeout/429/503, hold while "
        "latency rises",
    )
    rpm: int | None = Field(
        default=None, ge=1, le=10_000_000, description="Provider's requests per minute, if any"
    )
    tpm: int | None = Field(
        default=None, ge=1, le=1_000_000_000, description="Provider's tokens per minute, if any"
    )
    vision: bool = Field(
        default=False, description="The model reads images: send them; False = text-only prompt"
    )
    tools: bool = Field(
        default=True,
        description="Points24 solver tool (inlined if the endpoint refuses tool calls); False = "
        "no solver at all, the paper's no-tool ablation",
    )
    json_mode: bool = Field(default=True, description="Ask for structured output at all")
    structured: Literal["auto", "json_schema", "json_object", "none"] = Field(
        default="auto",
        description="auto: a JSON schema, then json_object, then free text, as the server allows",
    )
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
    """What both remote correctors share: breaker, adaptive limit, budget, timing."""

    def __init__(
        self, base_url: str, params: RemoteParams | dict[str, Any] | None, budget: Budget | None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.params = params if isinstance(params, RemoteParams) else RemoteParams(**(params or {}))
        self.budget = budget
        self.breaker: CircuitBreaker = breaker_for(
            self.base_url, self.params.breaker_threshold, self.params.breaker_cooldown_s
        )
        p = self.params
        self.limit: AdaptiveLimit = limit_for(
            self.base_url, p.concurrency, p.concurrency_start, p.adaptive
        )
        self.rate: RateLimit | None = rate_for(self.base_url, p.rpm, p.tpm)
        if self.rate is not None:  # the limit opens no wider than the buckets let calls through
            self.limit.pace = self.rate.per_s

    @contextmanager
    def _timed(self, trace: CallTrace) -> Iterator[None]:
        """One request, sent once a Retry-After is over and the RPM/TPM buckets allow it; the
        endpoint's adaptive limit learns from how it ends."""
        self.limit.wait_pause()
        reserved = self.rate.wait() if self.rate is not None else 0.0
        start = time.perf_counter()
        try:
            yield
        except Retryable as e:
            if e.retry_after:  # every caller of the endpoint waits, not only this one
                self.limit.pause(min(e.retry_after, self.params.retry_after_max_s))
            self.limit.feedback(trace.slot, None, e.overload)
            raise
        finally:
            if self.rate is not None:
                self.rate.spent(reserved, 0)  # the real count comes with _charge_tokens
        self.limit.feedback(trace.slot, time.perf_counter() - start, False)

    def correct(self, req: CorrectionRequest, trace: CallTrace | None = None) -> Correction:
        trace = trace or CallTrace()
        check_destination(self.base_url)  # every call: the name may resolve elsewhere by now
        start = time.perf_counter()
        self.breaker.before_call()
        # One slot per correction (its retries and tool rounds included): a step waits here,
        # unsent, while the endpoint is busy, and is dropped if it was settled meanwhile.
        trace.slot = self.limit.acquire()
        start = time.perf_counter()  # the latency leaves out the wait for a slot
        try:
            if trace.wanted is not None and not trace.wanted():
                raise CorrectorError("skipped", "settled while it waited for a free slot")
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
        finally:
            self.limit.release()
        self.breaker.record_success()
        return correction.model_copy(
            update={"tokens": trace.tokens, "latency_ms": (time.perf_counter() - start) * 1000}
        )

    @abstractmethod
    def _correct(self, req: CorrectionRequest, trace: CallTrace) -> Correction: ...

    def _charge_tokens(self, n: int, trace: CallTrace) -> None:
        trace.tokens += n
        if self.rate is not None:
            self.rate.spent(0, n)
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


# Structured output, most to least constrained; a server refusing one (400/422) gets the next.
# llama-cpp-python knows only json_object, but takes a schema inside it (grammar-constrained).
LEVELS = ("json_schema", "json_object_schema", "json_object", "none")
SCHEMA_LEVELS = ("json_schema", "json_object_schema")
_FIRST_LEVEL = {"auto": 0, "json_schema": 0, "json_object": 2, "none": 3}


@dataclass(frozen=True)
class Honoured:
    """What an endpoint did with one level of structured output (``OpenAICorrector.probe``)."""

    level: str  # one of LEVELS
    outcome: Literal["enforced", "ignored", "refused", "failed"]
    answer: str  # the answer's start ("" when there was none)
    error: CorrectorError | None = None  # why it was ignored, refused or failed


# The probe asks for something a model never writes unless a decoder forces it.
PROBE_PROMPT = "Name one colour, in one word."
PROBE_ANSWER = {"probe": "kiwi-7"}
PROBE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"probe": {"type": "string", "enum": ["kiwi-7"]}},
    "required": ["probe"],
    "additionalProperties": False,
}


def _probe_outcome(level: str, answer: str) -> CorrectorError | None:
    """None when the level is enforced: a schema level when the answer is the schema's only
    value, plain json_object when the answer is a JSON object at all. Otherwise why the answer
    shows the level was ignored (what ``gtr corrector test`` and ``/test`` report per answer)."""
    try:
        value = json.loads(answer)
    except ValueError:
        return CorrectorError("malformed", "answer is not JSON" if answer else "empty answer")
    if level in SCHEMA_LEVELS and value != PROBE_ANSWER:
        return CorrectorError("malformed", "answer is JSON but not the schema's only value")
    if not isinstance(value, dict):
        return CorrectorError("malformed", "answer is JSON but not an object")
    return None


def _fits(content: str, schema: dict[str, Any]) -> bool:
    """Whether an answer has the shape a schema-constraining decoder gives: one bare JSON object
    with the required keys and allowed enum values. An answer of that shape that still fails
    (evaluation NO without a correction) is the model's own mistake, not a server ignoring the
    schema, and must not switch the prompt."""
    try:
        value = json.loads(content)
    except ValueError:
        return False
    if not isinstance(value, dict) or any(k not in value for k in schema.get("required", [])):
        return False
    return all(
        value[k] in prop["enum"]
        for k, prop in schema.get("properties", {}).items()
        if "enum" in prop and k in value
    )


@dataclass(frozen=True)
class _Call:
    tools: bool  # offer the solver tool in this request
    level: str  # one of LEVELS
    max_tokens: int
    schema: dict[str, Any] | None = None  # the answer's JSON schema


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
        # What the endpoint accepts, learnt from its refusals (400/422) and kept from then on.
        self._tools_ok = self.params.tools
        self._level = _FIRST_LEVEL[self.params.structured] if self.params.json_mode else 3
        # False once the endpoint is known to ignore the answer's schema (a probe, or an answer
        # that did not fit it): from then on the prompt carries the schema and an example.
        self.schema_enforced: bool | None = None
        # Imported here: the SDK costs seconds at every start of ``gtr train`` and the API,
        # which load this module for the oracle and the launch checks too.
        import openai

        self.client = openai.OpenAI(
            api_key=api_key or "not-needed",
            base_url=self.base_url,
            max_retries=0,
            timeout=self.params.timeout_s,
            # follows no redirect; a connection per request the limit lets through
            http_client=openai_http_client(self.params.timeout_s, self.params.concurrency),
        )

    def _correct(self, req: CorrectionRequest, trace: CallTrace) -> Correction:
        output = parse_agent_output(req.output)
        keys = list(thought_of(output)) if output else ["thoughts"]
        while True:
            try:
                content, constrained = self._ask(req, output, keys, trace)
                break
            except Rejected as e:
                if not self._degrade(req, e):
                    raise
        trace.raw = content[:20_000]  # audit copy; a huge answer must not bloat the table
        try:
            return to_correction(req.task, content, keys)
        except CorrectorError:
            schema = answer_schema(req.task, keys)
            if constrained and self.schema_enforced is not False and not _fits(content, schema):
                # A schema-constrained decoder cannot write this: the server ignores the field.
                self.schema_enforced = False
                log.warning(
                    "%s answered outside the requested JSON schema: it does not enforce "
                    "structured output; the prompt now carries the schema and an example",
                    self.base_url,
                )
            raise

    def _degrade(self, req: CorrectionRequest, e: Rejected) -> bool:
        """After a refusal, ask for less: first no tools (the solver's answer inlined), then a
        weaker structured output. False when nothing is left to drop."""
        if req.task == "points24" and self._tools_ok:
            self._tools_ok = False
        elif self._level < len(LEVELS) - 1:
            self._level += 1
        else:
            if self.params.vision and req.image_png_b64:
                e.reason += " (the request carried an image: for a text-only model set "
                e.reason += "params.vision = false)"
            return False
        log.warning(
            "%s refused a request (%s); now tools=%s, structured output=%s",
            self.base_url,
            e.reason,
            self._tools_ok,
            LEVELS[self._level],
        )
        return True

    def probe(self, trace: CallTrace | None = None) -> list[Honoured]:
        """Asks for a trivial JSON schema at each structured-output level still allowed, most
        constrained first, and checks the answer: what the endpoint enforces, ignores (answers
        200 in its own shape) or refuses. Sets the level later calls use, and whether their
        prompt must carry the schema. Stops at the first schema enforced, or an endpoint down."""
        check_destination(self.base_url)
        trace = trace or CallTrace()
        found: list[Honoured] = []
        for i in range(self._level, len(LEVELS) - 1):
            level = LEVELS[i]
            kwargs = {
                "model": self.model,
                "messages": [{"role": "user", "content": PROBE_PROMPT}],
                "temperature": 0,
                "max_tokens": 40,
                "response_format": _response_format(level, PROBE_SCHEMA),
            }
            trace.attempts += 1
            try:
                message = self._send(kwargs).choices[0].message
            except Rejected as e:
                found.append(Honoured(level, "refused", "", e))
                continue
            except Retryable as e:  # down or overloaded: nothing learnt
                found.append(Honoured(level, "failed", "", CorrectorError("transport", str(e))))
                return found
            except (CorrectorError, AttributeError, IndexError) as e:
                why = e if isinstance(e, CorrectorError) else CorrectorError("malformed", str(e))
                found.append(Honoured(level, "failed", "", why))
                return found
            answer = str(getattr(message, "content", None) or "")
            ignored = _probe_outcome(level, answer)
            outcome: Literal["enforced", "ignored"] = "ignored" if ignored else "enforced"
            found.append(Honoured(level, outcome, answer[:120], ignored))
            if outcome == "enforced":
                self._level = i
                self.schema_enforced = level in SCHEMA_LEVELS
                return found
        self._level = len(LEVELS) - 1
        self.schema_enforced = False
        return found

    def _ask(
        self,
        req: CorrectionRequest,
        output: dict[str, Any] | None,
        keys: list[str],
        trace: CallTrace,
    ) -> tuple[str, bool]:
        """The model's answer, and whether a schema constrained it (as far as we know)."""
        call = _Call(
            tools=req.task == "points24" and self._tools_ok,
            level=LEVELS[self._level],
            max_tokens=self.params.max_tokens or (600 if req.task == "alfworld" else 400),
            schema=answer_schema(req.task, keys),
        )
        # The solver's answer is inlined only for an endpoint that refused tool calls; with
        # tools off there is no solver at all (the no-tool ablation).
        inline = req.task == "points24" and self.params.tools and not call.tools
        # Tools force plain json_object (a schema would forbid the tool call).
        constrained = call.level in SCHEMA_LEVELS and not call.tools
        described = not constrained or self.schema_enforced is False
        fmt = prompts.answer_format(req.task, call.schema, keys) if described else None
        messages = self._messages(req, output, keys, inline, fmt)
        return self._converse(messages, call, trace), constrained and not described

    def _messages(
        self,
        req: CorrectionRequest,
        output: dict[str, Any] | None,
        keys: list[str],
        inline: bool,
        fmt: str | None = None,
    ) -> list[dict[str, Any]]:
        system, text = self._prompt(req, output, keys)
        if fmt is not None:  # structure not enforced: the schema and a worked example
            system += "\n\n" + fmt
        if not self.params.vision:
            # Text-only: the prompt speaks of the observation below, never of an image.
            system = prompts.text_only(system)
            seen = prompts.describe_state(req.state) if req.state else f"[Prompt] {req.prompt}"
            text = seen + "\n" + prompts.text_only(text)
        if inline and req.state is not None:
            text += "\n" + prompts.inline_solutions(solve_text(_card_numbers(req.state)))
        content: str | list[dict[str, Any]] = text  # a plain string: every chat template reads it
        if self.params.vision and req.image_png_b64:
            url = f"data:image/png;base64,{req.image_png_b64}"
            content = [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": url}},
            ]
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": content},
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
        if call.level != "none" and not call.tools:  # a schema would forbid the tool call
            kwargs["response_format"] = _response_format(call.level, call.schema)
        elif call.level != "none":
            kwargs["response_format"] = {"type": "json_object"}
        if call.tools:
            kwargs.update(tools=[FIND_ALL_TOOL], tool_choice="auto")

        def send() -> Any:
            with self._timed(trace):
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
        import openai  # already loaded by __init__

        try:
            return self.client.chat.completions.create(**kwargs)
        except openai.APITimeoutError as e:
            raise Retryable("timeout", overload=True) from e
        except openai.APIConnectionError as e:
            raise Retryable(f"connection failed ({e.__cause__ or e})", overload=_shed(e)) from e
        except openai.APIStatusError as e:
            body = e.body.get("message", e.message) if isinstance(e.body, dict) else e.message
            reason = f"HTTP {e.status_code}: {str(body)[:300]}"
            if e.status_code >= 500 and _REFUSAL.search(str(body)):
                # llama-cpp-python answers a request it cannot validate with a 500: retrying
                # the same body cannot help, asking for less can.
                raise Rejected("transport", reason) from e
            if e.status_code == 429 or e.status_code >= 500:
                wait = _retry_after(e.response.headers)
                shed = e.status_code in OVERLOAD_STATUS
                raise Retryable(f"HTTP {e.status_code}", wait, overload=shed) from e
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
        # follows no redirect; a connection per request the limit lets through
        self.client = http_client(self.params.timeout_s, headers, self.params.concurrency)

    def _correct(self, req: CorrectionRequest, trace: CallTrace) -> Correction:
        body = req.model_dump(mode="json")
        if not self.params.tools and body.get("state"):  # no solver: not even its verdicts
            body["state"] = prompts.agent_view(body["state"])

        def send() -> httpx.Response:
            with self._timed(trace):
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
            raise Retryable("timeout", overload=True) from e
        except httpx.TransportError as e:
            raise Retryable(f"connection failed ({e})", overload=_shed(e)) from e
        code = response.status_code
        if code == 429 or code >= 500:
            shed = code in OVERLOAD_STATUS
            raise Retryable(f"HTTP {code}", _retry_after(response.headers), overload=shed)
        if code != 200:
            raise _protocol_error(response)
        return response


def _protocol_error(response: httpx.Response) -> CorrectorError:
    """A 4xx of `POST /v1/correct`: our services say `{"detail": {"kind", "reason", "raw"}}`,
    so an unusable model answer (422, never retried) keeps its kind, reason and raw answer."""
    detail: Any = None
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        pass
    if isinstance(detail, dict) and detail.get("kind") in FAILURE_KINDS:
        raw = detail.get("raw")
        return CorrectorError(
            str(detail["kind"]),
            f"{detail.get('reason', '')} (HTTP {response.status_code})",
            raw if isinstance(raw, str) else None,
        )
    return CorrectorError("transport", f"HTTP {response.status_code}: {response.text[:300]}")


# Statuses that mean the server sheds load (back off), unlike a 500 that means it is broken.
OVERLOAD_STATUS = (429, 503, 504)


def _shed(error: BaseException) -> bool:
    """Whether a failed connection says the server sheds load (refused, reset, timed out). A
    kept-alive connection the server closed as the request went out ("Server disconnected
    without sending a response": a race with its keep-alive timeout, one in a few thousand
    requests) says nothing about load: it is retried without halving the limit."""
    seen: BaseException | None = error
    for _ in range(8):  # the error, and what it was raised from
        if seen is None:
            break
        if type(seen).__name__ == "RemoteProtocolError":  # httpx's, or the SDK's httpx2's
            return False
        seen = seen.__cause__ or seen.__context__
    return True


# A 5xx whose message says the request's shape was refused (what some servers answer for a
# parameter they do not know) is a refusal, not an outage.
_REFUSAL = re.compile(r"validation error|response_format|json_schema|tool_choice", re.IGNORECASE)


def _response_format(level: str, schema: dict[str, Any] | None) -> dict[str, Any]:
    if level == "json_schema" and schema is not None:
        return {
            "type": "json_schema",
            "json_schema": {"name": "correction", "schema": schema, "strict": False},
        }
    if level == "json_object_schema" and schema is not None:
        return {"type": "json_object", "schema": schema}
    return {"type": "json_object"}


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
