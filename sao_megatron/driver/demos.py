"""Supervised warm start (the paper's TIR-SFT stage): expert demonstrations as trajectories.

A demonstration is tokenised exactly as the agent loop tokenises a live episode, through the
same :class:`~sao_megatron.envs.format.ChatFormat` (the tokenizer's chat template): the prompt is
``apply_chat_template([system?, user], tools=..., add_generation_prompt=True)``, each action is
its text (with the template's end marker) encoded on its own, as the engine would generate it,
and each observation is the template's suffix rendering of the tool result (consecutive tool
turns, the outputs of parallel calls, render as one observation). SFT therefore
teaches the same token sequences the engine will later produce; only action tokens carry the loss.
"""

from __future__ import annotations

from itertools import groupby

from sao_megatron.envs.base import Split, Task
from sao_megatron.envs.format import ChatFormat, tool_format_of
from sao_megatron.envs.registry import make_env
from sao_megatron.records import OBSERVATION_VERSION, Trajectory, Turn


def demonstration_trajectory(
    env_name: str,
    task: Task,
    tokenizer,
    split: Split,
    index: int,
    env_kwargs: dict | None = None,
    enable_thinking: bool | None = None,
) -> Trajectory:
    env = make_env(env_name, **(env_kwargs or {}))
    env.use_tool_format(tool_format_of(getattr(tokenizer, "chat_template", None)))
    chat = ChatFormat(tokenizer, tools=env.tools, system=env.system_prompt, enable_thinking=enable_thinking)
    sample = task.get(split, index)
    question = env.reset(sample)
    prompt_ids = chat.prompt_ids(question)
    messages = chat.prompt_messages(question)
    response, mask, turns = [], [], []
    for role, group in groupby(env.demonstration(sample), key=lambda turn: turn[0]):
        texts = [text for _, text in group]
        if role != "assistant":  # consecutive tool outputs (parallel calls): one observation
            ids = chat.observation_ids(messages, texts)
            mask += [0] * len(ids)
            messages.extend(chat.tool_messages(texts))
            response += ids
            continue
        for text in texts:
            action = chat.ensure_end(text)
            ids = chat.encode(action)
            turns.append(Turn(len(response), len(response) + len(ids)))
            mask += [1] * len(ids)
            messages.append(chat.assistant_message(action))
            response += ids
    return Trajectory(
        prompt_id=sample.prompt_id,
        prompt_ids=prompt_ids,
        response_ids=response,
        action_mask=mask,
        behavior_logprobs=[0.0] * len(response),
        policy_versions=[0 if m else OBSERVATION_VERSION for m in mask],
        turns=turns,
        reward=1.0,
        status="finished",
        split=split,
        sample_index=index,
    )
