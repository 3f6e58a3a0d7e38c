"""Token logprobs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its slice ``[V_r, V_r + V/tp)`` of the vocabulary. All-reduces of
``[B, T]`` tensors (max, sum of exponentials, target logit, sum of ``exp * logit``) give exact
``log softmax`` values for the target tokens and the entropy. Memory per rank stays at its
``[B, T, V/tp]`` slice, which matters at 150K vocabularies and 128K tokens.

Memory: the float32 work (scaled logits, their exponentials) is done a chunk of tokens at a time
(at most ``CHUNK_ELEMENTS`` logits per chunk), and backward recomputes the softmax from the logits,
which the output layer keeps alive anyway. So the function saves no full-size tensor of its own
(the logits it saves are the input's storage: 4 bytes per logit in fp32, 2 in bf16, plus 16 bytes
per token), and its peak beyond the logits is the gradient it returns (one input-sized tensor)
plus two float32 chunks. ``plan/memory.py`` budgets the logits step from these figures
(``LOGIT_COPIES``); ``tests/models/test_logprobs_memory.py`` measures them.

Gradients: ``d logprob_t / d logit_{t,j} = (1[j = target_t] - softmax_{t,j}) / temperature``,
computed locally per slice. Entropy is returned without gradient (a metric here).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_ELEMENTS = 1 << 24
"""Logits per float32 work chunk (64 MiB); a chunk is at least one token."""


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _chunks(tokens: int, vocab: int, chunk_elements: int) -> list[tuple[int, int]]:
    step = max(1, chunk_elements // max(1, vocab))
    return [(start, min(start + step, tokens)) for start in range(0, tokens, step)]


def _target_mask(labels: torch.Tensor, vocab_start: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each label's index in this rank's slice (0 where outside it) and whether it is inside."""
    local = labels - vocab_start
    inside = (local >= 0) & (local < vocab)
    return torch.where(inside, local, torch.zeros_like(local)), inside


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group, temperature, chunk_elements):
        vocab = logits.shape[-1]
        x = logits.reshape(-1, vocab)  # a view for Megatron's contiguous [b, s, V/tp] output
        flat_labels = labels.reshape(-1)
        tokens = x.shape[0]
        safe, inside = _target_mask(flat_labels, vocab_start, vocab)
        # max in the input dtype is exact; dividing by temperature > 0 commutes with it
        shift = _all_reduce(x.max(dim=-1).values.float() / temperature, dist.ReduceOp.MAX, group)
        target = torch.gather(x, -1, safe.unsqueeze(-1)).squeeze(-1).float() / temperature * inside
        target = _all_reduce(target, dist.ReduceOp.SUM, group)
        sum_exp = torch.empty(tokens, dtype=torch.float32, device=x.device)
        sum_exp_x = torch.empty_like(sum_exp)  # sum_j exp(x_j - shift) (x_j - shift)
        for start, end in _chunks(tokens, vocab, chunk_elements):
            shifted = x[start:end].float() / temperature
            shifted.sub_(shift[start:end].unsqueeze(-1))
            e = torch.exp(shifted)
            sum_exp[start:end] = e.sum(dim=-1)
            sum_exp_x[start:end] = e.mul_(shifted).sum(dim=-1)
            del shifted, e
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        _all_reduce(sum_exp_x, dist.ReduceOp.SUM, group)
        log_sum_exp = torch.log(sum_exp)
        # log p_y = (x_y - shift) - log sum_exp: both terms small, no rounding at the logits' magnitude
        logprobs = (target - shift) - log_sum_exp
        # H = logsumexp - sum_j p_j x_j = log(sum_exp) - sum_j p_j (x_j - shift)
        entropy = (log_sum_exp - sum_exp_x / sum_exp).view(labels.shape)
        ctx.save_for_backward(logits, labels, torch.stack([shift, log_sum_exp]).view(2, *labels.shape))
        ctx.vocab_start, ctx.temperature, ctx.chunk_elements = vocab_start, temperature, chunk_elements
        ctx.mark_non_differentiable(entropy)
        return logprobs.view(labels.shape), entropy

    @staticmethod
    def backward(ctx, *grad_outputs):
        grad_logprobs, _grad_entropy = grad_outputs  # the entropy output is non-differentiable
        logits, labels, stats = ctx.saved_tensors
        shift, log_sum_exp = stats.reshape(2, -1)
        vocab = logits.shape[-1]
        x = logits.reshape(-1, vocab)
        safe, inside = _target_mask(labels.reshape(-1), ctx.vocab_start, vocab)
        weight = grad_logprobs.reshape(-1).float() / ctx.temperature
        grad = torch.empty_like(x)
        for start, end in _chunks(x.shape[0], vocab, ctx.chunk_elements):
            p = x[start:end].float() / ctx.temperature
            p.sub_(shift[start:end].unsqueeze(-1)).sub_(log_sum_exp[start:end].unsqueeze(-1)).exp_()  # softmax
            p.neg_().scatter_add_(-1, safe[start:end].unsqueeze(-1), inside[start:end].unsqueeze(-1).to(p.dtype))
            grad[start:end] = p.mul_(weight[start:end].unsqueeze(-1))
            del p
        return grad.view(logits.shape), None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp_group=None,
    temperature: float = 1.0,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(logprobs, entropy)``, each ``[B, T]`` float32, for vocab-parallel ``logits``.

    Args:
        logits: ``[B, T, V/tp]`` this rank's vocabulary slice (rank r holds ids
            ``[r * V/tp, (r + 1) * V/tp)``, Megatron's layout).
        labels: ``[B, T]`` token ids (global vocabulary) whose logprob is wanted.
        tp_group: the tensor-parallel group; ``None`` means the logits hold the full vocabulary.
        temperature: the logits are divided by it (match the engine's sampling temperature); done
            inside the chunks, so it costs no logits-sized copy.
        chunk_elements: logits per float32 work chunk (memory/speed trade-off; results do not
            depend on it beyond float rounding).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on [B, T]")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rank = dist.get_rank(tp_group) if group_is_parallel(tp_group) else 0
    vocab_start = rank * logits.shape[-1]
    return _VocabParallelLogprobs.apply(logits, labels, vocab_start, tp_group, temperature, chunk_elements)


def group_is_parallel(group) -> bool:
    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
