"""The SAO loop from a Hugging Face checkpoint on the real Qwen3 vocabulary and chat template.

A tiny random Qwen3-MoE (float32) is saved with ``save_pretrained`` next to Qwen3's real
tokenizer files; ``actor.init_from`` points at it with no ``model`` key (the shape comes from
its ``config.json``). Real Ray, Megatron actor/critic workers and a CPU SGLang engine run a few
RL steps on ``math_python`` (its tool is a JSON schema: native ``<tool_call>`` format). The actor
runs two pipeline stages, so every weight sync has two senders, each broadcasting its own
stage's buckets over its own group, each bucket as one flat buffer (``rollout.weight_sync_flat``;
the other end-to-end tests send tensor by tensor). Checked:

* engine logprobs == actor logprobs at version 0 (the engine started from random weights: the
  first sync), on a probe and on the first trained batch, and after the last sync;
* each stage's rank sent its stage over a group of its own (the actor ranks' logs);
* token-in/token-out on every turn: the first prompt is ``apply_chat_template(messages,
  tools=..., add_generation_prompt=True)``, each response is the generated action ids followed
  by the template's rendering of the tool result (replayed through a fresh environment);
* versions advance, nothing is trained twice;
* the exported actor loads in ``transformers`` and its logprobs equal the actor's.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from sao_megatron import pipeline
from sao_megatron.batch import build_batch
from sao_megatron.config import load_config
from sao_megatron.driver import stages
from sao_megatron.driver.run_state import RunState
from sao_megatron.driver.session import Session
from sao_megatron.envs.format import ChatFormat, escape_specials, tool_format_of
from sao_megatron.envs.registry import make_env
from sao_megatron.observe import RunLog, read_metrics
from sao_megatron.pipeline import run_stage
from sao_megatron.records import OBSERVATION_VERSION, Trajectory
from sao_megatron.tokenizer import load_tokenizer
from tests.test_pipeline import engine_vs_actor

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]

STEPS = 3
QWEN3_VOCAB = 151936  # Qwen3's embedding rows (the tokenizer's 151,669 ids padded up)
RUN = [
    "rollout.env=math_python",
    "rollout.dtype=float32",
    "algo.batch_size=4",
    "algo.critic_warmup_steps=0",
    "algo.max_policy_lag=null",
    "rollout.max_concurrent=8",
    "rollout.loop.max_turns=2",
    "rollout.env_kwargs={max_turns: 2}",
    "rollout.loop.max_new_tokens=16",
    "rollout.loop.max_response_tokens=256",
    "rollout.loop.max_context_tokens=1024",
    "train.eval_prompts=0",
    "train.eval_every=0",
    "train.sft_steps=0",
    "train.value_pretrain_steps=0",
    "train.sample_trajectories=1",
    f"train.steps={STEPS}",
    "actor.parallel.world_size=2",
    "actor.parallel.pipeline_parallel=2",
    "rollout.weight_sync_flat=true",
]


def make_tiny_qwen3(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen3-MoE on the real Qwen3 vocabulary, saved with Qwen3's tokenizer files."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = load_tokenizer(tokenizer_dir)
    assert len(tok) <= QWEN3_VOCAB
    cfg = Qwen3MoeConfig(
        vocab_size=QWEN3_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
        # A random model never calls a tool, so every episode would end after one turn. A constant
        # component in every embedding plus a matching lm_head weight makes <tool_call> a likely
        # token (p ~ 0.25 at temperature 1): such an action is a malformed call, so the environment
        # answers with an error observation and the episode goes on to a second turn.
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight[tok.convert_tokens_to_ids("<tool_call>"), 0] = 3.0
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)  # tokenizer.json + tokenizer_config.json (with the chat template)
    return out_dir


def replay_turns(t: Trajectory, session: Session, cfg) -> int:
    """Check ``t`` token for token against the chat template; the number of observations checked."""
    tok = session.tokenizer
    sample = session.task.get(t.split, t.sample_index or 0)
    env = make_env(cfg.rollout.env, **cfg.rollout.env_kwargs)
    env.use_tool_format(tool_format_of(tok.chat_template))
    question = env.reset(sample)
    assert env.tools, "math_python declares its tool as a JSON schema"
    messages = [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
    messages.append({"role": "user", "content": escape_specials(question)})
    expected = tok.apply_chat_template(
        messages, tools=env.tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert t.prompt_ids == [int(i) for i in expected], "first prompt != apply_chat_template(messages)"
    assert "<tools>" in tok.decode(t.prompt_ids), "the tool schema is not in the prompt"
    chat = ChatFormat(tok, tools=env.tools, system=env.system_prompt, enable_thinking=cfg.rollout.loop.enable_thinking)
    history = list(messages)
    cursor, observations = 0, 0
    for i, turn in enumerate(t.turns):
        assert turn.start == cursor, f"turn {i} starts at {turn.start}, the previous part ends at {cursor}"
        action = t.response_ids[turn.start : turn.end]
        assert action and t.action_mask[turn.start : turn.end] == [1] * len(action)
        assert all(v != OBSERVATION_VERSION for v in t.policy_versions[turn.start : turn.end])
        text = tok.decode(action, skip_special_tokens=False)
        step = env.step(text)
        cursor = turn.end
        last = i == len(t.turns) - 1
        if step.done:
            assert last and turn.end == len(t.response_ids)
            break
        history.append(chat.assistant_message(text))
        obs = chat.observation_ids(history, step.observation or "")
        end = t.turns[i + 1].start if not last else len(t.response_ids)
        assert t.response_ids[turn.end : end] == obs, f"observation after turn {i} != the template's rendering"
        assert t.action_mask[turn.end : end] == [0] * len(obs)
        history.append(chat.tool_message(step.observation or ""))
        observations += 1
        cursor = end
    assert cursor == len(t.response_ids), "response tokens beyond the actions and observations"
    return observations


def test_sao_from_an_hf_checkpoint_with_the_qwen3_template(tmp_path, qwen3_tokenizer_dir, monkeypatch):
    hf = make_tiny_qwen3(tmp_path / "qwen3_tiny", qwen3_tokenizer_dir)
    run_dir = tmp_path / "run"
    # configs/tiny_cpu.yaml without its 'model' line: the shape comes from the checkpoint's config.json
    run_file = tmp_path / "run.yaml"
    lines = (Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml").read_text().splitlines()
    run_file.write_text("\n".join(line for line in lines if not line.startswith("model:")) + "\n")
    cfg = load_config(run_file, [*RUN, f"actor.init_from={hf}"])
    assert cfg.model.vocab_size == QWEN3_VOCAB and cfg.model.num_experts == 4 and cfg.model.hidden_size == 64

    trained: list[tuple[int, list[Trajectory]]] = []  # (version trained at, batch)
    first_batch: dict[str, float] = {}
    real_step = pipeline.learner_step

    async def recording_step(s, estimator, trajectories, version, train_actor):
        if version == 0 and not first_batch:  # score the batch with the actor before it trains
            batch = build_batch(trajectories)
            actor = await s.actor.logprobs(batch)
            mask = (batch.action_mask > 0) & (batch.policy_versions == 0)
            first_batch["diff"] = (actor[mask] - batch.behavior_logprobs[mask]).abs().max().item()
            first_batch["tokens"] = int(mask.sum())
        trained.append((version, list(trajectories)))
        return await real_step(s, estimator, trajectories, version, train_actor)

    monkeypatch.setattr(pipeline, "learner_step", recording_step)

    async def go():
        state = RunState(stage="rl")
        log = RunLog(run_dir, tensorboard=False, console=False)
        session = await Session.start(cfg, run_dir, state)
        try:
            assert tool_format_of(session.tokenizer.chat_template) == "json"
            await session.start_rollouts(state.version)
            probe = session.tokenizer.apply_chat_template(
                [{"role": "user", "content": "What is 2 + 3?"}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            before = await engine_vs_actor(session, [int(i) for i in probe])
            await run_stage(session, state, log, stages.rl(cfg, session.critic is not None))
            after = await engine_vs_actor(session, [int(i) for i in probe])
            observations = sum(replay_turns(t, session, cfg) for _, batch in trained for t in batch)
            # (d) export; transformers' logprobs on a trained trajectory == the actor's
            export = tmp_path / "export"
            await session.actor.export_hf(export)
            probe_traj = max((t for _, b in trained for t in b), key=lambda t: len(t.response_ids))
            batch = build_batch([probe_traj])
            actor_lp = await session.actor.logprobs(batch)
            return state, before, after, observations, export, batch, actor_lp
        finally:
            await session.shutdown()

    state, before, after, observations, export, batch, actor_lp = asyncio.run(go())

    # (a) engine == actor on the same weights and tokens, at version 0 and after the syncs
    assert before[0] <= 1e-4 and before[2] == {"0"}, before
    assert after[0] <= 1e-4 and after[2] == {str(STEPS)}, after
    assert first_batch["tokens"] > 0 and first_batch["diff"] <= 1e-4, first_batch
    for rank in (0, 1):  # one sender per pipeline stage, each on its own group
        sent = (run_dir / "logs" / f"actor_rank{rank}.log").read_text()
        assert f"group sao_weight_sync_pp{rank} at 127.0.0.1:" in sent, sent[-2000:]
        assert f"(trainer rank {rank}, stage {rank})" in sent
    # (b) token-in/token-out: every trained trajectory replayed, multi-turn ones included
    assert observations > 0, "no trajectory had a tool-result turn"
    # (c) versions advance; nothing trained twice
    assert state.version == STEPS and state.step == STEPS
    assert [v for v, _ in trained] == list(range(STEPS))
    for version, b in trained:
        assert len(b) == 4 and all(max(t.policy_versions) <= version for t in b)
    keys = [tuple(k[1:]) for k in state.trained_prompts]
    assert len(keys) == 4 * STEPS and len(set(keys)) == len(keys), "a trajectory was trained twice"
    assert [r["policy_version"] for r in read_metrics(run_dir) if r["stage"] == "rl"] == [1.0, 2.0, 3.0]
    # (d) the export loads in transformers, with the tokenizer and chat template, and matches the actor
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert json.loads((export / "config.json").read_text())["vocab_size"] == QWEN3_VOCAB
    tok = AutoTokenizer.from_pretrained(export)
    assert len(tok) == len(load_tokenizer(hf)) and "<tool_call>" in (tok.chat_template or "")
    model = AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32).eval()
    n = int(batch.lengths[0])
    with torch.no_grad():
        logits = model(batch.tokens[:, :n]).logits.float()
    hf_lp = torch.log_softmax(logits, -1).gather(-1, batch.labels[:, :n, None]).squeeze(-1)
    diff = (hf_lp[:, : n - 1] - actor_lp[:, : n - 1]).abs().max().item()
    print(
        f"logprob diffs: probe v0 {before[0]:.2e}, first batch v0 {first_batch['diff']:.2e} "
        f"({first_batch['tokens']} tokens), probe v{STEPS} {after[0]:.2e}, export vs actor {diff:.2e} ({n} tokens); "
        f"{observations} tool-result turns replayed"
    )
    assert diff <= 1e-4, diff
