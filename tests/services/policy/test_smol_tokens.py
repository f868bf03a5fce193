"""The real SmolLM2 tokenizer (49,152 BPE pieces, ChatML, EOS <|im_end|>) everywhere a run
reads tokens: thought/action spans and the λ-weighted log-prob, the JSON parser on what the
model writes, the corrector's prompt and its corrected thought tokenized back, `"}` and EOS.
The model is the ``smol_dir`` fixture: a 2-layer slice of the real weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.corrector.oracle import OracleCorrector
from services.corrector.prompts import user_prompt
from services.env.expert import expert_output, format_output
from services.env.prompts import OUTPUT_KEYS
from services.env.registry import make_env
from services.policy.scoring import generation_of
from services.policy.service import Policy
from services.trainer import algos
from services.trainer.buffer import build_target
from services.trainer.service import encode_target
from shared.schemas import CorrectionRequest


@pytest.fixture(scope="module")
def policy(smol_dir: Path) -> Policy:
    return Policy.load(smol_dir, finetune="lora", lora_r=4)


@pytest.fixture(scope="module")
def state() -> tuple[Any, Any, str]:
    """An EZPoints observation, its env and the oracle's output for it."""
    env = make_env("ezpoints", None, seed=3)
    obs, _ = env.reset()
    u: Any = env.unwrapped
    return env, obs, format_output(expert_output("ezpoints", u.state()))


def _text(policy: Policy, ids: list[int]) -> str:
    return policy.tokenizer.decode(ids, skip_special_tokens=True)


def test_spans_split_the_oracle_output_at_the_action_key(
    policy: Policy, state: tuple[Any, Any, str]
) -> None:
    _, _, text = state
    ids = policy.encode_response(text)
    assert ids[-1] == policy.eos_id and _text(policy, ids) == text
    thought, action = policy.spans(ids)
    t_ids = [i for i, m in zip(ids, thought, strict=True) if m]
    a_ids = [i for i, m in zip(ids, action, strict=True) if m]
    cut = text.rfind(' "action":')
    assert _text(policy, t_ids) == text[:cut]  # ... "thoughts": "...",
    assert _text(policy, a_ids) == text[cut:]  # "action": "x"}
    assert t_ids + a_ids == ids[:-1]  # every token but EOS, in order
    assert not thought[-1] and not action[-1]  # EOS in neither span
    # `"}` is one token of this vocabulary, the action's last.
    closing = policy.tokenizer.convert_tokens_to_ids('"}')
    assert a_ids[-1] == closing and policy.tokenizer.decode([closing]) == '"}'


def test_the_lambda_weighted_logprob_reads_score_of_a_sampled_response(
    policy: Policy, state: tuple[Any, Any, str]
) -> None:
    env, obs, text = state
    prompt = env.unwrapped.prompt()
    gen = policy.generate([obs], [prompt], max_new_tokens=12, seed=1)[0]
    # score reproduces the sampled tokens' log-probs over the 49k vocabulary exactly.
    got = policy.score([obs], [prompt], [gen.token_ids])
    n = len(gen.token_ids)
    assert torch.allclose(got.logprobs[0, :n], torch.tensor(gen.logprobs), atol=1e-4)
    # λ·Σ thought + Σ action on the oracle output, EOS in neither.
    ids = policy.encode_response(text)
    out = policy.score([obs], [prompt], [ids])
    lp = out.logprobs[0]
    thought, action = (torch.tensor(m)[None] for m in policy.spans(ids))
    eos = torch.tensor([[i == policy.eos_id for i in ids]])
    seq = algos.sequence_logprob(lp[None], thought, action, 0.5, eos)
    want = 0.5 * lp[thought[0]].sum() + lp[action[0]].sum()
    assert torch.allclose(seq[0], want) and lp[-1] < 0  # EOS has a log-prob, left out
    assert thought.sum() + action.sum() == len(ids) - 1


def test_the_parser_reads_what_the_model_writes(
    policy: Policy, state: tuple[Any, Any, str]
) -> None:
    env, obs, text = state
    u: Any = env.unwrapped
    # The oracle's output as tokens, decoded as a Generation decodes them: a valid action.
    ids = policy.encode_response(text)
    gen = generation_of(
        policy.tokenizer, policy.eos_id, ids, torch.zeros(len(ids)), torch.zeros(len(ids)), 0.0
    )
    parsed = u.parse(gen.text)
    assert (
        parsed.format_valid and parsed.action_text == expert_output("ezpoints", u.state())["action"]
    )
    # What an instruct model likes to write: JSON in a Markdown fence, after a sentence. Not the
    # format, but the action is still read (the reference's projection).
    fenced = f"Sure! Here is my move:\n```json\n{text}\n```"
    back = _text(policy, policy.encode_response(fenced))
    assert back == fenced
    loose = u.parse(back)
    assert not loose.format_valid and loose.action_valid
    # The slice's own samples (English word pieces, no format yet) parse without raising.
    for g in policy.generate([obs] * 2, [u.prompt()] * 2, max_new_tokens=16, seed=2):
        assert g.text == _text(policy, g.token_ids)
        assert u.parse(g.text).format_valid is False


def test_corrector_prompt_and_corrected_thought_tokenized_back(
    policy: Policy, state: tuple[Any, Any, str]
) -> None:
    env, obs, text = state
    u: Any = env.unwrapped
    st = u.state()
    # The agent wrote the format with a wrong reading and thought.
    ideal = expert_output("ezpoints", st)
    bad = "I think the cards add up to 99, so " + ideal["thoughts"]
    wrong = format_output({**ideal, "cards": [1, 1], "thoughts": bad})
    agent = _text(policy, policy.encode_response(wrong))
    parsed = u.parse(agent)
    assert parsed.format_valid
    prompt = user_prompt("ezpoints", parsed.thought or "", list(OUTPUT_KEYS["ezpoints"]), "", None)
    assert f"[Thought] {parsed.thought}" in prompt and "add up to 99" in prompt
    correction = OracleCorrector().correct(
        CorrectionRequest(task="ezpoints", prompt=u.prompt(), output=agent, state=st)
    )
    assert correction.verdict == "incorrect" and correction.corrected_thought
    # GTR's target: the corrected fields with the agent's own action, left unsupervised.
    target, span = build_target(correction.corrected_thought, parsed.action_text or "")
    ids, mask = encode_target(policy, target, span)
    assert _text(policy, ids) == target and ids[-1] == policy.eos_id and mask[-1] == 1
    masked = [i for i, m in zip(ids, mask, strict=True) if not m]
    # The action value's tokens: with this vocabulary ` "x` and `"}` (the closing quote and
    # brace are one piece), so `"}` is left out with the value and EOS stays supervised.
    assert _text(policy, masked) == target[span[0] - 1 :]
    kept = _text(policy, [i for i, m in zip(ids, mask, strict=True) if m])
    assert kept == target[: span[0] - 1] and "add up to 99" not in kept
    assert f'"thoughts": "{ideal["thoughts"]}"' in kept  # the English thought, verbatim


def test_generation_stops_at_eos_and_never_samples_specials(policy: Policy) -> None:
    tok = policy.tokenizer
    body = tok.encode('{"action": "+"}', add_special_tokens=False)
    row = [*body, policy.eos_id, *body]  # what a batch row holds after its EOS
    n = len(row)
    gen = generation_of(tok, policy.eos_id, row, torch.zeros(n), torch.zeros(n), 0.0)
    assert gen.token_ids == [*body, policy.eos_id] and gen.text == '{"action": "+"}'
    assert gen.action_mask[-2] and not gen.action_mask[-1]  # `"}` in, EOS out
    specials = {tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|endoftext|>")}
    assert specials <= set(policy.suppress_ids) and policy.eos_id not in policy.suppress_ids
