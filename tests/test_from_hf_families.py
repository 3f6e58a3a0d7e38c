"""GLM-4.5 from a Hugging Face checkpoint to a real CPU SGLang engine and back (issue 31); Mixtral's
is ``tests/rollout/test_multi_rank_engines.py`` (two TP=2 engines, from :func:`make_tiny`).

The test saves a tiny random checkpoint of the family (float32, the in-repo tokenizer, no
download) and starts real Ray, Megatron actor workers and a CPU SGLang engine from it with
``actor.init_from`` (no ``model`` key: the shape comes from its ``config.json``). The engine
starts from random weights (``load_format=dummy``), so its first logprobs come from the actor's
first weight sync, through SGLang's own model class (``glm4_moe``, ``mixtral``). Checked:

* GLM-4.5 (``Glm4MoeForCausalLM``: sigmoid router with expert bias in 4 groups / top-2 groups,
  score scaling, an ungated shared expert, a dense first layer, RoPE on half of each head, q/k/v
  biases) trains 2 RL steps as ``sao train`` runs them (SAO's default GAE, so a critic too) on
  ``longtail`` (a coin reward of the actions' text, so a random model earns some) with a random
  value head (advantages never all zero): engine logprobs == actor logprobs at version 0 and after
  the last sync, the trained actor has moved away from the version-0 engine (so the last sync
  carried new weights), and the engine serves the trainer's expert bias
  (``actor.router_bias_update``'s default, ``freeze``): its version-0 logprobs equal
  transformers', and transformers with the expert bias zeroed is far from them;

Every weight name, shape and value the syncs send is covered per family at every layout in
``tests/models/test_hf_families.py``; here the receiving end is SGLang itself.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from sao_megatron.config import load_config
from sao_megatron.driver import stages
from sao_megatron.driver.run_state import RunState
from sao_megatron.driver.session import Session
from sao_megatron.observe import RunLog
from sao_megatron.pipeline import run_stage
from sao_megatron.rollout.client import SamplingParams
from sao_megatron.tokenizer import load_tokenizer
from tests.test_pipeline import actor_logprobs, engine_vs_actor

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

STEPS = 2
TOL = 1e-4
"""Engine vs actor logprobs (float32 on both sides, different kernels): issue 31's acceptance bound."""
RUN = [
    "rollout.dtype=float32",
    "algo.batch_size=4",
    "algo.critic_warmup_steps=0",
    "algo.max_policy_lag=null",
    "rollout.max_concurrent=8",
    "rollout.loop.max_new_tokens=8",
    "train.eval_prompts=0",
    "train.eval_every=0",
    "train.sft_steps=0",
    "train.value_pretrain_steps=0",
    "train.sample_trajectories=0",
    f"train.steps={STEPS}",
]
_SHAPE: dict[str, Any] = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def _randomize(model: torch.nn.Module) -> None:
    """tests/models/hf_cases.py's initialisation: decisive routing, visible biases, a random expert bias."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            elif name.endswith("proj.bias"):
                p.normal_(0.0, 0.3)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer: zero unless set (routing must use it)
                b.normal_(0.0, 0.3)


def make_tiny(family: str, out_dir: Path, seed: int = 0) -> torch.nn.Module:
    """A tiny ``family`` (``glm4_moe`` or ``mixtral``) on the in-repo tokenizer, saved with it."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, MixtralConfig, MixtralForCausalLM

    tok = load_tokenizer()
    common: dict[str, Any] = dict(
        _SHAPE,
        vocab_size=len(tok),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    if family == "glm4_moe":
        config = Glm4MoeConfig(
            **common,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5},
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            n_shared_experts=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            attention_bias=True,
            num_hidden_layers=2,
        )
        cls = Glm4MoeForCausalLM
    else:
        config = MixtralConfig(
            **common,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            intermediate_size=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
        )
        cls = MixtralForCausalLM
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    _randomize(model)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return model


def config(tmp_path: Path, hf: Path, extra: list[str]):
    """configs/tiny_cpu.yaml without its 'model' line, ``actor.init_from`` = ``hf``."""
    run_file = tmp_path / "run.yaml"
    lines = (Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml").read_text().splitlines()
    run_file.write_text("\n".join(line for line in lines if not line.startswith("model:")) + "\n")
    return load_config(run_file, [*RUN, *extra, f"actor.init_from={hf}"])


def _probe() -> list[int]:
    tok = load_tokenizer()
    return [int(i) for i in tok.encode("12 + 30 =")]


def _hf_logprobs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """transformers' logprobs of ``response`` after ``prompt``."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    lp = torch.log_softmax(logits[0, len(prompt) - 1 : -1], -1)
    return lp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_glm45_trains_two_steps_and_the_engine_serves_the_actor(tmp_path):
    hf = tmp_path / "glm_tiny"
    model = make_tiny("glm4_moe", hf)
    # longtail (fixed 8-token actions, a coin reward) and a random value head: nonzero advantages.
    cfg = config(
        tmp_path,
        hf,
        [
            "rollout.env=longtail",
            "rollout.env_kwargs={seed: 0}",
            "rollout.task_kwargs={turns_median: 1, tokens_median: 8, max_tokens: 8}",
            "critic.value_head_init=normal",
            "actor.optim.lr=1.0e-3",
        ],
    )
    assert cfg.model.moe_router_score_function == "sigmoid" and cfg.model.moe_router_enable_expert_bias
    assert cfg.actor.router_bias_update == "freeze"
    run_dir = tmp_path / "run"
    probe = _probe()

    async def go():
        state = RunState(stage="rl")
        log = RunLog(run_dir, tensorboard=False, console=False)
        session = await Session.start(cfg, run_dir, state)
        try:
            assert session.critic is not None  # SAO's GAE: the critic trains beside the actor
            await session.start_rollouts(state.version)
            before = await engine_vs_actor(session, probe)
            gen = await session.clients[0].generate(probe, SamplingParams(max_new_tokens=12, seed=3))
            await run_stage(session, state, log, stages.rl(cfg, True))
            after = await engine_vs_actor(session, probe)
            trained, _ = await actor_logprobs(session, probe, gen)
            return state, before, after, gen, trained
        finally:
            await session.shutdown()

    state, before, after, gen, trained = asyncio.run(go())
    moved = (trained - torch.tensor(gen.behavior_logprobs)).abs().max().item()
    print(
        f"GLM-4.5 engine vs actor: v0 {before[0]:.2e} ({before[1]} tokens), v{STEPS} {after[0]:.2e}; "
        f"the trained actor vs the v0 engine: {moved:.2e}"
    )
    assert before[1] > 0 and before[0] <= TOL and before[2] == {"0"}, before
    assert after[1] > 0 and after[0] <= TOL and after[2] == {str(STEPS)}, after
    assert state.version == STEPS and state.step == STEPS
    assert moved > 10 * TOL, "training did not move the policy: the last sync would prove nothing"
    # The engine serves the checkpoint's expert bias (frozen in training): its version-0 logprobs
    # equal transformers' with the bias, and the bias moves them well beyond TOL (it changes which
    # experts are picked, not their weights: a few tokens route differently).
    served = torch.tensor(gen.behavior_logprobs)
    with_bias = _hf_logprobs(model, probe, gen.output_ids)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
    without_bias = _hf_logprobs(model, probe, gen.output_ids)
    print(
        f"engine vs transformers: {(served - with_bias).abs().max():.2e}, "
        f"vs transformers without the expert bias: {(served - without_bias).abs().max():.2e}"
    )
    assert (served - with_bias).abs().max() <= TOL
    assert (served - without_bias).abs().max() > 10 * TOL
