"""The vocab-parallel logprob function's memory, measured, and its gradients against the full-vocabulary
``log_softmax`` at TP 1 and 2 (issue 29: the 30B config's logits step must fit where the plan says).

Saved bytes are what autograd's saved-tensor hooks see; the peak is torch's ``MemTracker`` (a dispatch
mode that follows every tensor's storage, so it measures bytes of tensors, not the process's RSS). Both are
divided by the logits' element count. The shape is cut into 8 chunks, as a production micro-batch is
cut into hundreds (2.49e9 logits per rank in configs/qwen3_30b_a3b_math.yaml, 2**24 per chunk).
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker

from sao_megatron.models.logprobs import vocab_parallel_logprobs
from tests.tolerance import log_softmax_atol, sum_rtol

TOKENS = (2, 301)  # [B, T], odd T
VOCAB = 4096
TEMPERATURE = 0.7


def _measure(logits: torch.Tensor, labels: torch.Tensor, group, weights: torch.Tensor) -> dict:
    """Saved bytes, peak bytes beyond the logits, logprobs and the logits' gradient for one forward and
    backward of ``sum(weights * logprobs)``."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    logits = logits.detach().requires_grad_(True)
    tracker = MemTracker()
    tracker.track_external(logits)
    with tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logprobs, entropy = vocab_parallel_logprobs(
                logits, labels, group, temperature=TEMPERATURE, chunk_elements=logits.numel() // 8
            )
        (logprobs * weights).sum().backward()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
    per_logit = {t.data_ptr(): t.numel() * t.element_size() for t in saved if t.shape == logits.shape}
    rest = {t.data_ptr(): t.numel() * t.element_size() for t in saved if t.shape != logits.shape}
    assert logits.grad is not None
    return {
        "saved_per_logit": sum(per_logit.values()) / logits.numel(),
        "saved_per_token": sum(rest.values()) / labels.numel(),
        "peak_beyond_logits_per_logit": (peak - logits.numel() * logits.element_size()) / logits.numel(),
        "logprobs": logprobs.detach(),
        "entropy": entropy,
        "grad": logits.grad,
    }


def _reference(full: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> dict:
    """Today's semantics on the whole vocabulary (autograd through ``log_softmax(logits / T)``), and the
    bounds two float32 evaluations of it may differ by (tests/tolerance.py): ``atol`` on a logprob;
    ``atol (1 + H)`` plus the ``sum p (x - max)`` summation (|x - max| <= 2 max|x|) on the entropy; on a gradient entry
    ``|w| / T (1[v = y] - p_v)`` the error of ``p_v = exp(log p_v)``, ``|w| / T p_v (atol + 2 eps)``, plus the
    three roundings each side makes at the magnitude ``|w| / T`` (a product, ``1 - p`` or ``w - p w``, a
    scaling by ``1 / T``): ``3 eps |w| / T``."""
    full = full.detach().requires_grad_(True)
    logp = torch.log_softmax(full / TEMPERATURE, dim=-1)
    ref = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    (ref * weights).sum().backward()
    x = full.detach() / TEMPERATURE
    atol = log_softmax_atol(x)
    eps = torch.finfo(torch.float32).eps
    assert full.grad is not None
    return {
        "logprobs": ref.detach(),
        "entropy": entropy.detach(),
        "grad": full.grad,
        "logprob_atol": atol,
        "entropy_atol": atol * (1 + entropy.max().item()) + sum_rtol(VOCAB) * 2 * x.abs().max().item(),
        "grad_bound": weights.abs().unsqueeze(-1) / TEMPERATURE * (logp.detach().exp() * (atol + 2 * eps) + 3 * eps),
    }


def _inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    full = (3 * torch.randn(*TOKENS, VOCAB, generator=g)).to(dtype)  # peaked: p_max ~ 0.5
    labels = torch.randint(0, VOCAB, TOKENS, generator=g)
    weights = torch.rand(TOKENS, generator=g) * 2 - 1
    return full, labels, weights


def case(rank: int, world: int, dtype: torch.dtype = torch.float32) -> dict:
    full, labels, weights = _inputs(dtype)
    part = VOCAB // world
    local = full[..., rank * part : (rank + 1) * part].contiguous()
    group = dist.group.WORLD if world > 1 else None
    got = _measure(local, labels, group, weights)
    ref = _reference(full.float(), labels, weights)
    mine = slice(rank * part, (rank + 1) * part)
    grad_diff = (got["grad"].float() - ref["grad"][..., mine]).abs()
    return {
        **{k: v for k, v in got.items() if k not in ("logprobs", "entropy", "grad")},
        "logprob_diff/atol": (got["logprobs"] - ref["logprobs"]).abs().max().item() / ref["logprob_atol"],
        "entropy_diff/atol": (got["entropy"] - ref["entropy"]).abs().max().item() / ref["entropy_atol"],
        "grad_diff": grad_diff.max().item(),
        "grad_diff/bound": (grad_diff / ref["grad_bound"][..., mine]).max().item(),
        "vocab_per_rank": part,
    }


@pytest.fixture(scope="module")
def tp2(parallel_world):
    """The TP 2 case, run in the package's parallel-layout world (tests/models/conftest.py)."""
    return [r["logprobs"] for r in parallel_world]


def _check(r: dict, bytes_per_element: int) -> None:
    assert r["saved_per_logit"] <= bytes_per_element, r  # the logits themselves, nothing derived from them
    assert r["saved_per_token"] <= 16, r  # labels (int64), the shift and log-sum-exp (fp32)
    assert r["peak_beyond_logits_per_logit"] <= 8, r
    assert r["grad_diff/bound"] <= 1, r
    assert r["logprob_diff/atol"] <= 1 and r["entropy_diff/atol"] <= 1, r


def test_logprobs_memory_and_gradients_single_rank():
    r = case(0, 1)
    _check(r, 4)


def test_logprobs_memory_and_gradients_tensor_parallel(tp2):
    for r in tp2:
        assert r["vocab_per_rank"] == VOCAB // 2
        _check(r, 4)


def test_bf16_logits_save_only_themselves():
    r = case(0, 1, torch.bfloat16)
    assert r["saved_per_logit"] <= 2 and r["saved_per_token"] <= 16, r
    # beyond bf16 logits: their bf16 gradient (2) and two float32 chunks of 1/8 each (1): <= 4
    assert r["peak_beyond_logits_per_logit"] <= 4, r
