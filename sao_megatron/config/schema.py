"""The configuration schema: nested dataclasses, a docstring under every field.

Field annotations drive validation (:mod:`sao_megatron.config.load`): ``int``, ``float``, ``bool``,
``str``, lists, ``X | None`` and ``typing.Literal`` choices, whose allowed values are the only ones
accepted. The algorithm's choices are the types of :mod:`sao_megatron.algo.choices`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sao_megatron.algo.choices import AdvantageName, BatchOrder, LossAgg, OverLag, PolicyLossName, Truncation
from sao_megatron.config.agent import GatewayConfig, OpenAIAgentConfig
from sao_megatron.config.loop import AgentLoopConfig
from sao_megatron.config.model import ModelConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs"
MODEL_CONFIG_DIR = CONFIG_DIR / "models"
DEFAULT_RUN_CONFIG = CONFIG_DIR / "tiny_cpu.yaml"

TokenDispatcher = Literal["alltoall", "allgather"]
"""Megatron MoE token dispatchers this stack supports."""
ValueHeadInit = Literal["zero", "normal"]
"""Initialisation of the critic's scalar value head."""
EngineDtype = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]
"""SGLang ``--dtype`` values."""
WeightSync = Literal["distributed", "disk"]
"""``distributed``: broadcast groups, one per actor pipeline stage -> engines; ``disk``: engines load a saved copy."""
Backend = Literal["auto", "nccl", "gloo", "strict_nccl"]
"""torch.distributed backend of the trainer ranks."""
NodeGroup = Literal["actor", "critic", "rollout"]
"""A node group of a cluster run (``cluster.*_nodes``; its nodes advertise ``sao_<group>`` to Ray)."""
UpdatePolicy = Literal["retract", "in_place", "abort"]
"""What a weight sync does to the requests the engines are running (``rollout.update_policy``)."""
RetryFrom = Literal["scratch", "turn"]
"""Where an episode retried after an engine fault starts again (``rollout.episode_retry_from``)."""
RouterBiasUpdate = Literal["freeze", "train"]
"""What training does to the MoE router's expert bias (``actor.router_bias_update``)."""
ValueStopMetric = Literal["explained_var", "explained_var_first"]
"""What value pretraining's stop watches (``train.value_pretrain_stop_on``): the critic's explained
variance over every action token, or at each trajectory's first action token (the baseline the
advantage of the episode's first decision is measured against)."""
RoutingReplayMode = Literal["off", "record", "on"]
"""Rollout routing replay (``rollout.routing_replay``): ``off``; ``record``: the engines return the
top-k experts of every position and the actor measures its agreement with them without replaying;
``on``: the actor's routers replay them."""


class ConfigError(ValueError):
    """A configuration problem, stated in one line with the fix."""


# --------------------------------------------------------------------------------------------
# Roles: parallel layout and optimizer
# --------------------------------------------------------------------------------------------
@dataclass
class ParallelConfig:
    """Megatron parallel layout of one role (actor or critic). DP is world / (TP * PP * CP)."""

    world_size: int = 1
    """Processes (GPUs, or CPU processes locally) of this role."""
    tensor_parallel: int = 1
    """TP: splits attention heads, MLP width and the vocabulary."""
    pipeline_parallel: int = 1
    """PP: splits layers into stages."""
    context_parallel: int = 1
    """CP: splits the sequence (long-context runs)."""
    expert_parallel: int = 1
    """EP: splits the routed experts across ranks."""
    expert_tensor_parallel: int = 1
    """Expert TP: splits each expert's width."""
    sequence_parallel: bool | None = None
    """Megatron sequence parallelism; None means on exactly when TP > 1 (required by MoE)."""
    moe_token_dispatcher: TokenDispatcher = "alltoall"
    """Megatron's token dispatch for MoE layers: ``alltoall`` or ``allgather``."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over DP ranks (ZeRO-1)."""
    recompute_activations: bool = False
    """Full-layer activation recompute (memory for time)."""
    selective_recompute: bool | None = None
    """Megatron's selective recompute when full recompute is off (with TE: the norms and the
    MoE activation; without: core attention); None means on exactly when Transformer Engine is
    in use (a GPU)."""
    fusions: bool | None = None
    """Megatron's fused kernels (RoPE, bias-activation, softmax, gradient-accumulation, grouped
    GEMM, MoE permute and router fusion); None means on exactly when Transformer Engine is in use."""
    overlap_grad_reduce: bool | None = None
    """Overlap the DP gradient reduce with the backward pass; None means on with Transformer Engine."""
    overlap_param_gather: bool | None = None
    """Megatron's overlapped parameter all-gather of the distributed optimizer; None means off:
    the policy is exported right after each step, so the step completes the gather at once."""
    micro_batch_size: int = 1
    """Sequences per micro-batch on one rank (the cap per micro-batch when ``max_tokens_per_micro_batch`` is set)."""
    pack_sequences: bool = False
    """Pack each micro-batch's sequences into one row (THD with ``cu_seqlens`` under Transformer
    Engine, a block-diagonal causal mask on the local layer spec) instead of padding every row
    to the longest."""
    max_tokens_per_micro_batch: int = 0
    """Dynamic micro-batch size: fill each micro-batch up to this many tokens (padding included;
    a longer sequence gets a micro-batch of its own); 0 means ``micro_batch_size`` rows each."""

    @property
    def data_parallel(self) -> int:
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel * self.context_parallel)

    @property
    def effective_sequence_parallel(self) -> bool:
        return self.tensor_parallel > 1 if self.sequence_parallel is None else self.sequence_parallel


@dataclass
class OptimizerConfig:
    """Adam optimizer and schedule of one role."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the decay schedule."""
    warmup_steps: int = 0
    """Linear warm-up optimizer steps."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""


@dataclass
class ActorConfig:
    """The policy model's role."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    bf16: bool = False
    """bf16 weights and compute (GPU runs); float32 otherwise."""
    init_from: str = ""
    """Initial weights: an HF directory (``config.json`` + safetensors) or a Megatron checkpoint
    written by ``sao convert hf-to-mcore`` (``metadata.json`` + ``model.yaml``); each rank reads
    only its slices, at any layout. Without a ``model`` in the run file the shape is read from
    the checkpoint; with one, both must agree. ``""``: random initialisation."""
    router_bias_update: RouterBiasUpdate = "freeze"
    """Models with ``model.moe_router_enable_expert_bias``: ``freeze`` keeps the routers' expert
    bias as loaded (Megatron ``moe_router_bias_update_rate=0``); ``train`` moves each expert's
    bias by ``router_bias_update_rate`` per optimizer step towards balanced load (Megatron's
    aux-loss-free update: +rate for an expert below the mean token count, -rate above). Either
    way every weight sync sends the biases with the weights, so engines route as the trainer."""
    router_bias_update_rate: float = 1e-3
    """The expert-bias step of ``router_bias_update: train`` (Megatron's default, DeepSeek-V3's)."""
    moe_aux_loss_coeff: float = 0.0
    """The MoE load-balancing auxiliary loss coefficient of the actor's RL updates (Megatron
    ``moe_aux_loss_coeff``); SFT steps (``train.sft_steps``) keep ``model.moe_aux_loss_coeff``. 0
    (default): the RL gradient is the policy loss's alone; load balancing would move the routers for a
    reason the reward does not see, and every routing change the engines have not yet received
    widens the trainer/engine mismatch (docs/algo.md; NeMo-RL's MoE RL defaults likewise)."""
    freeze_router: bool = False
    """MoE models: the routers' weights (``...mlp.router.weight``) get no gradient and never change,
    for SFT and RL alike (frozen before Megatron's DDP wraps the model); the expert bias follows
    ``router_bias_update``. The experts and everything else train."""


@dataclass
class CriticConfig:
    """The value model's role: same architecture as the actor with a scalar value head."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=5e-6))
    bf16: bool = False
    """bf16 weights and compute (GPU runs); float32 otherwise."""
    init_from: str = ""
    """Initial trunk weights (HF or Megatron directory, as ``actor.init_from``); the LM head is not
    loaded, the value head starts per ``value_head_init``. Wins over ``init_from_actor``."""
    init_from_actor: bool = True
    """Without ``init_from``: initialise the trunk from the actor's weights after SFT, exported as
    an HF checkpoint to ``<run_dir>/hf/policy`` (paper: both from the SFT checkpoint)."""
    freeze_patterns: list[str] = field(default_factory=lambda: [r"\.self_attention\."])
    """Regexes over parameter names to freeze (paper: critic attention frozen)."""
    train_patterns: list[str] = field(default_factory=list)
    """Regexes that un-freeze parameters matched by ``freeze_patterns`` (applied after)."""
    value_head_init: ValueHeadInit = "zero"
    """Initialisation of the value head: ``zero`` or ``normal``."""
    updates_per_step: int = 2
    """K: critic optimizer steps per actor step (paper: 2)."""


@dataclass
class AlgoConfig:
    """The RL algorithm: policy loss, advantages, batching and staleness (defaults: SAO)."""

    policy_loss: PolicyLossName = "dis"
    """``dis`` (SAO), ``ppo_clip`` or ``vanilla`` (GRPO baselines)."""
    eps_low: float = 0.3
    """DIS keeps ``1 - eps_low < rho``; PPO clips at ``1 - eps_low`` (paper, math: 0.3)."""
    eps_high: float = 5.0
    """DIS keeps ``rho < 1 + eps_high``; PPO clips at ``1 + eps_high`` (paper, math: 5.0)."""
    detach_ratio: bool = True
    """DIS weight as a stop-gradient (truncated IS); false gives the paper's literal formula."""
    seq_mask_low: float | None = None
    """Sequence mask, lower bound in (0, 1) (docs/algo.md): a trajectory whose geometric-mean ratio
    ``exp(mean_t log rho_t)`` over its action tokens is below it gets no policy gradient (its tokens
    still count in the normaliser); with any ``policy_loss``, never on value targets. null: no lower
    bound. Refused with ``actor.parallel.context_parallel`` > 1 (a trajectory is then split over ranks)."""
    seq_mask_high: float | None = None
    """Sequence mask, upper bound > 1: a trajectory whose geometric-mean ratio is above it gets no
    policy gradient; null: no upper bound (both null: the sequence mask is off)."""
    tis_cap: float | None = None
    """Truncated importance sampling (docs/algo.md): each action token's importance weight becomes
    ``min(rho, C)``, C = this (>= 1), nothing masked; ``vanilla`` gains that weight, ``dis`` and
    ``ppo_clip`` have their ratio truncated at C (with ``dis``, C must lie below ``1 + eps_high``,
    which already bounds it). null: off."""
    loss_agg: LossAgg = "token_mean"
    """``token_mean`` over the global batch's action tokens or ``seq_mean``."""
    advantage: AdvantageName = "gae"
    """``gae`` (token level), ``step_mean`` / ``step_last`` (turn level), ``grpo``, ``rloo``,
    ``running_mean_prompt`` or ``running_mean_global``."""
    gamma: float = 1.0
    lam: float | Literal["adaptive"] = "adaptive"
    """Policy GAE lambda in [0, 1], or ``adaptive``: length-adaptive ``1 - 1/(alpha * l)`` per trajectory
    (VAPO), with alpha = ``lam_alpha`` and l its number of action tokens."""
    lam_alpha: float = 1.5
    """alpha of length-adaptive lambda (VAPO; the paper uses 1.5)."""
    lam_critic: float = 1.0
    """Lambda of the critic's targets (decoupled GAE)."""
    truncated: Truncation = "terminal"
    """An episode cut by ``rollout.loop`` limits (turns, context, token budgets): ``terminal`` trains the
    cut as the episode's end with its reward (ours; the paper is silent); ``bootstrap`` gives its last
    action token the critic's value at the cut instead (needs a critic estimator)."""
    whiten_advantages: bool = False
    """Normalise advantages over the batch (paper silent; off)."""
    grpo_std_normalize: bool = True
    running_mean_window: int = 8
    """Rewards per prompt (or globally) in running-mean baselines (paper ablation: 8)."""
    value_clip: float = 0.0
    """PPO-style value clipping range; 0 disables."""
    batch_size: int = 128
    """Trajectories per learner step (paper: 128)."""
    group_size: int = 1
    """Rollouts per prompt: 1 for SAO, G for GRPO (batch = batch_size / G prompts x G)."""
    max_policy_lag: int | None = 4
    """Drop trajectories whose oldest action token is more than this many versions old; null: unbounded."""
    over_lag: OverLag = "drop"
    """Past ``max_policy_lag``: ``drop`` the trajectory, or ``mask``: keep it while its newest action
    token is within the bound and give its older tokens no policy gradient (``actor/stale_masked``)."""
    batch_order: BatchOrder = "finish"
    """Which waiting trajectories a batch takes: the first to ``finish`` (SAO), or the first to have
    ``start``ed (age-aware: long episodes train before they pass the lag bound)."""
    max_batches_ahead: int | None = None
    """Flow control: a new episode starts only while the episodes started in the stage number at
    most (learner steps done + this) x ``batch_size``, so the engines run at most this many batches
    ahead of the learner (AReaL's max staleness) and a slow learner trains fresher trajectories
    instead of the lag bound dropping the surplus; null: no cap (the engines always generate)."""
    synchronous: bool = False
    """Batch barrier: rollouts of the next batch start only after the weight update (sync baseline)."""
    critic_warmup_steps: int = 10
    """Critic-only steps before the actor trains (paper: 10)."""


@dataclass
class RolloutConfig:
    """Environment, engines and the agent loop."""

    env: str = "arith_tool"
    """Registered environment name or ``package.module:Class``."""
    env_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the Env class (one instance per episode), e.g. ``max_turns``."""
    task_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the environment's Task (the prompt source), e.g. difficulty knobs."""
    num_engines: int = 1
    tensor_parallel: int = 1
    expert_parallel: int = 1
    nodes_per_engine: int = 0
    """Nodes one engine spans, its ``tensor_parallel`` ranks split evenly over them (SGLang
    ``--nnodes``; node 0 serves HTTP); needs a Ray cluster. 0: the fewest whole nodes holding
    ``tensor_parallel`` GPUs (``cluster.gpus_per_node``), one on a CPU-only run."""
    dtype: EngineDtype = "auto"
    """SGLang ``--dtype``: ``float32`` on CPU (engine logprobs then match the trainer's); ``auto`` on GPU."""
    max_total_tokens: int = 32768
    engine_args: list[str] = field(default_factory=list)
    """Extra SGLang server flags for every engine, passed through as written, e.g.
    ``["--chunked-prefill-size", "8192", "--context-length=131072"]``. Checked against the installed
    SGLang's own argument parser before any engine starts: an unknown flag or a bad value fails naming
    it, and a flag the project sets from another key (``--tp-size``: ``rollout.tensor_parallel``, ...) is
    refused naming that key."""
    engine_start_timeout_s: float = 300.0
    """Seconds an engine may take to answer ``/health`` after its start (model load included; a
    multi-node engine of a large model needs more)."""
    engine_env: dict = field(default_factory=dict)
    """Environment variables of every engine server (SGLang and torch settings), e.g.
    ``{OMP_NUM_THREADS: "1"}``: on a CPU shared with the learner one torch thread per engine avoids
    thread barriers waiting on a descheduled sibling (``configs/tiny_cpu.yaml``)."""
    max_concurrent: int = 64
    """Episodes in flight per manager."""
    max_failed_fraction: float = 0.5
    """Stop the run when more than this share of the last ``failure_window`` episodes failed
    (engine, environment, reward or task errors); failed episodes are never trained."""
    failure_window: int = 100
    """Episodes the failure share is measured over (the check starts once this many finished)."""
    engine_max_restarts: int = 3
    """Restarts of one engine (its process exited, it stopped answering, or a weight sync aborted its
    broadcast group) within ``engine_restart_window_steps`` learner steps; at its next failure it is
    dropped and the run continues on the others; with none left the run stops. A restarted engine
    starts as at the run's start (random weights; the last export with ``weight_sync: disk``) and
    takes episodes once a weight sync gave it the current version."""
    engine_restart_window_steps: int = 20
    """The RL learner steps (``state.step``; value-pretraining steps do not advance it) over which
    ``engine_max_restarts`` counts an engine's restarts: a restart at step s counts at steps s to
    s + this - 1; 0: over the whole run (the budget never refills). Why 20: a crash loop (an engine
    that cannot serve, a bad node) shows as several restarts within a few steps, often within one (a
    restart takes minutes), and is still dropped; transient faults spread over a long run (a slow
    link's timeout, an aborted weight sync, which restarts every engine of its group) do not
    accumulate, so three of them in a 500-step run no longer stop it. An engine that needs more than
    ``engine_max_restarts`` restarts within 20 steps is dropped."""
    engine_check_s: float = 5.0
    """Period of the engine watchdog: each engine's process is polled and its ``/model_info`` asked;
    an exited process, or three missed answers in a row, marks the engine down for a restart."""
    episode_max_retries: int = 2
    """Times an episode that failed because of its engine (an ``engine:`` reason, or aborted) is
    run again (same prompt and group member; ``episode_retry_from`` says from where) before it
    counts as a failed episode."""
    episode_retry_from: RetryFrom = "scratch"
    """Where a retried episode starts: ``scratch`` (a fresh environment, the whole episode again) or
    ``turn`` (the same environment and the tokens so far; the failed turn is generated again on an
    engine that is up, so completed turns and tool calls are not repeated)."""
    env_workers: int = 0
    """Worker processes (Ray actors) that hold the episodes' environments and run their reset, steps,
    reward and close; 0: environments run in the driver process."""
    env_worker_episodes: int = 16
    """Episodes open at once on one env worker; more wait for a free slot."""
    env_worker_cpus: float = 1.0
    """Ray CPUs each env worker reserves."""
    env_node_group: NodeGroup = "rollout"
    """Node group the env workers run on when ``cluster.ray_address`` is set (the nodes advertising
    ``sao_<group>``); locally they share the one node."""
    loop: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    """Turn and token limits and sampling of every episode."""
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """The OpenAI-compatible gateway that ``rollout.env=openai_agent`` episodes run through."""
    agent: OpenAIAgentConfig = field(default_factory=OpenAIAgentConfig)
    """The agent that ``rollout.env=openai_agent`` runs per episode (entry point or command)."""
    routing_replay: RoutingReplayMode = "off"
    """MoE models: ``on`` starts the engines with ``--enable-return-routed-experts``, keeps the top-k
    expert ids the engine chose at every position of a trajectory (every MoE layer, compact) and
    makes every actor forward that computes logprobs or gradients route its tokens to those experts
    (Megatron's ``RouterReplay``; the router's probabilities are still computed at those ids, so its
    gradients flow). ``record`` captures and measures route agreement without replaying; ``off``
    neither. The critic never replays (docs/algo.md)."""
    weight_sync: WeightSync = "distributed"
    """``distributed`` (one broadcast group per actor pipeline stage -> engines; the engines start with random
    weights while the roles start, and the first sync gives them the actor's) or ``disk`` (the
    engines start from, and reload, the actor's HF export in ``<run_dir>/hf/policy``)."""
    update_policy: UpdatePolicy = "retract"
    """What a broadcast weight sync does to the requests the engines are running (docs/rollout.md):
    ``retract`` (they go back to the engine's queue; the cache is flushed once per sync, so their
    contexts are prefilled again under the new weights), ``in_place`` (they stay in the batch with
    their KV cache, computed under the old weights, and continue with the new ones; the cache is not
    flushed while requests run, so later prefix-cache hits may reuse old KV too: the trajectory's
    ``stale_kv`` spans record those tokens) or ``abort`` (the engines return them with their partial
    output; the agent loop resubmits each as a continuation, prompt + tokens so far, and the tokens
    already generated keep their behavior logprobs and versions). Measured side by side in
    docs/PERFORMANCE.md (``benchmarks/bench_update_policy.py``). The disk sync
    (``weight_sync: disk``) does not pause: the engine finishes its requests before it loads (with it,
    only ``retract`` is accepted)."""
    weight_sync_every: int = 1
    """Push the actor's weights to the engines every n policy versions (1: every step). n > 1 is a
    staleness knob for experiments: episodes then run on weights up to n - 1 versions old (and
    older while they wait); ``algo.max_policy_lag`` must be at least n - 1. Evaluations sync first."""
    weight_sync_bucket_mb: int = 1024
    """Size of the weight sync's buckets in MiB (per pipeline stage): each is one engine request. A
    sender holds about four at once (the one it sends, the next one gathered, the one being gathered
    and its shards), five with ``weight_sync_flat`` (the flat copy): budget that much device memory on
    each stage's first rank. The default is sized for large models. In bf16 a Qwen3-30B-A3B sync moves
    ~57 GiB (57 buckets at 1024 MiB, 114 at 512) and a 750B model's ~1,397 GiB (1,397 buckets at
    1024, 2,794 at 512), split over the pipeline stages. Each bucket adds one request round trip and
    load on every engine; measured on CPU at 14 ms per bucket beyond the raw broadcast
    (docs/PERFORMANCE.md; not measured on a GPU). At 750B that is ~20 s of pause at 1024 against ~39 s
    at 512, and the sender holds ~4 GiB (5 GiB flat) against 2 GiB (2.5 GiB). 2048 would halve the
    requests again for 8-10 GiB per sender and a 2 GiB receive buffer on every engine GPU, beside
    its KV cache. Must be >= 1."""
    weight_sync_senders: int = 8
    """Trainer ranks that broadcast weights, at most (per stage: the largest divisor of EP not above
    ``max(1, n // pipeline_parallel)``); each gathers its share of the experts and dense tensors by
    collectives and adds one communicator on every engine GPU (docs/rollout.md). Must be >= 1."""
    weight_sync_flat: bool | None = None
    """Broadcast each bucket as one byte buffer (SGLang's ``flattened_bucket``) instead of tensor by
    tensor: one collective per bucket instead of one per tensor (a Qwen3-30B-A3B sync is ~18.9k
    tensors), for an extra copy on each side. ``null`` (the default) is resolved when the actor
    starts from the sync's backend: true under NCCL (a GPU run), false under gloo (CPU), where per
    tensor was measured faster (``docs/PERFORMANCE.md``); the flat format's gain under NCCL is not
    measured. An explicit true or false wins."""
    weight_sync_gb_per_s: float = 10.0
    """Trainer -> engines bandwidth ``sao plan`` assumes for its predicted sync time per step;
    measure yours with ``benchmarks/bench_weight_sync.py`` (the protocol's GB/s on your fabric)."""
    weight_sync_timeout_s: float = 120.0
    """How long a broadcast weight sync's sender waits for one bucket's broadcast to complete (every
    engine received it). Past it, or when the broadcast fails, the sender aborts its group, the sync
    fails and the run restarts every engine of that group and syncs again (docs/training.md, "When a
    weight sync fails"). Under NCCL a dead or refusing engine shows up only as this timeout: keep it
    well above one bucket's transfer and the first bucket's communicator set-up."""


@dataclass
class TrainConfig:
    """Stages and loop length."""

    sft_steps: int = 0
    """Supervised warm-start steps on demonstrations (0 skips the stage)."""
    sft_batch_size: int = 32
    """Demonstrations per SFT step."""
    sft_lr: float = 1e-3
    """Actor learning rate during SFT (RL then uses ``actor.optim.lr``)."""
    value_pretrain_steps: int = 0
    """Critic-only steps on rollouts of the frozen SFT policy (0 skips)."""
    value_pretrain_target_ev: float = 0.5
    """Stop value pretraining early once explained variance reaches this."""
    value_pretrain_stop_on: ValueStopMetric = "explained_var"
    """The explained variance that stop watches: ``explained_var`` (every action token) or
    ``explained_var_first`` (each trajectory's first action token)."""
    value_pretrain_stop_window: int = 1
    """Steps whose mean that explained variance is (the last ones; >= 1). One batch's figure at the
    first action token rests on B values, so a window of a few steps keeps a lucky batch from
    stopping the stage."""
    steps: int = 100
    """Learner steps of RL."""
    eval_every: int = 0
    """Evaluate every n RL steps (0: only before the first step and after the last)."""
    eval_prompts: int = 64
    """Held-out prompts per evaluation."""
    eval_temperature: float = 0.0
    """Temperature of the pass@1 evaluation episodes, one per prompt (0: greedy); ``eval/accuracy``."""
    eval_samples: int = 0
    """k: sampled episodes per held-out prompt for ``eval/mean_accuracy@k`` (mean accuracy over k
    samples, the paper's main figure with k=16); 0 skips the sampled evaluation."""
    eval_sample_temperature: float = 1.0
    """Temperature of the ``eval_samples`` episodes (paper: 1.0)."""
    eval_max_turns: int = 0
    """Turn limit of evaluation episodes (0: ``rollout.loop.max_turns``): train under a tighter limit
    than the task is judged at (``algo.truncated``)."""
    save_every: int = 0
    """Checkpoint every n steps (0: only at the end)."""
    max_skipped_steps: int = 3
    """Stop after this many learner steps in a row skipped an update (non-finite loss or gradient;
    each skip is counted in ``actor/updated`` / ``critic/updated`` and logged with its trajectories)."""
    sample_trajectories: int = 4
    """Trajectories per step written as text to the run directory."""


PromptFormat = Literal["text", "messages"]
"""How a dataset row's prompt field is read: one user text, or a list of chat messages."""


@dataclass
class DataConfig:
    """Prompt files replacing the environment's bundled prompts (``sao_megatron.envs.dataset``).

    Empty ``train`` keeps the environment's own task (arith_tool's generator, math_python's
    bundled set). Rows are checked when ``sao train`` starts; an error names ``file:line`` and the fix."""

    train: str = ""
    """JSONL file of training prompts, one JSON object per line; empty: the environment's own task.
    Indices past the end cycle, each pass (epoch) in its own deterministic shuffle."""
    eval: str = ""
    """JSONL file of held-out prompts (evaluation, in file order); required when ``train`` is set
    and ``train.eval_prompts`` > 0."""
    prompt_field: str = "prompt"
    """Field holding the prompt: a string (``prompt_format: text``) or a list of chat messages."""
    prompt_format: PromptFormat = "text"
    """``text``: the field is the user question; ``messages``: a list of ``{role, content}`` objects
    (roles system/user/assistant/tool, at least one user turn); the question is the last user
    turn's content and the whole list is kept in ``Sample.meta['messages']``."""
    answer_field: str = "answer"
    """Field holding the ground truth the environment grades against (a string or number)."""
    tools_field: str = ""
    """Optional field with per-sample tool specifications, kept in ``Sample.meta['tools']``; empty: none."""
    id_field: str = ""
    """Field with a stable unique id per row; empty: ``<file name>:<line>``."""
    meta_fields: list[str] = field(default_factory=list)
    """Further fields copied into ``Sample.meta`` when present (e.g. ``solution`` for math_python's
    SFT demonstrations)."""
    seed: int = 0
    """Seed of the per-epoch shuffle of ``train``."""


@dataclass
class RunConfig:
    """Where and how a run executes."""

    name: str = "sao"
    """Run name; the run directory is ``<output_dir>/<name>-<timestamp>`` unless ``run_dir`` is set."""
    output_dir: str = "runs"
    """Parent directory of run directories."""
    run_dir: str = ""
    """Explicit run directory (resume uses it)."""
    seed: int = 1234
    """Seed of every RNG (torch, python, data order)."""
    backend: Backend = "auto"
    """torch.distributed backend: ``auto`` (nccl with CUDA, gloo otherwise), ``nccl``, ``gloo``, or
    ``strict_nccl``: NCCL's contract on CPU, for tests (enqueue-only ops, a watchdog per group,
    communicators split from the bound world; ``sao_megatron.runtime.strict_nccl``); the weight
    sync's groups then use it too."""
    wandb_project: str = ""
    """Also log metrics to this Weights & Biases project (needs ``wandb`` installed); empty: off."""
    export_timeout_s: float = 0.0
    """How long a whole-model move of the actor's weights may wait in one transfer or collective
    before the run fails naming this key: the HF export (``rollout.weight_sync: disk``, the
    critic's start from a trained actor) and the broadcast weight sync's gathers. 0 sizes it from
    the bytes moved: ``max(600, 3 x HF bytes / (export_gb_per_s x 1e9))``; 750B-A40B in bf16
    (1.48 TB) at 0.5 GB/s: 8880 s. On NCCL a timeout aborts the rank (its log names it)."""
    export_gb_per_s: float = 0.5
    """The bandwidth the default ``export_timeout_s`` assumes for a whole HF export (all writers
    together, gathers and file-system writes), in GB/s (1e9 bytes): a low, safe figure; measure
    yours and set it, or set ``export_timeout_s`` directly."""
    export_inflight_mb: int = 1024
    """Per sending rank, MiB it may have sent to a writer (export) or a stage's sender (weight-sync
    gather) that the receiver has not acknowledged yet; it waits beyond (one bucket always goes)."""


ContainerRuntime = Literal["none", "pyxis", "apptainer"]
"""How launch/slurm/sao.sbatch runs its commands: on the host, in a pyxis/enroot container
(``srun --container-image``), or under ``apptainer exec``."""


@dataclass
class ContainerConfig:
    """The container every srun'd command of a Slurm job runs in (Ray daemons and the driver)."""

    runtime: ContainerRuntime = "none"
    """``none``: on the host; ``pyxis``: ``srun --container-image=IMAGE --container-mounts=...
    --container-workdir=...``; ``apptainer``: ``apptainer exec [--nv] --bind ... --pwd ... IMAGE``."""
    image: str = ""
    """pyxis: an enroot image (``nvcr.io#nvidia/pytorch:25.01-py3``, a ``.sqsh`` file); apptainer:
    a ``.sif`` file. It must provide ``sao`` and ``ray`` on its PATH (or mount a checkout and its venv)."""
    mounts: list[str] = field(default_factory=list)
    """Bind mounts ``SRC[:DST[:FLAGS]]`` (``/lustre:/lustre``, ``/scratch:/scratch:ro``); the repository
    checkout and the run directory are always mounted at their host paths."""
    workdir: str = ""
    """Working directory inside the container; empty: the repository checkout (``SAO_ROOT``)."""


@dataclass
class ClusterConfig:
    """Hardware and node placement of a run, read by ``sao submit`` (Slurm + Ray) and ``sao plan``.

    Node groups are disjoint and ordered actor, critic, rollout; the first actor node hosts the
    Ray head and the driver (``sao train``). See docs/launch.md."""

    gpus_per_node: int = 0
    """GPUs per node; 0 for CPU-only runs, where every role shares one node (laptop, CI)."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU in GiB (H100: 80, H200: 141); ``sao plan`` rejects roles that do not fit."""
    actor_nodes: int = 0
    """Nodes of the actor group; 0 derives ceil(actor.parallel.world_size / gpus_per_node)."""
    critic_nodes: int = 0
    """Nodes of the critic group; 0 derives ceil(critic.parallel.world_size / gpus_per_node)."""
    rollout_nodes: int = 0
    """Nodes of the SGLang engines; 0 derives ceil(num_engines * rollout.tensor_parallel / gpus_per_node)."""
    engine_dp_attention: int = 1
    """Data-parallel attention ranks per SGLang engine (``--dp-size`` with ``--enable-dp-attention``;
    attention TP = rollout.tensor_parallel / this); 1 turns DP attention off."""
    engine_mem_fraction: float = 0.85
    """Share of GPU memory an SGLang engine takes for weights and KV cache (``--mem-fraction-static``)."""
    ray_address: str = ""
    """Join this Ray cluster (``host:port``); empty: start a local one. launch/slurm/sao.sbatch and
    ``SAO_RAY_HEAD=1 launch/local.sh`` set it for the Ray cluster they started."""
    cpus_per_rank: float = 0.5
    """Ray CPUs each trainer rank (actor or critic) reserves."""
    placement_timeout_s: float = 600.0
    """How long a role's ranks or an engine may wait for Ray to place them before the run fails
    with what they need and what each node offers (instead of waiting forever)."""
    checkpoint_gb_per_s: float = 2.0
    """Assumed checkpoint write bandwidth per training node in GiB/s (a share of a parallel file
    system; measure yours). ``sao submit`` sizes the pre-time-limit signal from it: 120 s plus the
    time to write the actor and critic checkpoints (weights + optimizer state, from ``sao plan``'s
    parameter counts) at this rate from their nodes."""
    container: ContainerConfig = field(default_factory=ContainerConfig)
    """The container the Slurm job's commands run in (``sao submit``; see docs/launch.md)."""
    env: dict = field(default_factory=dict)
    """Environment variables exported on every node before Ray starts (NCCL / InfiniBand settings,
    e.g. ``{NCCL_IB_HCA: mlx5, NCCL_SOCKET_IFNAME: ib0}``); names must be shell identifiers."""


@dataclass
class SAOConfig:
    """A whole run: model shape, roles and run settings."""

    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
