"""The learner's trainable copy of the engine's decoder.

The reference worker's forward (``belayer_engine.backends.reference.model``) runs under ``inference_mode``
over borrowed arena memory, so the learner keeps its own ``nn.Module`` with the *same*
parameter names, shapes and numeric primitives (``belayer_engine.backends.reference.ops``: RMSNorm, RoPE)
and a plain batched, differentiable forward. ``hf_state_dict()`` is exactly what
``EngineWeights.update_weights`` (the engine's weight endpoint) takes, so the engine serves
what the learner trained.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from belayer_engine.backends.reference import ops
from belayer_engine.model.config import ModelConfig
from belayer_engine.model.weights import init_weights


def _key(name: str) -> str:
    return name.replace(".", "__")  # ParameterDict keys cannot contain dots


class PolicyModel(nn.Module):
    """Qwen3-style decoder over HF-named parameters (initialised like the arena's seed)."""

    def __init__(self, cfg: ModelConfig | None = None, seed: int = 0):
        super().__init__()
        self.cfg = cfg or ModelConfig()
        weights = init_weights(self.cfg, seed)
        self.names = list(weights)
        self.params = nn.ParameterDict({_key(n): nn.Parameter(t.float()) for n, t in weights.items()})
        cos, sin = ops.rope_tables(self.cfg.head_dim, self.cfg.max_position_embeddings,
                                   self.cfg.rope_theta, "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def w(self, name: str) -> torch.Tensor:
        return self.params[_key(name)]

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """HF name -> detached tensor (what an engine or arena weight update expects)."""
        return {n: self.w(n).detach() for n in self.names}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab) for right-padded ids (B, T); causal, so padding is inert."""
        cfg = self.cfg
        b, t = ids.shape
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos, sin = self.cos[:t].repeat(b, 1), self.sin[:t].repeat(b, 1)
        x = self.w("model.embed_tokens.weight")[ids]
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            h = ops.rms_norm(x, self.w(p + "input_layernorm.weight"), cfg.rms_norm_eps)
            q = F.linear(h, self.w(p + "self_attn.q_proj.weight")).view(b * t, hq, d)
            k = F.linear(h, self.w(p + "self_attn.k_proj.weight")).view(b * t, hkv, d)
            v = F.linear(h, self.w(p + "self_attn.v_proj.weight")).view(b, t, hkv, d)
            if cfg.qk_norm:
                q = ops.rms_norm(q, self.w(p + "self_attn.q_norm.weight"), cfg.rms_norm_eps)
                k = ops.rms_norm(k, self.w(p + "self_attn.k_norm.weight"), cfg.rms_norm_eps)
            q = ops.apply_rope(q, cos, sin).view(b, t, hq, d).transpose(1, 2)
            k = ops.apply_rope(k, cos, sin).view(b, t, hkv, d).transpose(1, 2)
            v = v.transpose(1, 2)
            group = hq // hkv
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d ** -0.5)
            x = x + F.linear(a.transpose(1, 2).reshape(b, t, hq * d), self.w(p + "self_attn.o_proj.weight"))
            h = ops.rms_norm(x, self.w(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
            gate = F.linear(h, self.w(p + "mlp.gate_proj.weight"))
            up = F.linear(h, self.w(p + "mlp.up_proj.weight"))
            x = x + F.linear(F.silu(gate) * up, self.w(p + "mlp.down_proj.weight"))
        h = ops.rms_norm(x, self.w("model.norm.weight"), cfg.rms_norm_eps)
        return F.linear(h, self._head())

    def _head(self) -> torch.Tensor:
        return self.w("lm_head.weight") if "lm_head.weight" in self.names else self.w("model.embed_tokens.weight")

    def forward_packed(self, ids: torch.Tensor, lengths: list[int], rows: torch.Tensor) -> torch.Tensor:
        """Logits (len(rows), vocab) at rows ``rows`` of sequences packed back to back in
        ``ids`` (N,) with the given ``lengths``: the same function as ``forward`` on each
        sequence alone, without padding. The products run over the N real tokens only,
        attention runs per sequence over exactly its keys (the query heads of a key/value
        head share its keys: no repeated copy), and the final norm and vocabulary product
        only where a log-prob is taken (the learner scores generated tokens, a minority).
        On the CPU demo this made a GRPO update about a quarter cheaper than the padded
        batch (its padding, the repeated keys, logits of every prompt position)."""
        cfg = self.cfg
        n = ids.shape[0]
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        pos = torch.cat([torch.arange(length) for length in lengths])
        cos, sin = self.cos[pos], self.sin[pos]
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + length)
        x = self.w("model.embed_tokens.weight")[ids]
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            h = ops.rms_norm(x, self.w(p + "input_layernorm.weight"), cfg.rms_norm_eps)
            q = F.linear(h, self.w(p + "self_attn.q_proj.weight")).view(n, hq, d)
            k = F.linear(h, self.w(p + "self_attn.k_proj.weight")).view(n, hkv, d)
            v = F.linear(h, self.w(p + "self_attn.v_proj.weight")).view(n, hkv, d)
            if cfg.qk_norm:
                q = ops.rms_norm(q, self.w(p + "self_attn.q_norm.weight"), cfg.rms_norm_eps)
                k = ops.rms_norm(k, self.w(p + "self_attn.k_norm.weight"), cfg.rms_norm_eps)
            q, k = ops.apply_rope(q, cos, sin).transpose(0, 1), ops.apply_rope(k, cos, sin).transpose(0, 1)
            v = v.transpose(0, 1)
            a = torch.cat([
                F.scaled_dot_product_attention(q[None, :, s:e], k[None, :, s:e], v[None, :, s:e], is_causal=True,
                                               scale=d ** -0.5, enable_gqa=True)[0]
                for s, e in itertools.pairwise(bounds)], dim=1)  # (hq, N, d)
            x = x + F.linear(a.transpose(0, 1).reshape(n, hq * d), self.w(p + "self_attn.o_proj.weight"))
            h = ops.rms_norm(x, self.w(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
            gate = F.linear(h, self.w(p + "mlp.gate_proj.weight"))
            up = F.linear(h, self.w(p + "mlp.up_proj.weight"))
            x = x + F.linear(F.silu(gate) * up, self.w(p + "mlp.down_proj.weight"))
        h = ops.rms_norm(x[rows], self.w("model.norm.weight"), cfg.rms_norm_eps)
        return F.linear(h, self._head())


def pack_turns(turns: list[tuple[list[int], list[int]]]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Merge an episode's turns into as few sequences as possible.

    Turn t+1's prompt usually starts with turn t's prompt + completion (the chat template
    re-renders the same bytes), so one forward pass scores several turns. Where it does not
    (e.g. invalid UTF-8 re-encoded differently), a new sequence starts. Each sequence comes
    with the (start, end) spans of its completion tokens.
    """
    packed: list[tuple[list[int], list[tuple[int, int]]]] = []
    for prompt, completion in turns:
        if not completion:
            continue
        if packed and prompt[: len(packed[-1][0])] == packed[-1][0]:
            ids, spans = packed[-1]
            ids.extend(prompt[len(ids):])
        else:
            ids, spans = list(prompt), []
            packed.append((ids, spans))
        spans.append((len(ids), len(ids) + len(completion)))
        ids.extend(completion)
    return packed


def sequence_logprobs(model: PolicyModel, seqs: list[tuple[list[int], list[tuple[int, int]]]],
                      pad_id: int = 0, temperature: float = 1.0) -> list[torch.Tensor]:
    """Per sequence: log-probabilities of the tokens inside its spans (concatenated), under
    the sampling temperature the tokens were drawn with (the policy is softmax(logits/T)).
    The sequences go through the model packed, unpadded (``PolicyModel.forward_packed``);
    ``pad_id`` is kept for callers of the padded form and unused."""
    ids = torch.tensor([i for s, _ in seqs for i in s], dtype=torch.long)
    rows, targets, counts, offset = [], [], [], 0
    for s, spans in seqs:
        here = [p for a, b in spans for p in range(a - 1, b - 1)]
        rows += [offset + p for p in here]
        targets += [s[p + 1] for p in here]
        counts.append(len(here))
        offset += len(s)
    logits = model.forward_packed(ids, [len(s) for s, _ in seqs], torch.tensor(rows, dtype=torch.long))
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    picked = logp.gather(1, torch.tensor(targets, dtype=torch.long)[:, None])[:, 0]
    return list(picked.split(counts))
