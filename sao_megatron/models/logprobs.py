"""Token logprobs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its slice ``[V_r, V_r + V/tp)`` of the vocabulary. Three
all-reduces of ``[B, T]`` tensors (max, sum of exponentials, target logit) give exact
``log softmax`` values for the target tokens; one more gives the entropy. Memory per rank
stays at its ``[B, T, V/tp]`` slice, which matters at 150K vocabularies and 128K tokens.

Gradients: ``d logprob_t / d logit_{t,j} = 1[j = target_t] - softmax_{t,j}``, computed
locally per slice. Entropy is returned without gradient (a metric here).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group):
        x = logits.float()
        local_max = x.max(dim=-1).values
        global_max = _all_reduce(local_max.clone(), dist.ReduceOp.MAX, group)
        exp = torch.exp(x - global_max.unsqueeze(-1))  # [B, T, V/tp]
        sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group)
        local_vocab = x.shape[-1]
        local_labels = labels - vocab_start
        in_slice = (local_labels >= 0) & (local_labels < local_vocab)
        safe = torch.where(in_slice, local_labels, torch.zeros_like(local_labels))
        target = torch.gather(x, -1, safe.unsqueeze(-1)).squeeze(-1) * in_slice
        target = _all_reduce(target, dist.ReduceOp.SUM, group)
        logsumexp = torch.log(sum_exp) + global_max
        probs = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(probs, safe, in_slice)
        ctx.input_dtype = logits.dtype
        # Entropy H = logsumexp - sum_j p_j x_j (no gradient).
        expected_logit = _all_reduce((probs * x).sum(dim=-1), dist.ReduceOp.SUM, group)
        entropy = logsumexp - expected_logit
        ctx.mark_non_differentiable(entropy)
        return target - logsumexp, entropy

    @staticmethod
    def backward(ctx, *grad_outputs):
        grad_logprobs, _grad_entropy = grad_outputs  # the entropy output is non-differentiable
        probs, safe, in_slice = ctx.saved_tensors
        grad = -probs
        grad.scatter_add_(-1, safe.unsqueeze(-1), in_slice.unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_logprobs.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, tp_group=None, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(logprobs, entropy)``, each ``[B, T]`` float32, for vocab-parallel ``logits``.

    Args:
        logits: ``[B, T, V/tp]`` this rank's vocabulary slice (rank r holds ids
            ``[r * V/tp, (r + 1) * V/tp)``, Megatron's layout).
        labels: ``[B, T]`` token ids (global vocabulary) whose logprob is wanted.
        tp_group: the tensor-parallel group; ``None`` means the logits hold the full vocabulary.
        temperature: divide logits by it first (match the engine's sampling temperature).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on [B, T]")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rank = dist.get_rank(tp_group) if group_is_parallel(tp_group) else 0
    if temperature != 1.0:
        logits = logits / temperature
    vocab_start = rank * logits.shape[-1]
    return _VocabParallelLogprobs.apply(logits, labels, vocab_start, tp_group)


def group_is_parallel(group) -> bool:
    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
