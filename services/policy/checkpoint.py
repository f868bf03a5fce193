"""Policy checkpoints: LoRA adapter or full weights, value head, optional vision weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

if TYPE_CHECKING:
    from services.policy.service import Policy

CHECKPOINT_KIND = "gtr-policy"
VALUE_HEAD = "value_head.safetensors"
VISION = "vision.safetensors"
ADAPTER = "adapter_model.safetensors"
FULL = "model.safetensors"


def save_policy(policy: Policy, directory: Path) -> Path:
    """Write the policy's trainable state into `directory` (created if missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    if policy.lora is not None:
        policy.model.save_pretrained(directory)  # adapter_model.safetensors + adapter_config.json
        if policy.vision_in_checkpoint:
            vision = {k: p.detach().contiguous().cpu() for k, p in policy.vision_named_parameters()}
            save_file(vision, directory / VISION)
    else:
        save_model(policy.model, str(directory / FULL))  # handles tied weights
    head = {k: v.detach().contiguous().cpu() for k, v in policy.value_head.state_dict().items()}
    save_file(head, directory / VALUE_HEAD)
    meta = {
        "kind": CHECKPOINT_KIND,
        "version": 1,
        "finetune": policy.finetune,
        "lora": policy.lora,
        "base_model": str(policy.model_path),
        "model_type": policy.model_type,
        "vision": policy.lora is not None and policy.vision_in_checkpoint,
        "value_head": policy.value_kind,
    }
    (directory / "policy.json").write_text(json.dumps(meta, indent=2))
    return directory


def load_policy_weights(policy: Policy, directory: Path, value_head: bool = True) -> None:
    """Load a checkpoint written by `save_policy` into `policy` (same fine-tuning mode).

    value_head=False keeps the policy's own head (a run starting from another run's checkpoint
    with another value-head kind)."""
    meta = read_checkpoint_meta(directory)
    if meta["finetune"] != policy.finetune:
        raise ValueError(f"checkpoint is {meta['finetune']} but the policy is {policy.finetune}")
    if policy.lora is not None:
        if meta["lora"]["r"] != policy.lora["r"]:
            raise ValueError(
                f"checkpoint LoRA rank {meta['lora']['r']} != policy's {policy.lora['r']}"
            )
        _load_adapter(policy, directory)
        if meta.get("vision"):
            _load_named(policy, load_file(str(directory / VISION)))
            policy.vision_in_checkpoint = True  # saved again with every later checkpoint
    else:
        load_model(policy.model, str(directory / FULL), device=str(policy.device))
    if not value_head:
        return
    kind = meta.get("value_head", "linear")
    if kind != policy.value_kind:
        raise ValueError(
            f"checkpoint value head is {kind!r} but the policy's is {policy.value_kind!r}"
        )
    head = load_file(str(directory / VALUE_HEAD))
    policy.value_head.load_state_dict({k: v.to(policy.device) for k, v in head.items()})


def _load_adapter(policy: Policy, directory: Path) -> None:
    from peft import set_peft_model_state_dict

    state = load_file(str(directory / ADAPTER), device=str(policy.device))
    result: Any = set_peft_model_state_dict(policy.model, state)
    missing_lora = [k for k in result.missing_keys if "lora_" in k]
    if missing_lora:
        raise ValueError(
            f"adapter in {directory} lacks {len(missing_lora)} LoRA weights, e.g. {missing_lora[0]}"
        )


def _load_named(policy: Policy, state: dict[str, torch.Tensor]) -> None:
    params = dict(policy.vision_named_parameters())
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor.to(params[name].dtype))


def policy_kwargs(meta: dict[str, Any]) -> dict[str, Any]:
    """`Policy.load` arguments that rebuild the policy a checkpoint's policy.json describes."""
    lora = meta.get("lora") or {}
    out: dict[str, Any] = {
        "finetune": meta["finetune"],
        "lora_r": lora.get("r", 16),
        "lora_alpha": lora.get("alpha", 32),
        "lora_dropout": lora.get("dropout", 0.0),
        "lora_targets": lora.get("targets", "attention"),
        "value_head": meta.get("value_head", "linear"),
    }
    if "target_modules" in lora:
        out["lora_target_modules"] = lora["target_modules"]
    return out


def read_checkpoint_meta(directory: str | Path) -> dict[str, Any]:
    """The policy.json of a saved checkpoint (what it is: finetune, LoRA settings, base model)."""
    meta_path = Path(directory) / "policy.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{directory} is not a policy checkpoint (no policy.json)")
    meta: dict[str, Any] = json.loads(meta_path.read_text())
    if meta.get("kind") != CHECKPOINT_KIND:
        raise ValueError(f"{meta_path} is not a {CHECKPOINT_KIND} checkpoint")
    return meta
