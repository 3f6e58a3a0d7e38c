"""The agent loop's section of the run config, ``rollout.loop`` (:mod:`sao_megatron.rollout.agent_loop`).

Kept apart from :mod:`sao_megatron.config.schema` (which uses it as ``RolloutConfig.loop``) to keep
that module readable; validation is :func:`sao_megatron.config.load.validate_rollout`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AgentLoopConfig:
    """Limits and sampling of one episode (``sao_megatron.rollout.agent_loop``)."""

    max_turns: int = 4
    """Model actions per episode (the paper: up to 50 for math, 300 for SWE)."""
    max_new_tokens: int = 64
    """Tokens per action."""
    max_response_tokens: int = 512
    """Actions plus observations after the prompt."""
    max_context_tokens: int = 1024
    """Prompt plus response; must fit the engine's context (``sao plan`` sizes memory for it)."""
    temperature: float = 1.0
    """Sampling temperature of training episodes (evaluation uses ``train.eval_temperature`` and
    ``train.eval_sample_temperature``)."""
    top_p: float = 1.0
    """Nucleus sampling threshold; 1 samples from the whole distribution."""
    generate_timeout_s: float = 300.0
    """Seconds one engine call may take before the episode fails."""
    env_step_timeout_s: float = 600.0
    """Seconds one environment call (``areset``, each tool call ``astep``, ``areward``; ``aclose``
    too, which is only logged) may take before the episode fails (``environment: tool timed out ...``,
    ``reward: timed out ...``). It bites only at an ``await``: an environment whose sync ``step``
    runs inline blocks the event loop and cannot be interrupted (make slow tools async, or run the
    environments on env workers)."""
    enable_thinking: bool | None = None
    """The chat template's thinking switch (Qwen3: ``enable_thinking``); None leaves the template's
    default. Ignored by templates without one."""
    max_calls_per_turn: int = 8
    """Tool calls of one action the environment runs (Qwen3-class models emit several
    ``<tool_call>`` blocks in one turn); each call beyond it is answered by an error output
    (``Error: call k not run: ...``) and counted (``rollout/refused_calls``). The results of one
    action's calls are rendered as consecutive ``tool`` messages, one observation."""
    max_output_tokens_per_call: int = 0
    """Tokens of one tool output (counted on the output text alone) kept in the observation; the
    rest is cut and replaced by ``...[N tokens clipped]``. 0: no limit (environments still clip to
    their own ``max_observation_chars``)."""
    max_observation_tokens_per_episode: int = 0
    """Observation tokens (the template's rendering of tool outputs, what enters the context) one
    episode may add; the observation that would pass it is not added and the episode ends
    ``truncated`` (cause ``observation_budget``), keeping the rest of the context for actions.
    0: no limit."""
