"""Skip-observation GAE (token- and step-level), length-adaptive lambda and advantage whitening.

Token-level GAE (Schulman et al. 2015, "High-Dimensional Continuous Control Using GAE"), restricted to
action tokens as in the SAO paper (part 4). Within one trajectory, let ``t`` run over its action tokens
in order and ``n(t)`` be the next action token (the first token of the next action span when ``t``
ends a span: observation tokens in between are skipped; ``V(n(t))`` still sees them via its prefix):

    delta_t = r_t + gamma * V(n(t)) - V(t)
    A_t     = delta_t + gamma * lam * A(n(t))
    A, V(n(t)) := 0 past the trajectory's last action token (terminal), or V(n(t)) := ``bootstrap``
    there when the trajectory was cut by a limit (``truncation_targets``)

Critic targets use a separate ``lam_critic`` (decoupled GAE, VAPO, Yue et al. 2025):
``returns_t = A^{critic}_t + V(t)`` with ``A^{critic}`` the same recurrence with ``lam_critic``
(default 1.0: with ``gamma = 1`` the return is the sum of future rewards, Monte Carlo).

Inputs: ``rewards`` either [B] (one scalar per row, placed on the row's last action token; not
allowed with packing) or [B, T] (per token; only action-token entries are read: a reward written on an
observation/padding token is ignored, so put tool rewards on the preceding action token). ``values``
[B, T] (only action-token entries are read). ``lam`` / ``lam_critic``: a float, a [B] tensor (one per
row) or a [B, T] tensor that is constant over each trajectory's action tokens (e.g. from
``length_adaptive_lambda``). ``segment_ids`` [B, T]: packed rows; recurrences never cross a segment. ``bootstrap`` (optional): the value
of the state after each trajectory's last action token, [B] (per row; not with packing) or [B, T] (read at
each trajectory's last action token); 0 for a trajectory that really ended.
Outputs are [B, T] in ``values.dtype`` and exactly 0 on non-action tokens; internal arithmetic is
float64. All GAE outputs are constants (computed under ``no_grad``).

Metrics (python floats, local to the batch; reduce across ranks with a ``num_action_tokens``-
(``adv/*``, ``returns/*``) or ``num_traj``- (``lambda/mean``) weighted mean, min/max with min/max).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sao_megatron.algo._checks import (
    check_action_mask,
    check_choice,
    check_finite,
    check_nonempty,
    check_nonneg,
    check_positive,
    check_rows_nonempty,
    check_segment_ids,
    check_shape,
    check_tensor,
    check_unit_interval,
    row_counts,
)
from sao_megatron.algo._segments import TrajectoryIndex, trajectory_index
from sao_megatron.algo.choices import STEP_MODES, TRUNCATIONS, StepMode, Truncation
from sao_megatron.algo.masked import masked_mean, masked_var, masked_whiten, metrics_to_floats

# Chunk length of the blockwise scan: a [S, L/C, C] x [S, C, C] bmm per level, log_C(L) levels.
SCAN_CHUNK = 16

Lam = float | Tensor


# --------------------------------------------------------------------------------------- scan core
def reverse_discounted_cumsum(x: Tensor, c: Tensor, chunk: int = SCAN_CHUNK) -> Tensor:
    """``y_t = x_t + c * y_{t+1}`` along the last dim of ``x`` [N, L], ``y_L = 0``; ``c`` [N] per row.

    Exact and underflow-safe for any ``c`` in [0, 1] (including 0): no division by ``c^t``. Blocks of
    ``chunk`` tokens are solved with one batched matmul by the upper-triangular Toeplitz matrix
    ``M[i, j] = c^(j-i)`` (``0^0 = 1``); the values at block starts obey the same recurrence with
    coefficient ``c^chunk`` and are solved recursively, then added back as ``c^(chunk-i) * y_next``.
    Cost O(N * L * chunk) flops, log_chunk(L) levels, no Python loop over tokens.
    """
    n_rows, length = x.shape
    pad = (-length) % chunk
    xb = (F.pad(x, (0, pad)) if pad else x).reshape(n_rows, -1, chunk)  # [N, n, C]
    k = torch.arange(chunk, device=x.device, dtype=x.dtype)
    expo = k[None, :] - k[:, None]  # [C, C]: j - i
    mt = torch.where(expo >= 0, c[:, None, None] ** expo.clamp(min=0), 0.0)  # [N, C, C]
    y = torch.bmm(xb, mt.transpose(1, 2))  # [N, n, C]: in-block sums, as if zero after the block
    if y.shape[1] > 1:
        starts = reverse_discounted_cumsum(y[:, :, 0].contiguous(), c**chunk, chunk)  # [N, n] exact
        nxt = F.pad(starts[:, 1:], (0, 1))  # [N, n]: exact y at the start of the next block
        decay = c[:, None] ** (chunk - k)[None, :]  # [N, C]: c^(chunk - i)
        y.baddbmm_(nxt[:, :, None], decay[:, None, :])  # y += nxt (outer) decay, in place
    return y.reshape(n_rows, -1)[:, :length]


# ------------------------------------------------------------------------------------- validation
def _check_lambda(name: str, lam: Lam, shape: tuple[int, int]) -> None:
    check_unit_interval(name, lam)
    if isinstance(lam, Tensor) and tuple(lam.shape) not in ((shape[0],), tuple(shape)):
        raise ValueError(
            f"`{name}` has shape {tuple(lam.shape)}; pass a float, a [B]={shape[0]} tensor (per row) or a "
            f"[B, T]={tuple(shape)} tensor constant over each trajectory."
        )


def _check_per_row_or_token(name: str, x: Tensor, shape: tuple[int, ...], segment_ids: Tensor | None, fix: str) -> None:
    """``x`` is ``[B]`` (one value per row; not with packed rows, where ``fix`` says what to pass) or ``[B, T]``."""
    check_tensor(name, x)
    if x.dim() == 1:
        check_shape(name, x, shape[:1], like="action_mask rows ([B])")
        if segment_ids is not None:
            raise ValueError(f"`{name}` of shape [B] cannot be used with `segment_ids` (packed rows); {fix}")
    else:
        check_shape(name, x, shape)
    check_finite(name, x)


def _check_bootstrap(bootstrap: Tensor, shape: tuple[int, ...], segment_ids: Tensor | None) -> None:
    fix = "pass [B, T] with each trajectory's bootstrap value on its last action token."
    _check_per_row_or_token("bootstrap", bootstrap, shape, segment_ids, fix)


def _validate(
    rewards: Tensor,
    values: Tensor,
    action_mask: Tensor,
    gamma: float,
    lams: dict[str, Lam],
    segment_ids: Tensor | None,
    bootstrap: Tensor | None = None,
) -> tuple[Tensor, TrajectoryIndex]:
    """Validate the GAE inputs; return the bool mask and the trajectory index."""
    mask = check_action_mask(action_mask)
    shape = tuple(mask.shape)
    check_shape("values", values, shape)
    check_finite("values", values)
    fix = "pass per-token rewards [B, T] with each trajectory's reward on its last action token."
    _check_per_row_or_token("rewards", rewards, shape, segment_ids, fix)
    if isinstance(gamma, Tensor):
        raise ValueError("`gamma` must be a python float in [0, 1].")
    check_unit_interval("gamma", gamma)
    for name, lam in lams.items():
        _check_lambda(name, lam, (shape[0], shape[1]))
    check_segment_ids(segment_ids, shape)
    if bootstrap is not None:
        _check_bootstrap(bootstrap, shape, segment_ids)
    idx = trajectory_index(mask, segment_ids)
    if idx.num_traj == 0:
        check_nonempty(mask)
    if rewards.dim() == 1 and idx.num_traj != shape[0]:
        check_rows_nonempty(mask, "a scalar reward [B] is placed on each row's last action token")
    return mask, idx


def _lambda_per_traj(name: str, lam: Lam, idx: TrajectoryIndex, device: torch.device) -> Tensor:
    """Resolve ``lam`` to one float64 value per trajectory [S]."""
    if not isinstance(lam, Tensor):
        return torch.full((idx.num_traj,), float(lam), dtype=torch.float64, device=device)
    lam = lam.to(device=device, dtype=torch.float64)
    if lam.dim() == 1:
        return lam[idx.rows]
    lam_k = lam.reshape(-1).index_select(0, idx.positions)  # [K]
    changed = lam_k[1:] != lam_k[:-1]  # [K-1]; allowed only where a new trajectory starts
    changed[idx.first[1:] - 1] = False
    if bool(changed.any()):
        raise ValueError(
            f"`{name}` [B, T] must be constant over each trajectory's action tokens (it is one lambda per "
            "trajectory); build it with `length_adaptive_lambda` or pass a float / [B] tensor."
        )
    return lam_k[idx.first]


def _td_errors(v_k: Tensor, idx: TrajectoryIndex, gamma: float) -> Tensor:
    """``gamma * V(n(t)) - V(t)`` at the action tokens [K] (rewards are added by ``_add_rewards``).

    The next action token of a trajectory is the next entry of the K action tokens; past a trajectory's
    last action token V = 0 (terminal, and never across trajectories).
    """
    delta = torch.empty_like(v_k)
    torch.mul(v_k[1:], gamma, out=delta[:-1])
    delta[idx.last()] = 0.0
    return delta.sub_(v_k)


def _add_rewards(out_k: Tensor, rewards: Tensor, idx: TrajectoryIndex) -> Tensor:
    """Add the rewards of the action tokens to ``out_k`` [K] in place: a [B] reward on the row's last
    action token, [B, T] rewards read at the action tokens only (observation rewards are ignored)."""
    if rewards.dim() == 2:
        return out_k.add_(rewards.reshape(-1).index_select(0, idx.positions).to(out_k.dtype))
    out_k[idx.last()] += rewards.to(out_k.dtype)[idx.rows]
    return out_k


def _add_bootstrap(delta: Tensor, bootstrap: Tensor | None, idx: TrajectoryIndex, gamma: float) -> Tensor:
    """Add ``gamma * bootstrap`` to ``delta`` [one entry per action token or turn of ``idx``] at each
    trajectory's last entry, in place: the value of the state after it, for a trajectory cut by a limit."""
    if bootstrap is None:
        return delta
    last = idx.last()
    if bootstrap.dim() == 2:
        boot = bootstrap.reshape(-1).index_select(0, idx.positions[last])
    else:
        boot = bootstrap[idx.rows]
    delta[last] += gamma * boot.to(delta.dtype)
    return delta


def _scan_per_traj(delta: Tensor, idx: TrajectoryIndex, coefs: list[Tensor]) -> list[Tensor]:
    """Solve ``A_t = delta_t + c * A(n(t))`` per trajectory for each coefficient vector [S] in ``coefs``.

    Each trajectory's action tokens go to the left of its own row of an [S, W] buffer (observation
    gaps, padding and packing disappear), the rows are scanned, and the results are read back [K].
    """
    width = -(-idx.max_len // SCAN_CHUNK) * SCAN_CHUNK
    flat = idx.flat(width)  # [K] position in the [S, W] buffer
    buf = delta.new_zeros(idx.num_traj * width).index_copy_(0, flat, delta).view(idx.num_traj, width)
    return [reverse_discounted_cumsum(buf, c).reshape(-1).index_select(0, flat) for c in coefs]


def _to_tokens(values_k: Tensor, idx: TrajectoryIndex, dtype: torch.dtype) -> Tensor:
    """Action-token values [K] -> [B, T] with zeros on non-action tokens."""
    b, t = idx.shape
    out = torch.zeros(b * t, dtype=dtype, device=values_k.device)
    return out.index_copy_(0, idx.positions, values_k.to(dtype)).view(b, t)


def _gae_metrics(adv_k: Tensor, ret_k: Tensor, lam_s: Tensor) -> dict[str, float]:
    """Metrics from the action-token advantages/returns [K] and per-trajectory lambdas [S]."""
    k = adv_k.numel()
    adv_mean, ret_mean = adv_k.sum() / k, ret_k.sum() / k
    adv_min, adv_max = torch.aminmax(adv_k)
    return metrics_to_floats(
        {
            "adv/mean": adv_mean,
            "adv/std": (torch.dot(adv_k, adv_k) / k - adv_mean**2).clamp(min=0).sqrt(),
            "adv/min": adv_min,
            "adv/max": adv_max,
            "returns/mean": ret_mean,
            "returns/std": (torch.dot(ret_k, ret_k) / k - ret_mean**2).clamp(min=0).sqrt(),
            "lambda/mean": lam_s.mean(),
            "num_traj": float(lam_s.numel()),
            "num_action_tokens": float(k),
        }
    )


# --------------------------------------------------------------------------------- token-level GAE
@torch.no_grad()
def gae(
    rewards: Tensor,
    values: Tensor,
    action_mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: Lam,
    lam_critic: Lam = 1.0,
    segment_ids: Tensor | None = None,
    bootstrap: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Vectorised skip-observation token-level GAE; returns ``(advantages, returns, metrics)``, [B, T].

    Gathers the K action tokens in order, forms ``delta`` there, compacts each trajectory into a row
    of an [S, W] buffer (observation gaps, padding and packing disappear) and solves the recurrence
    with ``reverse_discounted_cumsum`` (twice when ``lam_critic`` differs from ``lam``).
    Memory ~ S * W floats with W the longest trajectory (in action tokens).
    """
    lams = {"lam": lam, "lam_critic": lam_critic}
    mask, idx = _validate(rewards, values, action_mask, gamma, lams, segment_ids, bootstrap)
    lam_s = _lambda_per_traj("lam", lam, idx, mask.device)
    lamc_s = _lambda_per_traj("lam_critic", lam_critic, idx, mask.device)
    v_k = values.reshape(-1).index_select(0, idx.positions).to(torch.float64)  # [K]
    delta = _add_bootstrap(_add_rewards(_td_errors(v_k, idx, gamma), rewards, idx), bootstrap, idx, gamma)  # [K]
    same = lam_s.equal(lamc_s)
    parts = _scan_per_traj(delta, idx, [gamma * lam_s] if same else [gamma * lam_s, gamma * lamc_s])
    adv_k = parts[0]
    ret_k = v_k.add_(parts[-1])  # returns = A_critic + V (reuses the V buffer)
    adv = _to_tokens(adv_k, idx, values.dtype)
    ret = _to_tokens(ret_k, idx, values.dtype)
    return adv, ret, _gae_metrics(adv_k, ret_k, lam_s)


def truncation_targets(
    rewards: Tensor, cut_values: Tensor, truncated: Tensor, mode: Truncation
) -> tuple[Tensor, Tensor | None]:
    """The ``rewards`` and ``bootstrap`` [B] that ``gae`` / ``step_gae`` take for a batch whose rows
    ``truncated`` [B] bool were cut by a limit (turns, context, token budgets) rather than ended.

    ``terminal``: the cut is treated as the episode's end: ``(rewards, None)``, each last action token's
    target is its episode's reward. ``bootstrap``: a cut row's reward (the grade of an unfinished episode)
    is replaced by the critic's value at the cut, ``cut_values`` [B]: the value of the state after the
    row's last token, which a next action would have been sampled from (the position that predicts the
    token after the sequence's end); rows that ended keep their reward and bootstrap 0. Float64 outputs.
    """
    check_choice("truncation", mode, TRUNCATIONS)
    check_shape("truncated", truncated, tuple(rewards.shape), like="rewards ([B])")
    check_shape("cut_values", cut_values, tuple(rewards.shape), like="rewards ([B])")
    rewards = rewards.to(torch.float64)
    if mode == "terminal":
        return rewards, None
    cut = truncated.to(torch.bool)
    check_finite("cut_values", cut_values[cut])
    zero = torch.zeros_like(rewards)
    return torch.where(cut, zero, rewards), torch.where(cut, cut_values.to(torch.float64), zero)


def _lam_at(lam: Lam, b: int, t: int) -> float:
    if not isinstance(lam, Tensor):
        return float(lam)
    return float(lam[b]) if lam.dim() == 1 else float(lam[b, t])


def _boot_at(bootstrap: Tensor | None, b: int, t: int) -> float:
    if bootstrap is None:
        return 0.0
    return float(bootstrap[b]) if bootstrap.dim() == 1 else float(bootstrap[b, t])


@torch.no_grad()
def gae_reference(
    rewards: Tensor,
    values: Tensor,
    action_mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: Lam,
    lam_critic: Lam = 1.0,
    segment_ids: Tensor | None = None,
    bootstrap: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Plain Python loop over tokens implementing exactly the formulas of the module docstring.

    Slow (python floats, one token at a time); it is the oracle for ``gae`` in tests and benchmarks.
    """
    lams = {"lam": lam, "lam_critic": lam_critic}
    mask, _ = _validate(rewards, values, action_mask, gamma, lams, segment_ids, bootstrap)
    b_size, t_size = mask.shape
    adv = [[0.0] * t_size for _ in range(b_size)]
    ret = [[0.0] * t_size for _ in range(b_size)]
    lam_last: list[float] = []  # lambda of each trajectory, read at its last action token
    for b in range(b_size):
        m = mask[b].tolist()
        v = values[b].double().tolist()
        seg = segment_ids[b].tolist() if segment_ids is not None else [0] * t_size
        if rewards.dim() == 2:
            r = rewards[b].double().tolist()
        else:  # scalar reward on the row's last action token
            r = [0.0] * t_size
            r[max(t for t in range(t_size) if m[t])] = float(rewards[b])
        next_seg, next_v, next_a, next_ac = None, 0.0, 0.0, 0.0  # about the next action token
        for t in reversed(range(t_size)):
            if not m[t]:
                continue  # observation / padding token: skipped
            if seg[t] != next_seg:  # last action token of its trajectory: terminal, or cut and bootstrapped
                next_v, next_a, next_ac = _boot_at(bootstrap, b, t), 0.0, 0.0
                lam_last.append(_lam_at(lam, b, t))
            delta = r[t] + gamma * next_v - v[t]
            a = delta + gamma * _lam_at(lam, b, t) * next_a
            ac = delta + gamma * _lam_at(lam_critic, b, t) * next_ac
            adv[b][t], ret[b][t] = a, ac + v[t]
            next_seg, next_v, next_a, next_ac = seg[t], v[t], a, ac
    adv_t = torch.tensor(adv, dtype=torch.float64)
    ret_t = torch.tensor(ret, dtype=torch.float64)
    metrics = _gae_metrics(adv_t[mask.cpu()], ret_t[mask.cpu()], torch.tensor(lam_last, dtype=torch.float64))
    return adv_t.to(values), ret_t.to(values), metrics


def length_adaptive_lambda(action_mask: Tensor, alpha: float, segment_ids: Tensor | None = None) -> Tensor:
    """VAPO's length-adaptive GAE lambda: ``lam = clamp(1 - 1 / (alpha * l), 0, 1)`` per trajectory.

    ``l`` = number of action tokens of the trajectory (observation tokens excluded; our reading of
    VAPO's "sequence length" for agentic trajectories). Paper: ``alpha = 1.5``. Returns float64 in a
    form ``gae``'s ``lam`` accepts: [B] (one per row) without ``segment_ids`` (then every row must have
    an action token: ``l = 0`` has no lambda), and with them [B, T], constant over each trajectory's
    action tokens and 0 elsewhere.
    """
    check_positive("alpha", alpha)
    mask = check_action_mask(action_mask)
    check_segment_ids(segment_ids, tuple(mask.shape))
    if segment_ids is None:
        check_rows_nonempty(mask, "length-adaptive lambda needs l >= 1 action tokens per trajectory")
        return (1.0 - 1.0 / (alpha * row_counts(mask).to(torch.float64))).clamp(0.0, 1.0)
    idx = trajectory_index(mask, segment_ids)
    lam_s = (1.0 - 1.0 / (alpha * idx.lengths.to(torch.float64))).clamp(0.0, 1.0)
    return _to_tokens(lam_s.repeat_interleave(idx.lengths), idx, torch.float64)


# ---------------------------------------------------------------------------------- step-level GAE
def _turns(mask: Tensor, idx: TrajectoryIndex, turn_ids: Tensor | None) -> tuple[Tensor, Tensor, int]:
    """Turn number of each action token [K] (0..G-1) and the index into K of each turn's last token [G].

    A turn is a maximal run of consecutive action tokens (no observation token between them) of one
    trajectory; with ``turn_ids`` [B, T] a new turn starts instead wherever the id changes between
    consecutive action tokens of a trajectory.
    """
    k = idx.positions.numel()
    new = torch.zeros(k, dtype=torch.bool, device=mask.device)
    new[idx.first] = True
    if turn_ids is not None:
        tid = turn_ids.reshape(-1)[idx.positions]
        new[1:] |= tid[1:] != tid[:-1]
    else:
        new[1:] |= idx.positions[1:] != idx.positions[:-1] + 1
    turn = new.long().cumsum(0) - 1  # [K]
    starts = new.nonzero().flatten()
    ends = torch.cat([starts[1:] - 1, starts.new_tensor([k - 1])])
    return turn, ends, starts.numel()


@torch.no_grad()
def step_gae(
    rewards: Tensor,
    values: Tensor,
    action_mask: Tensor,
    *,
    mode: StepMode,
    gamma: float = 1.0,
    lam: Lam,
    lam_critic: Lam = 1.0,
    segment_ids: Tensor | None = None,
    turn_ids: Tensor | None = None,
    bootstrap: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Step-level GAE for the granularity ablation: one advantage per turn, broadcast to its tokens.

    Turn value ``V_k`` = mean of its action tokens' values (``mode="step_mean"``) or its last action
    token's value (``"step_last"``); turn reward ``r_k`` = sum of its action tokens' rewards (the
    terminal reward lands in the last turn). Then GAE over the turns of each trajectory:
    ``delta_k = r_k + gamma * V_{k+1} - V_k``, ``A_k = delta_k + gamma * lam * A_{k+1}``, terminal 0.
    Every action token of turn ``k`` gets ``A_k``; ``returns`` = ``A^{critic}_k + V_k`` broadcast the same
    way (the turn-level critic target). Same inputs as ``gae`` plus ``turn_ids`` [B, T] (optional); a
    ``bootstrap`` value is ``V_{k+1}`` after the last turn of a trajectory cut by a limit.
    """
    check_choice("step-level mode", mode, STEP_MODES)
    lams = {"lam": lam, "lam_critic": lam_critic}
    mask, idx = _validate(rewards, values, action_mask, gamma, lams, segment_ids, bootstrap)
    if turn_ids is not None:
        check_shape("turn_ids", turn_ids, tuple(mask.shape))
    turn, ends, n_turns = _turns(mask, idx, turn_ids)
    v_k = values.reshape(-1).index_select(0, idx.positions).to(torch.float64)  # [K]
    r_k = _add_rewards(torch.zeros_like(v_k), rewards, idx)
    r_turn = torch.zeros(n_turns, dtype=torch.float64, device=mask.device).index_add_(0, turn, r_k)
    if mode == "step_last":
        v_turn = v_k[ends]
    else:
        counts = torch.bincount(turn, minlength=n_turns).to(torch.float64)
        v_turn = torch.zeros(n_turns, dtype=torch.float64, device=mask.device).index_add_(0, turn, v_k) / counts
    # One pseudo-token per turn, at the turn's last action token: same trajectories, same order.
    end_mask = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    end_mask[idx.positions[ends]] = True
    tidx = trajectory_index(end_mask.view(mask.shape), segment_ids)
    lam_s = _lambda_per_traj("lam", lam, idx, mask.device)
    lamc_s = _lambda_per_traj("lam_critic", lam_critic, idx, mask.device)
    delta = _add_bootstrap(_td_errors(v_turn, tidx, gamma).add_(r_turn), bootstrap, tidx, gamma)  # [G] over turns
    a_turn, ac_turn = _scan_per_traj(delta, tidx, [gamma * lam_s, gamma * lamc_s])
    adv_k, ret_k = a_turn[turn], (ac_turn + v_turn)[turn]
    adv = _to_tokens(adv_k, idx, values.dtype)
    ret = _to_tokens(ret_k, idx, values.dtype)
    metrics = _gae_metrics(adv_k, ret_k, lam_s)
    metrics["num_turns"] = float(n_turns)
    return adv, ret, metrics


def whiten_advantages(
    advantages: Tensor, action_mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> tuple[Tensor, dict[str, float]]:
    """Optional (default off in SAO) batch whitening: ``(A - mean) / sqrt(var + eps)`` over action tokens.

    Mean and unbiased variance over the action tokens of the tensors given (local batch; for a global
    whitening all-reduce the sums first). ``shift_mean=False`` rescales only (adds the mean back).
    Zeros on non-action tokens. Metrics: mean/std before whitening (python floats).
    """
    mask = check_action_mask(action_mask)
    check_shape("advantages", advantages, tuple(mask.shape))
    check_finite("advantages", advantages)
    check_nonneg("eps", eps)
    if int(mask.sum()) < 2:
        raise ValueError("`action_mask` selects fewer than 2 action tokens; whitening needs a variance.")
    a = advantages.detach()
    metrics = metrics_to_floats({"adv/mean_raw": masked_mean(a, mask), "adv/std_raw": masked_var(a, mask).sqrt()})
    return masked_whiten(a, mask, shift_mean=shift_mean, eps=eps), metrics
