"""Supervised warm start (the paper's TIR-SFT stage): expert demonstrations as trajectories.

A demonstration is tokenised exactly as the agent loop tokenises a live episode (prompt,
then each action and each rendered observation encoded separately), so SFT teaches the same
token sequences the engine will later produce; only action tokens carry the loss.
"""

from __future__ import annotations

from sao_megatron.envs.base import Split, Task
from sao_megatron.envs.format import render_observation, render_prompt
from sao_megatron.envs.registry import make_env
from sao_megatron.records import OBSERVATION_VERSION, Trajectory, Turn


def demonstration_trajectory(env_name: str, task: Task, tokenizer, split: Split, index: int,
                             env_kwargs: dict | None = None) -> Trajectory:  # fmt: skip
    env = make_env(env_name, **(env_kwargs or {}))
    sample = task.get(split, index)
    question = env.reset(sample)
    prompt_ids = tokenizer.encode(render_prompt(question), add_special_tokens=False)
    response, mask, turns = [], [], []
    for role, text in env.demonstration(sample):
        if role == "assistant":
            ids = tokenizer.encode(text, add_special_tokens=False)
            turns.append(Turn(len(response), len(response) + len(ids)))
            mask += [1] * len(ids)
        else:
            ids = tokenizer.encode(render_observation(text), add_special_tokens=False)
            mask += [0] * len(ids)
        response += ids
    return Trajectory(
        prompt_id=sample.prompt_id, prompt_ids=prompt_ids, response_ids=response, action_mask=mask,
        behavior_logprobs=[0.0] * len(response), policy_versions=[0 if m else OBSERVATION_VERSION for m in mask],
        turns=turns, reward=1.0, status="finished", split=split, sample_index=index,
    )  # fmt: skip
