"""SGLang's in-memory layout of a Qwen3 model, built from HF-named weights.

SGLang's model classes fuse ``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into
``gate_up_proj``, pad the vocabulary to a multiple of 64 and keep a rotary
``cos_sin_cache`` buffer per attention layer (one shared module). A weight-cache client
builds the model on the meta device and maps exactly these tensors, so the owner must lay
them out this way (``srt/weight_cache/ipc_loader.py`` checks every shape and dtype and
refuses a model with anything left on the meta device).

All tensors are views into one flat buffer, so sharing it once shares them all, and an
update of an HF-named weight is a copy into its rows of the fused tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from belayer_core.errors import UsageError
from belayer_engine.model.config import ModelConfig
from belayer_engine.model.weights import torch_dtype, weight_specs

VOCAB_PAD = 64


def padded_vocab(cfg: ModelConfig) -> int:
    return -(-cfg.vocab_size // VOCAB_PAD) * VOCAB_PAD


@dataclass(frozen=True)
class Slot:
    """Where (a part of) an HF weight lives: SGLang tensor name and the rows it occupies
    there; ``src`` = (dim, start, length) of the HF tensor that goes there (None: all of it)."""

    target: str
    row_start: int
    rows: int
    src: tuple[int, int, int] | None = None

    def piece(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.src is None else t.narrow(*self.src)


def plan(cfg: ModelConfig, rank: int = 0, size: int = 1) -> tuple[dict[str, tuple[tuple[int, ...], bool]], dict[str, Slot]]:
    """SGLang name -> (shape, is_param), and HF name -> Slot (same order every time), of
    tensor-parallel rank ``rank`` of ``size`` (``tp_layout`` says what a rank holds)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, i = cfg.num_attention_heads * d // size, cfg.intermediate_size // size
    kv_heads = cfg.num_key_value_heads
    kv = max(kv_heads // size, 1) * d
    kv_start = rank * kv if kv_heads >= size else rank // (size // kv_heads) * d  # replicated when fewer heads
    vocab = padded_vocab(cfg) // size
    tensors: dict[str, tuple[tuple[int, ...], bool]] = {}
    slots: dict[str, Slot] = {}

    def whole(hf: str, shape: tuple[int, ...]) -> None:
        tensors[hf] = (shape, True)
        slots[hf] = Slot(hf, 0, shape[0])

    def rows_of(hf: str, target: str, at: int, rows: int, start: int) -> None:
        slots[hf] = Slot(target, at, rows, None if size == 1 else (0, start, rows))

    def columns(hf: str, shape: tuple[int, ...]) -> None:
        tensors[hf] = (shape, True)
        slots[hf] = Slot(hf, 0, shape[0], None if size == 1 else (1, rank * shape[1], shape[1]))

    def vocab_rows(hf: str) -> None:  # padded rows stay zero
        tensors[hf] = ((vocab, h), True)
        start = rank * vocab
        n = max(0, min(vocab, cfg.vocab_size - start))
        rows_of(hf, hf, 0, n, start if n else 0)

    vocab_rows("model.embed_tokens.weight")
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        whole(p + "input_layernorm.weight", (h,))
        qkv = p + "self_attn.qkv_proj.weight"
        tensors[qkv] = ((q + 2 * kv, h), True)
        rows_of(p + "self_attn.q_proj.weight", qkv, 0, q, rank * q)
        rows_of(p + "self_attn.k_proj.weight", qkv, q, kv, kv_start)
        rows_of(p + "self_attn.v_proj.weight", qkv, q + kv, kv, kv_start)
        columns(p + "self_attn.o_proj.weight", (h, q))
        if cfg.qk_norm:
            whole(p + "self_attn.q_norm.weight", (d,))
            whole(p + "self_attn.k_norm.weight", (d,))
        whole(p + "post_attention_layernorm.weight", (h,))
        gate_up = p + "mlp.gate_up_proj.weight"
        tensors[gate_up] = ((2 * i, h), True)
        rows_of(p + "mlp.gate_proj.weight", gate_up, 0, i, rank * i)
        rows_of(p + "mlp.up_proj.weight", gate_up, i, i, rank * i)
        columns(p + "mlp.down_proj.weight", (h, i))
        tensors[p + "self_attn.rotary_emb.cos_sin_cache"] = ((cfg.max_position_embeddings, d), False)
    whole("model.norm.weight", (h,))
    if not cfg.tie_word_embeddings:
        vocab_rows("lm_head.weight")
    assert set(slots) == set(weight_specs(cfg)), "layout out of step with weights.weight_specs"
    return tensors, slots


def rotary_cache(cfg: ModelConfig) -> torch.Tensor:
    """cos | sin for every position, computed as SGLang's ``RotaryEmbedding`` does (float32)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    t = torch.arange(cfg.max_position_embeddings, dtype=torch.float)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class SGLangWeights:
    """The SGLang-layout tensors of one model (of one tensor-parallel rank: ``rank`` of
    ``size``), as views into one flat buffer."""

    def __init__(self, cfg: ModelConfig, device: str | torch.device = "cpu", rank: int = 0, size: int = 1):
        self.cfg = cfg
        self.rank, self.size = rank, size
        self.dtype = torch_dtype(cfg.dtype)
        self.shapes, self.slots = plan(cfg, rank, size)
        # SGLang keeps the rotary cache in float32 on CUDA and in the model's dtype on CPU.
        rotary_dtype = torch.float32 if torch.device(device).type == "cuda" else self.dtype
        weights = {n: sh for n, (sh, _) in self.shapes.items() if not n.endswith("cos_sin_cache")}
        numels = {n: _numel(sh) for n, sh in weights.items()}
        self.flat = torch.zeros(sum(numels.values()), dtype=self.dtype, device=device)
        self.tensors: dict[str, torch.Tensor] = {}
        off = 0
        for name, shape in weights.items():
            self.tensors[name] = self.flat[off:off + numels[name]].view(shape)
            off += numels[name]
        # one rotary cache, as in SGLang (get_rope shares the module across layers)
        self.rotary = rotary_cache(cfg).to(device=device, dtype=rotary_dtype)
        for name in self.shapes:
            if name.endswith("cos_sin_cache"):
                self.tensors[name] = self.rotary
        if cfg.tie_word_embeddings:  # one parameter under both names, as in SGLang
            self.tensors["lm_head.weight"] = self.tensors["model.embed_tokens.weight"]

    def is_param(self, name: str) -> bool:
        return not name.endswith("cos_sin_cache")

    def check(self, updates: dict[str, torch.Tensor]) -> None:
        """Refuse unknown names and wrong shapes before anything is written."""
        specs = weight_specs(self.cfg)
        for name, t in updates.items():
            if name not in specs:
                raise UsageError(f"unknown weight {name!r}")
            if tuple(t.shape) != specs[name]:
                raise UsageError(f"{name}: shape {tuple(t.shape)} != {specs[name]}")

    def write(self, updates: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights into their rows (in place: every mapper sees them)."""
        self.check(updates)
        for name, t in updates.items():
            slot = self.slots[name]
            self.tensors[slot.target][slot.row_start:slot.row_start + slot.rows].copy_(slot.piece(t))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
