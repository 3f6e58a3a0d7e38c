"""Pure-torch stand-in for the ``sgl_kernel`` ops SGLang 0.5.23's CPU engine imports.

Not the real sgl-kernel. Only loaded by SGLang server subprocesses started on CPU by
``sao_megatron.rollout.engine`` (this directory is on their PYTHONPATH, nowhere else).
"""

import torch

__version__ = "0.0.0+sao-cpu-standin"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Write each request's new KV-cache slots into its row of the request->token table.

    For request i: ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` takes
    the next ``end - start`` entries of ``out_cache_loc`` (requests are laid out back to back).
    """
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    cursor = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[cursor : cursor + n].to(req_to_token.dtype)
        cursor += n


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel CPU stand-in: op '{name}' is not implemented; this SGLang code path needs the "
            "real sgl-kernel (GPU) or a stand-in added to sao_megatron/rollout/sglang_cpu"
        )

    missing.__name__ = name
    return missing


__all__ = ["assign_req_to_token_pool_cpu", "torch"]
