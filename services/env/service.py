"""EnvPool: many env sessions behind text in, observation out (the REST service adapts it).

A step takes the agent's raw output, parses it, executes the action (an unreadable output
becomes a random legal action or a penalised no-op, per ``EnvConfig.invalid_action``), and when
the episode ends resets at once: the returned observation is then the *new* episode's, prompt
included (the reference reused the terminal prompt there).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from services.env.parser import ParsedOutput
from services.env.registry import TASKS, make_env
from services.env.render import display_png
from shared.paths import GAMES_NOT_FOUND, confined_games
from shared.schemas import EnvConfig

GAME_OPTION = "an index of the session's games or one of its game files"


class EnvError(ValueError):
    """A client mistake: unknown task, bad option (REST: 422)."""


class SessionNotFound(KeyError):
    """No such session, or it expired (REST: 404)."""

    def __str__(self) -> str:  # KeyError's would quote the message
        return str(self.args[0]) if self.args else "unknown session"


class PoolFull(RuntimeError):
    """The pool holds its maximum number of sessions (REST: 429)."""


class EpisodeNotStarted(RuntimeError):
    """``step`` before the first ``reset`` (REST: 409)."""


@dataclass
class Observation:
    """What the agent sees, plus the privileged state for the oracle and the metrics."""

    image: np.ndarray  # (H, W, 3) uint8
    prompt: str
    state: dict[str, Any]
    # The same frame at EnvConfig.display_size for people, PNG-encoded once here: stored as is.
    display_png: bytes | None = None


@dataclass
class StepResult:
    """One step; ``observation`` is the next one (the new episode's first when ``done``)."""

    observation: Observation
    reward: float
    terminated: bool
    truncated: bool
    done: bool
    parsed: ParsedOutput
    action: str | None  # the action executed; None for the penalised no-op
    episode_return: float  # so far, or the whole episode's when done
    episode_length: int
    success: bool | None  # set when done: reward sum > 0 (cards), won (ALFWorld)
    final_state: dict[str, Any] | None = None  # the state the episode ended in, when done


@dataclass
class _Session:
    env: Any  # a gymnasium.Env whose ``unwrapped`` offers prompt/state/parse/action_names
    task: str
    config: EnvConfig
    seed: int | None
    rng: np.random.Generator
    last_used: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: bool = False
    episode_return: float = 0.0
    episode_length: int = 0
    episodes: int = 0


def as_config(config: EnvConfig | dict[str, Any] | None) -> EnvConfig:
    """An EnvConfig from a model, a dict or None; EnvError on a bad field."""
    if isinstance(config, EnvConfig):
        return config
    try:
        return EnvConfig.model_validate(config or {})
    except ValidationError as e:
        raise EnvError(f"bad env config: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from e


class EnvPool:
    """Thread-safe sessions with a time-to-live and a maximum count."""

    def __init__(
        self,
        max_sessions: int = 1024,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        max_image_size: int = 1024,
        games_roots: Sequence[Path] | None = None,
    ) -> None:
        self.max_sessions = max_sessions
        # Where ALFWorld games a session names may lie; None (in process) trusts the caller.
        self.games_roots = list(games_roots) if games_roots is not None else None
        self.ttl_s = ttl_s
        self.max_image_size = max_image_size  # each session holds a few frames of this side
        self._clock = clock
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        # Names this pool (GET /healthz): a policy service that hosts a pool in its own process
        # shows it in /stats, so a controller can tell its envs are stepped there.
        self.pool_id = uuid.uuid4().hex

    def __len__(self) -> int:
        with self._lock:
            self._evict_expired()
            return len(self._sessions)

    def create(
        self, task: str, config: EnvConfig | dict[str, Any] | None = None, seed: int | None = None
    ) -> str:
        """A new session (no episode yet: call ``reset``); returns its id."""
        if task not in TASKS:
            raise EnvError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise EnvError(f"seed must be a non-negative integer, not {seed!r}")
        cfg = self._confine_games(task, as_config(config))
        if cfg.image_size > self.max_image_size:
            raise EnvError(
                f"image_size {cfg.image_size} is over this service's limit of "
                f"{self.max_image_size} (GTR_ENV_MAX_IMAGE_SIZE)"
            )
        with self._lock:
            self._evict_expired()
            if len(self._sessions) >= self.max_sessions:
                raise PoolFull(self._full())
        try:
            env = make_env(task, cfg, seed)
        except OSError as e:  # a name too long, a file it may not read: no path, no errno
            raise EnvError("env.options.games: the games could not be read") from e
        except (ValueError, KeyError, ImportError) as e:
            raise EnvError(str(e)) from e
        session = _Session(env, task, cfg, seed, np.random.default_rng(seed), self._clock())
        sid = uuid.uuid4().hex
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise PoolFull(self._full())
            self._sessions[sid] = session
        return sid

    def _confine_games(self, task: str, cfg: EnvConfig) -> EnvConfig:
        """ALFWorld's games folders resolved under ``games_roots``; one answer for absent and
        not allowed (shared.paths.GAMES_NOT_FOUND)."""
        games = cfg.options.get("games")
        if task != "alfworld" or self.games_roots is None or games is None:
            return cfg
        confined = confined_games(games, self.games_roots)
        if confined is None:
            raise EnvError(f"env.options.games: {GAMES_NOT_FOUND}")
        return cfg.model_copy(update={"options": {**cfg.options, "games": confined}})

    def reset(self, session_id: str, options: dict[str, Any] | None = None) -> Observation:
        """Start a new episode (the first one uses the session's seed); ``options`` fix a deal
        (ALFWorld: ``game``, an index of the session's games or a game file, confined like
        ``games``). An error names the option, never the path or the OS's reason."""
        s = self._get(session_id)
        options = self._confine_game(s.task, options)
        with s.lock:
            try:
                return self._reset(s, options)
            except OSError as e:
                raise EnvError("options.game: the game could not be loaded") from e
            except (ValueError, LookupError, TypeError) as e:
                if s.task == "alfworld":
                    raise EnvError(f"options.game: {GAME_OPTION}") from e
                raise EnvError(f"bad reset options: {e}") from e

    def _confine_game(self, task: str, options: dict[str, Any] | None) -> dict[str, Any] | None:
        """ALFWorld's ``game`` reset option: an index, or a game file under ``games_roots``
        (resolved; one answer for absent and not allowed)."""
        game = (options or {}).get("game")
        if task != "alfworld" or self.games_roots is None or game is None or options is None:
            return options
        if isinstance(game, int) and not isinstance(game, bool):
            return options
        confined = confined_games(game, self.games_roots) if isinstance(game, str) else None
        if confined is None:
            raise EnvError(f"options.game: {GAMES_NOT_FOUND}")
        return {**options, "game": confined}

    def step(self, session_id: str, output_text: str) -> StepResult:
        """Parse the agent's output, act, and auto-reset when the episode ends."""
        s = self._get(session_id)
        with s.lock:
            return self._step(s, output_text)

    def step_batch(self, items: Sequence[tuple[str, str]]) -> list[StepResult]:
        """Step many sessions; every id is checked before any of them steps."""
        sessions = [self._get(sid) for sid, _ in items]
        results = []
        for s, (_, text) in zip(sessions, items, strict=True):
            with s.lock:
                results.append(self._step(s, text))
        return results

    def close(self, session_id: str) -> None:
        """Drop a session."""
        with self._lock:
            s = self._sessions.pop(session_id, None)
        if s is None:
            raise SessionNotFound(f"unknown session {session_id}")
        s.env.close()

    def describe(self, session_id: str) -> dict[str, Any]:
        """Task, seed, config, episode count and current action names of a session."""
        s = self._get(session_id)
        return {
            "task": s.task,
            "seed": s.seed,
            "config": s.config.model_dump(),
            "episodes": s.episodes,
            "action_names": list(s.env.unwrapped.action_names),
        }

    def set_target_formula(self, session_id: str, formula: str) -> None:
        """Points games: remember the corrector's target formula for the current episode."""
        s = self._get(session_id)
        setter = getattr(s.env.unwrapped, "set_target_formula", None)
        if setter is None:
            raise EnvError(f"task {s.task!r} has no target formula")
        with s.lock:
            setter(formula)

    # ---- internals ----------------------------------------------------------------------------

    def _get(self, session_id: str) -> _Session:
        with self._lock:
            self._evict_expired()
            s = self._sessions.get(session_id)
            if s is None:
                raise SessionNotFound(f"unknown session {session_id}")
            s.last_used = self._clock()
            return s

    def _full(self) -> str:
        # A run holds num_envs sessions, and its evaluations eval_episodes more meanwhile.
        return (
            f"the env pool is full ({self.max_sessions} sessions): close sessions, or serve "
            "more (GTR_ENV_MAX_SESSIONS, gtr env serve --max-sessions)"
        )

    def _evict_expired(self) -> None:
        now = self._clock()
        for sid in [k for k, s in self._sessions.items() if now - s.last_used > self.ttl_s]:
            self._sessions.pop(sid).env.close()

    def _observe(self, s: _Session, image: np.ndarray) -> Observation:
        u = s.env.unwrapped
        size, display = s.config.display_size or 0, None
        if size > image.shape[0] and hasattr(u, "display"):
            display = display_png(u.display(size))
        return Observation(image=image, prompt=u.prompt(), state=u.state(), display_png=display)

    def _reset(self, s: _Session, options: dict[str, Any] | None = None) -> Observation:
        image, _ = s.env.reset(options=options)
        s.started, s.episode_return, s.episode_length = True, 0.0, 0
        s.episodes += 1
        return self._observe(s, image)

    def _step(self, s: _Session, text: str) -> StepResult:
        if not s.started:
            raise EpisodeNotStarted("reset the session before stepping it")
        u = s.env.unwrapped
        parsed = u.parse(text)
        action = parsed.action
        if action is None and s.config.invalid_action == "noop" and hasattr(u, "noop"):
            image, reward, terminated, truncated, info = u.noop()
            name = None
        else:
            if action is None:
                action = (
                    u.random_action()
                    if hasattr(u, "random_action")
                    else int(s.rng.integers(len(u.action_names)))
                )
            name = u.action_names[action]
            image, reward, terminated, truncated, info = s.env.step(action)
        s.episode_return += float(reward)
        s.episode_length += 1
        done = bool(terminated or truncated)
        result = StepResult(
            observation=self._observe(s, image),
            reward=float(reward),
            terminated=bool(terminated),
            truncated=bool(truncated),
            done=done,
            parsed=parsed,
            action=name,
            episode_return=s.episode_return,
            episode_length=s.episode_length,
            success=None,
        )
        if done:
            won = info.get("won")
            result.success = bool(won) if won is not None else s.episode_return > 0
            result.final_state = result.observation.state
            result.observation = self._reset(s)
        return result
