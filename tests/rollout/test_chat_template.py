"""The agent loop renders every conversation through the tokenizer's chat template, token-in/token-out.

Tiny tokenizer: the template path gives exactly the ids of the former render_prompt /
render_observation path. Qwen3 (the real tokenizer, ``qwen3_tokenizer_dir``): first prompt ==
apply_chat_template, turn k+1's prompt == turn k's prompt + generated ids + observation ids,
canonical text re-renders identically (parallel calls of 2 and 3 too: their results are one
observation of consecutive tool messages), the two documented re-rendering differences keep the
generated ids, malformed native calls become tool-error observations.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from sao_megatron.config import AgentLoopConfig
from sao_megatron.driver.demos import demonstration_trajectory
from sao_megatron.envs import make_env, make_task
from sao_megatron.envs.base import RewardResult
from sao_megatron.envs.format import ChatFormat, ChatTemplateError, render_observation, render_prompt
from sao_megatron.envs.safe_eval import calculator
from sao_megatron.envs.tool_env import ToolEnv
from sao_megatron.rollout.agent_loop import AgentLoop
from sao_megatron.tokenizer import load_tokenizer
from tests.rollout.fakes import ScriptedClient

CFG = AgentLoopConfig(max_turns=4, max_new_tokens=256, max_response_tokens=4096, max_context_tokens=8192)


def run_loop(tokenizer, env_name, sample, actions, cfg=CFG, finish_reasons=None, **env_kwargs):
    client = ScriptedClient(actions, finish_reasons)
    env = make_env(env_name, **env_kwargs)
    traj = asyncio.run(AgentLoop(client, tokenizer, cfg).run(env, sample))  # type: ignore[arg-type]
    return traj, client


# ---------------------------------------------------------------------------------------------
# tiny tokenizer: identical ids to the former path


@pytest.fixture(scope="module")
def tiny():
    return load_tokenizer()


def old_encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def old_demonstration(tok, env_name, task, index):
    """The former driver/demos.py tokenisation (render_prompt / render_observation)."""
    env = make_env(env_name)
    sample = task.get("train", index)
    prompt = old_encode(tok, render_prompt(env.reset(sample)))
    response = []
    for role, text in env.demonstration(sample):
        response += old_encode(tok, text if role == "assistant" else render_observation(text))
    return prompt, response


@pytest.mark.parametrize("env_name", ["arith_tool", "math_python"])
def test_tiny_demonstrations_keep_their_ids(tiny, env_name):
    task = make_task(env_name)
    for index in range(12):
        prompt, response = old_demonstration(tiny, env_name, task, index)
        traj = demonstration_trajectory(env_name, task, tiny, "train", index)
        assert traj.prompt_ids == prompt
        assert traj.response_ids == response


def test_tiny_agent_loop_keeps_its_ids(tiny):
    """Tool call, malformed action, an action cut at max_new_tokens, an escaped question, answer."""
    task = make_task("arith_tool")
    sample = task.get("train", 5)
    sample = type(sample)(sample.prompt_id, sample.question + " <|end|>", sample.answer, sample.meta)
    expr = sample.meta["expression"]
    actions = [
        old_encode(tiny, f"<tool>{expr}</tool><|end|>"),
        old_encode(tiny, "no tags here<|end|>"),
        old_encode(tiny, "<tool>1+"),  # cut: no <|end|>
        old_encode(tiny, f"<answer>{sample.answer}</answer><|end|>"),
    ]
    traj, client = run_loop(
        tiny, "arith_tool", sample, actions, finish_reasons=["stop", "stop", "length", "stop"], max_turns=4
    )
    assert traj.status == "finished" and traj.reward == 1.0
    assert traj.prompt_ids == old_encode(tiny, render_prompt(sample.question))
    outputs = [
        calculator(expr),
        "Error: malformed action: no <tool> call and no <answer>",
        "Error: malformed action: unclosed <tool>",
    ]
    expected = []
    for action, out in zip(actions, [*outputs, None], strict=True):
        expected += action
        if out is not None:
            expected += old_encode(tiny, render_observation(out))
    assert traj.response_ids == expected
    assert client.sampling[0].stop_token_ids == (tiny.convert_tokens_to_ids("<|end|>"),)


# ---------------------------------------------------------------------------------------------
# Qwen3: the real tokenizer


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer_dir):
    return load_tokenizer(qwen3_tokenizer_dir)


def arith_sample():
    return make_task("arith_tool").get("train", 0)


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def call(expr, compact=False):
    payload = {"name": "calculator", "arguments": {"expression": expr}}
    body = json.dumps(payload, separators=(",", ":")) if compact else json.dumps(payload)
    return f"<tool_call>\n{body}\n</tool_call>"


def json_env_chat(tok, enable_thinking=None):
    env = make_env("arith_tool")
    assert isinstance(env, ToolEnv)
    env.use_tool_format("json")
    return env, ChatFormat(tok, tools=env.tools, system=env.system_prompt, enable_thinking=enable_thinking)


def assert_token_in_token_out(traj, client):
    """Turn k+1's prompt = turn k's prompt + generated ids + observation ids."""
    for k, turn in enumerate(traj.turns):
        assert client.inputs[k] == traj.prompt_ids + traj.response_ids[: turn.start]
        assert traj.response_ids[turn.start : turn.end] == client.actions[k]
        if k + 1 < len(traj.turns):  # the observation sits between this action and the next prompt
            obs = traj.response_ids[turn.end : traj.turns[k + 1].start]
            assert client.inputs[k + 1] == client.inputs[k] + client.actions[k] + obs and obs
    assert all(m == 1 for t in traj.turns for m in traj.action_mask[t.start : t.end])


@pytest.mark.parametrize("enable_thinking", [None, False, True])
def test_qwen3_first_prompt_is_the_chat_template(qwen3, enable_thinking):
    sample = arith_sample()
    env, chat = json_env_chat(qwen3, enable_thinking)
    messages = [
        {"role": "system", "content": env.system_prompt},
        {"role": "user", "content": sample.question},
    ]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    expected = qwen3.apply_chat_template(
        messages, tools=env.tools, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
    )
    assert chat.prompt_ids(sample.question) == list(expected)
    text = qwen3.decode(expected)
    assert '"name": "calculator"' in text and text.endswith(
        "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if enable_thinking is False else "")
    )
    cfg = AgentLoopConfig(**{**CFG.__dict__})
    if enable_thinking is not None:
        object.__setattr__(cfg, "enable_thinking", enable_thinking)  # until the config has the field
    traj, client = run_loop(qwen3, "arith_tool", sample, [enc(qwen3, "<answer>1</answer><|im_end|>")], cfg=cfg)
    assert traj.prompt_ids == list(expected) == client.inputs[0]
    assert client.sampling[0].stop_token_ids == (qwen3.convert_tokens_to_ids("<|im_end|>"),)


def test_qwen3_canonical_episode_equals_the_whole_conversation(qwen3):
    """Generated text in the template's own form: the trajectory is the template's rendering."""
    sample = arith_sample()
    expr = sample.meta["expression"]
    texts = [
        f"<think>\nI use the tool.\n</think>\n\n{call(expr)}",
        f"<think>\nCheck with another call.\n</think>\n\n{call(expr + '+0')}",
        f"<think>\nDone.\n</think>\n\n<answer>{sample.answer}</answer>",
    ]
    actions = [enc(qwen3, t + "<|im_end|>") for t in texts]
    traj, client = run_loop(qwen3, "arith_tool", sample, actions, max_turns=4)
    assert traj.status == "finished" and traj.reward == 1.0, traj.status_reason
    assert_token_in_token_out(traj, client)
    env, _ = json_env_chat(qwen3)
    messages = [
        {"role": "system", "content": env.system_prompt},
        {"role": "user", "content": sample.question},
        {"role": "assistant", "content": texts[0]},
        {"role": "tool", "content": calculator(expr)},
        {"role": "assistant", "content": texts[1]},
        {"role": "tool", "content": calculator(expr + "+0")},
        {"role": "assistant", "content": texts[2]},
    ]
    whole = qwen3.apply_chat_template(messages, tools=env.tools, tokenize=True, return_dict=False)
    # the template closes the last turn with "<|im_end|>\n"; the engine stops at <|im_end|>
    assert traj.prompt_ids + traj.response_ids + enc(qwen3, "\n") == list(whole)
    obs = qwen3.decode(traj.response_ids[traj.turns[0].end : traj.turns[1].start])
    assert (
        obs
        == f"\n<|im_start|>user\n<tool_response>\n{calculator(expr)}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("n_calls", [2, 3])
def test_qwen3_parallel_calls_equal_the_whole_conversation(qwen3, n_calls):
    """Two actions of ``n_calls`` <tool_call> blocks each, then the answer. Each action's results
    are ``n_calls`` consecutive ``tool`` messages, which Qwen3's template merges into one user turn
    of ``n_calls`` <tool_response> blocks: the turn-by-turn ids equal apply_chat_template of the
    whole conversation."""
    sample = arith_sample()
    expr = sample.meta["expression"]
    first = [f"{expr}+{i}" for i in range(n_calls)]
    second = [f"{i + 2}*({expr})" for i in range(n_calls)]
    texts = [
        "<think>\nSeveral calls at once.\n</think>\n\n" + "\n".join(call(e) for e in first),
        "<think>\nAnd more.\n</think>\n\n" + "\n".join(call(e) for e in second),
        f"<think>\nDone.\n</think>\n\n<answer>{sample.answer}</answer>",
    ]
    actions = [enc(qwen3, t + "<|im_end|>") for t in texts]
    traj, client = run_loop(qwen3, "arith_tool", sample, actions, max_turns=4)
    assert traj.status == "finished" and traj.reward == 1.0, traj.status_reason
    assert traj.reward_details["tool_calls"] == 2 * n_calls and traj.reward_details["malformed"] == 0
    assert_token_in_token_out(traj, client)
    env, _ = json_env_chat(qwen3)
    messages = [
        {"role": "system", "content": env.system_prompt},
        {"role": "user", "content": sample.question},
        {"role": "assistant", "content": texts[0]},
        *({"role": "tool", "content": calculator(e)} for e in first),
        {"role": "assistant", "content": texts[1]},
        *({"role": "tool", "content": calculator(e)} for e in second),
        {"role": "assistant", "content": texts[2]},
    ]
    whole = qwen3.apply_chat_template(messages, tools=env.tools, tokenize=True, return_dict=False)
    assert traj.prompt_ids + traj.response_ids + enc(qwen3, "\n") == list(whole)
    obs = qwen3.decode(traj.response_ids[traj.turns[0].end : traj.turns[1].start])
    responses = "\n".join(f"<tool_response>\n{calculator(e)}\n</tool_response>" for e in first)
    assert obs == f"\n<|im_start|>user\n{responses}<|im_end|>\n<|im_start|>assistant\n"
    assert (traj.stats.end, traj.stats.tool_outputs, traj.stats.parallel_turns) == ("done", 2 * n_calls, 2)


def test_tiny_parallel_calls_equal_the_whole_conversation(tiny):
    """The tiny template has no merging: consecutive tool messages render as consecutive
    ``<|tool|>..<|assistant|>`` observations, and the trajectory is still its rendering, id for id."""
    sample = make_task("arith_tool").get("train", 4)
    expr = sample.meta["expression"]
    texts = [f"<tool>{expr}</tool><tool>{expr}*2</tool><tool>1+</tool>", f"<answer>{sample.answer}</answer>"]
    traj, client = run_loop(tiny, "arith_tool", sample, [old_encode(tiny, t + "<|end|>") for t in texts])
    assert traj.status == "finished" and traj.reward == 1.0, traj.status_reason
    assert_token_in_token_out(traj, client)
    outputs = [calculator(expr), calculator(f"{expr}*2"), calculator("1+")]
    assert outputs[2].startswith("Error:")
    messages = [
        {"role": "user", "content": sample.question},
        {"role": "assistant", "content": texts[0]},
        *({"role": "tool", "content": o} for o in outputs),
        {"role": "assistant", "content": texts[1]},
    ]
    assert traj.prompt_ids + traj.response_ids == tiny.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert tiny.decode(traj.response_ids[traj.turns[0].end : traj.turns[1].start]) == "".join(
        f"<|tool|>{o}<|assistant|>" for o in outputs
    )


def test_qwen3_rerendering_differences_keep_generated_ids(qwen3):
    """Documented in docs/rollout.md: Qwen3 re-renders history differently in two cases.

    1. Empty ``<think>`` blocks of earlier turns (``enable_thinking=False`` puts
       ``<think>\\n\\n</think>\\n\\n`` in every generation prompt) are dropped on re-rendering.
    2. Tool calls given as structured ``tool_calls`` are re-serialised (``tojson``): a compact
       call the model generated comes back with spaces.
    The trajectory keeps the generated ids in both cases.
    """
    sample = arith_sample()
    expr = sample.meta["expression"]
    cfg = AgentLoopConfig(**{**CFG.__dict__})
    object.__setattr__(cfg, "enable_thinking", False)
    texts = [call(expr, compact=True), f"<answer>{sample.answer}</answer>"]
    actions = [enc(qwen3, t + "<|im_end|>") for t in texts]
    traj, client = run_loop(qwen3, "arith_tool", sample, actions, cfg=cfg)
    assert traj.status == "finished" and traj.reward == 1.0, traj.status_reason
    assert_token_in_token_out(traj, client)
    context = qwen3.decode(traj.prompt_ids + traj.response_ids)
    assert context.count("<think>\n\n</think>\n\n") == 2  # first prompt and after the tool result
    assert call(expr, compact=True) in context
    env, _ = json_env_chat(qwen3, enable_thinking=False)
    messages = [
        {"role": "system", "content": env.system_prompt},
        {"role": "user", "content": sample.question},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}],
        },
        {"role": "tool", "content": calculator(expr)},
    ]
    rerendered = qwen3.apply_chat_template(
        messages, tools=env.tools, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert rerendered.count("<think>\n\n</think>\n\n") == 1  # the first turn's empty block is gone
    assert call(expr) in rerendered and call(expr, compact=True) not in rerendered
    assert enc(qwen3, rerendered) != traj.prompt_ids + traj.response_ids[: traj.turns[1].start]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("<tool_call>\n{not json}\n</tool_call>", "tool call is not valid JSON"),
        ('<tool_call>\n{"name": "shell", "arguments": {"cmd": "ls"}}\n</tool_call>', "unknown tool 'shell'"),
        ('<tool_call>\n{"name": "calculator"}\n</tool_call>', "no arguments for 'calculator'"),
        (
            '<tool_call>\n{"name": "calculator", "arguments": {}}\n</tool_call>',
            "missing argument(s): expression",
        ),
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}', "unclosed <tool_call>"),
    ],
)
def test_qwen3_malformed_tool_call_is_a_tool_error_observation(qwen3, text, reason):
    sample = arith_sample()
    actions = [enc(qwen3, text + "<|im_end|>"), enc(qwen3, f"<answer>{sample.answer}</answer><|im_end|>")]
    traj, client = run_loop(qwen3, "arith_tool", sample, actions)
    assert traj.status == "finished" and traj.reward == 1.0 and traj.reward_details["malformed"] == 1
    assert_token_in_token_out(traj, client)
    obs = qwen3.decode(traj.response_ids[traj.turns[0].end : traj.turns[1].start])
    assert obs.startswith("\n<|im_start|>user\n<tool_response>\nError: malformed action: ")
    assert reason in obs and obs.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_demonstrations_tokenise_as_the_agent_loop(qwen3):
    task = make_task("arith_tool")
    demo = demonstration_trajectory("arith_tool", task, qwen3, "train", 0)
    env, _ = json_env_chat(qwen3)
    sample = task.get("train", 0)
    actions = [demo.response_ids[t.start : t.end] for t in demo.turns]
    traj, _ = run_loop(qwen3, "arith_tool", sample, actions)
    assert traj.reward == 1.0, traj.status_reason
    assert (traj.prompt_ids, traj.response_ids, traj.action_mask) == (
        demo.prompt_ids,
        demo.response_ids,
        demo.action_mask,
    )
    assert qwen3.decode(actions[0]) == env.call_text(sample.meta["expression"]) + "<|im_end|>"


def test_template_breaking_the_suffix_assumption_fails_the_episode(qwen3):
    """A template that renders earlier turns differently once a tool result follows: failed, loudly."""

    class Shifty:
        def __init__(self, tok):
            self.tok = tok
            self.chat_template = tok.chat_template
            self.eos_token = tok.eos_token

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def apply_chat_template(self, messages, **kw):
            if messages[-1]["role"] == "tool":
                messages = [{**messages[0], "content": messages[0]["content"] + " (changed)"}, *messages[1:]]
            return self.tok.apply_chat_template(messages, **kw)

    sample = arith_sample()
    actions = [enc(qwen3, call(sample.meta["expression"]) + "<|im_end|>")]
    traj, _ = run_loop(Shifty(qwen3), "arith_tool", sample, actions)
    assert traj.status == "failed" and traj.status_reason.startswith("chat template: ")
    with pytest.raises(ChatTemplateError):
        _, chat = json_env_chat(Shifty(qwen3))
        chat.observation_text([*chat.prompt_messages("q"), {"role": "assistant", "content": "x"}], "5")


@pytest.mark.parametrize("fault", ["raises", "nan", "inf"])
def test_reward_faults_fail_the_episode_with_a_reason(qwen3, monkeypatch, fault):
    """A reward function that raises or returns a non-finite reward: a failed episode, never trained."""

    def reward(self):
        if fault == "raises":
            raise ZeroDivisionError("bad grader")
        return RewardResult(float(fault), False)

    monkeypatch.setattr(ToolEnv, "reward", reward)
    sample = arith_sample()
    traj, _ = run_loop(qwen3, "arith_tool", sample, [enc(qwen3, f"<answer>{sample.answer}</answer><|im_end|>")])
    assert traj.status == "failed" and traj.reward == 0.0
    expected = "reward: ZeroDivisionError: bad grader" if fault == "raises" else f"reward: non-finite reward {fault}"
    assert traj.status_reason == expected
