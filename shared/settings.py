"""Service settings, read from the environment (prefix ``GTR_``) or a ``.env`` file.

With no settings at all this is the *embedded default*: SQLite and folders under ``./gtr-data``,
no Redis, everything in one process.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEV_SECRET = "dev-insecure-secret-change-me"
DEV_SERVICE_TOKEN = "dev-insecure-service-token-change-me"
MIN_SECRET_CHARS = 32  # production: GTR_SECRET_KEY and GTR_SERVICE_TOKEN at least this long


# Where a policy service that hosts envs (``policy_hosts_envs``) serves the env service's routes.
HOSTED_ENVS = "/env"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GTR_", env_file=".env", extra="ignore")

    environment: str = Field(
        "development", description="development | production; production refuses default secrets"
    )
    data_dir: Path = Field(
        Path("gtr-data"), description="Root folder for the SQLite file, blobs and checkpoints"
    )
    database_url: str | None = Field(None, description="SQLAlchemy URL; unset = SQLite in data_dir")
    redis_url: str | None = Field(
        None, description="Redis URL for Celery; unset = embedded mode (no queues)"
    )
    blob_dir: Path | None = Field(
        None, description="Content-addressed blob folder; unset = data_dir/blobs"
    )
    checkpoint_dir: Path | None = Field(
        None, description="Checkpoint folder; unset = data_dir/checkpoints"
    )
    model_dir: Path | None = Field(
        None, description="Where tiny models are built; unset = data_dir/models"
    )
    secret_key: SecretStr = Field(
        SecretStr(DEV_SECRET), description="Encrypts corrector API keys at rest"
    )
    env_service_url: str | None = Field(
        None, description="Env service base URL; unset = in-process EnvPool"
    )
    policy_service_url: str | None = Field(
        None, description="Policy service base URL; unset = in-process Policy"
    )
    policy_steps_envs: bool = Field(
        True,
        description="Let the policy service step the envs of a rollout (POST /rollout) when it "
        "serves the controller's env service: one round trip a rollout step instead of two "
        "(docs/benchmarks.md); false = a generate and an env step request each",
    )
    policy_hosts_envs: bool = Field(
        False,
        description="The policy service also serves the env service's routes under /env, over "
        "a pool in its own process, and POST /rollout steps that pool in process: no service "
        "hop a rollout step (cheap envs such as gym_cards; ALFWorld's belong in an env service "
        "of their own). Point the controller's GTR_ENV_SERVICE_URL at <policy URL>/env",
    )
    corrector_url_allowlist: list[str] = Field(
        default_factory=list, description="If set, corrector base URLs must use one of these hosts"
    )
    corrector_allow_private_networks: bool = Field(
        False,
        description="Let corrector calls reach loopback, private, link-local and metadata "
        "addresses (a corrector on the same host or LAN); off = public addresses only",
    )
    service_token: SecretStr | None = Field(
        None,
        description="Bearer token the env, policy and corrector services require and their "
        "clients send; unset = open (development only)",
    )
    model_roots: list[Path] = Field(
        default_factory=list,
        description="Folders besides model_dir under which a run's model.path may lie",
    )
    checkpoint_roots: list[Path] = Field(
        default_factory=list,
        description="Folders besides checkpoint_dir under which init.checkpoint may lie",
    )
    games_roots: list[Path] = Field(
        default_factory=list,
        description="Folders besides data_dir/games under which a run's or an env session's "
        "ALFWorld env.options.games may lie (the ALFWorld data set's folder, e.g.)",
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="Addresses or networks of reverse proxies whose X-Forwarded-For/-Proto the "
        "servers believe; none = the peer's own address is the client's (rate limits)",
    )
    env_max_sessions: int = Field(256, ge=1, description="Env service: most sessions at once")
    env_max_image_size: int = Field(
        512, ge=32, le=1024, description="Env service: largest image_size a session may ask for"
    )
    env_session_ttl_s: float = Field(
        900.0, gt=0, description="Env service: idle seconds before a session is dropped"
    )
    auth_failures_per_minute: int = Field(
        20,
        ge=0,
        description="Failed logins / wrong tokens per client address and minute before 429 "
        "(0 = off)",
    )
    api_rate_limit_per_minute: int = Field(
        600, description="Requests per minute per token on the REST API (0 = off)"
    )
    log_level: str = Field("INFO", description="Python logging level for every service")
    log_format: str = Field(
        "text", description="text | json: one JSON object per log line, with the run id"
    )
    cache_dir: Path | None = Field(
        None, description="Warm-start checkpoint cache; unset = data_dir/cache"
    )
    warmstart_cache: bool = Field(
        True, description="Reuse a cached warm start whose recipe, model, task and seed match"
    )
    tracking_tensorboard: bool = Field(
        False, description="Default of [tracking] tensorboard: event files under the run's folder"
    )
    tracking_wandb: bool = Field(False, description="Default of [tracking] wandb")
    tracking_wandb_mode: str = Field(
        "offline", description="W&B mode: offline (no network; `wandb sync` later) or online"
    )
    tracking_wandb_project: str = Field("gtr-lab", description="Default W&B project")
    tracking_mlflow: bool = Field(False, description="Default of [tracking] mlflow")
    tracking_mlflow_uri: str | None = Field(
        None, description="MLflow tracking URI; unset = a local mlruns folder in data_dir"
    )
    tracking_mlflow_experiment: str = Field("gtr-lab", description="Default MLflow experiment")
    outage_s: float = Field(
        300.0,
        description="How long a run waits for an env/policy service or Redis that went away",
    )
    max_interruptions: int = Field(
        5, description="Outages in a row (no update trained between them) that end a run failed"
    )
    trainer_lost_after_s: float = Field(
        30.0,
        description="A trainer task neither queued nor beating for this long is sent again",
    )

    @property
    def is_production(self) -> bool:
        """Any spelling of production ('Production', ' PROD ') counts: a typo must not relax."""
        return self.environment.strip().lower() in ("production", "prod")

    @model_validator(mode="after")
    def _refuse_default_secret_in_production(self) -> Settings:
        if not self.is_production:
            return self
        secret = self.secret_key.get_secret_value()
        if secret == DEV_SECRET or len(secret.strip()) < MIN_SECRET_CHARS:
            raise ValueError(
                f"GTR_SECRET_KEY must be set (at least {MIN_SECRET_CHARS} characters, e.g. "
                "openssl rand -hex 32) when GTR_ENVIRONMENT=production"
            )
        token = self.service_token.get_secret_value() if self.service_token else ""
        if token == DEV_SERVICE_TOKEN or len(token.strip()) < MIN_SECRET_CHARS:
            raise ValueError(
                f"GTR_SERVICE_TOKEN must be set (at least {MIN_SECRET_CHARS} characters, e.g. "
                "openssl rand -hex 32) when GTR_ENVIRONMENT=production"
            )
        return self

    @property
    def service_token_value(self) -> str | None:
        """The service token in clear (for the Authorization header), or None when unset."""
        value = self.service_token.get_secret_value() if self.service_token else ""
        return value or None

    @property
    def db_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'gtr.sqlite3').resolve()}"

    @property
    def blobs_path(self) -> Path:
        return self.blob_dir or self.data_dir / "blobs"

    @property
    def checkpoints_path(self) -> Path:
        return self.checkpoint_dir or self.data_dir / "checkpoints"

    @property
    def models_path(self) -> Path:
        return self.model_dir or self.data_dir / "models"

    @property
    def cache_path(self) -> Path:
        return self.cache_dir or self.data_dir / "cache"

    @property
    def games_paths(self) -> list[Path]:
        """Where ALFWorld games named by a run or an env session may lie."""
        return [self.data_dir / "games", *self.games_roots]

    def uvicorn_proxy_options(self) -> dict[str, Any]:
        """uvicorn's trust in proxy headers: only from GTR_TRUSTED_PROXIES. Left alone, uvicorn
        believes X-Forwarded-For from 127.0.0.1, so anything on the host picks its address."""
        if not self.trusted_proxies:
            return {"proxy_headers": False}
        return {"proxy_headers": True, "forwarded_allow_ips": list(self.trusted_proxies)}


@lru_cache
def get_settings() -> Settings:
    return Settings()


def settings_errors(e: ValidationError) -> str:
    """What is wrong with the settings, each by its variable: ``GTR_X: why; ...`` (a check of
    the whole set, such as production's secrets, has no one variable)."""
    parts = []
    for err in e.errors():
        why = str(err.get("msg", "")).removeprefix("Value error, ")
        loc = err.get("loc") or ()
        parts.append(f"GTR_{str(loc[0]).upper()}: {why}" if loc else why)
    return "; ".join(parts)
