"""Belayer's CPU stand-in for SGLang's kernel package (see ../README.md).

``sgl_kernel`` ships CUDA wheels only, and SGLang's CPU kernels need AVX-512/AMX; SGLang
0.5.23 nevertheless imports these names at import time on its CPU path. The one that
runs on the serving path has a plain-torch body; the others raise if ever called, so a
code path that would need a real kernel fails loudly instead of computing garbage.
"""

__version__ = "0.0.0+belayer-cpu-stand-in"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """req_to_token[req_i, start_i:end_i] = the next end_i - start_i slots of out_cache_loc."""
    del pool_len  # row length of req_to_token; the slicing below knows it
    offset = 0
    rows = req_pool_indices.tolist()
    starts, ends = start_offset.tolist(), end_offset.tolist()
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


def _not_available(name):
    def stub(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: the Belayer CPU stand-in has no kernel for it "
            "(install SGLang's kernel package on a machine it supports)")

    stub.__name__ = name
    return stub


# Imported at import time by SGLang 0.5.23 on the CPU path; never called while serving
# (speculative decoding and KV moves between devices).
for _name in (
    "copy_all_layer_kv_cache_cpu",  # KV moves between pools
    "build_tree_kernel_efficient_cpu",  # speculative decoding, below
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
):
    globals()[_name] = _not_available(_name)
