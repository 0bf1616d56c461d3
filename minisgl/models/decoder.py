"""One decoder-only transformer that runs Llama, Qwen2/2.5 and Qwen3 checkpoints.

The three families differ only in small switches:
  * Qwen2 adds a bias to the q/k/v projections,
  * Qwen3 RMS-normalises each head of q and k before rotary, and may set head_dim explicitly,
  * Llama 3.x stretches the rotary frequencies ("llama3" rope scaling).

Module names mirror the Hugging Face checkpoint names (model.layers.N.self_attn...)
so loading is a plain name lookup, except for two fusions done for speed:
q/k/v become one `qkv_proj` matmul and gate/up become one `gate_up_proj` matmul.

The model never sees padding or per-request tensors: it works on the flat list of
T new tokens of a batch, and the attention backend uses AttentionMetadata to
know which tokens belong to which request (see attention.py).

Plain torch throughout. The elementwise steps (RMSNorm, the residual add, SiLU-and-mul,
rotary, everything between the q/k/v projection and attention) go through one kernels
object, `CausalLM.kernels`: `TorchKernels` below, the reference, unless the engine hands
the model faster ones (minisgl/gpu/fused_ops.py) that compute the same.
"""

from __future__ import annotations

import warnings
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from .attention import AttentionBackend, AttentionMetadata, KVCache
from .checkpoint import FAMILY_OF_ARCHITECTURE, load_config, open_all, read_tensor, safetensors_files
from .rope import rope_inv_freq, rope_parameters

# Our fused parameter -> the checkpoint tensors concatenated (along dim 0) to build it.
FUSED_WEIGHTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


# Rows per GEMM in the deterministic mode: the CUDA-graph runner's largest batch by default.
DETERMINISTIC_ROWS = 256
# On the CPU: small, so that a decode step of a few rows pads little.
CPU_INVARIANT_ROWS = 16


class Linear(nn.Linear):
    """`nn.Linear`, with an optional batch-invariant mode (`fixed_rows`).

    A GEMM library picks its kernel (tiling, how the reduction is split) from the matrix
    shape, so the same row can round differently in a batch of 9 rows than in one of 8. With
    `fixed_rows = S` the rows go through GEMMs of exactly S rows each, the last one padded with
    zeros: every row is then computed by the same kernel, whatever else shares its batch.
    Off (0, the default) it is the plain `nn.Linear` below, which stays the reference.
    """

    fixed_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fixed_rows:
            return super().forward(x)
        return fixed_rows_linear(x, self.weight, self.bias, self.fixed_rows)


def fixed_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """F.linear(x, weight, bias) on x [T, in], computed in slabs of exactly `rows` rows."""
    num = x.shape[0]
    padded = max(1, -(-num // rows)) * rows
    if padded != num:
        x = F.pad(x, (0, 0, 0, padded - num))
    if x.device.type == "cpu":
        # One batched matmul of equal problems (the weight shared, not copied): on the CPU a
        # Python loop over the slabs would cost more than the padding.
        slabs = x.view(padded // rows, rows, x.shape[1])
        out = torch.bmm(slabs, weight.t().expand(slabs.shape[0], -1, -1)).view(padded, -1)
        return (out[:num] + bias) if bias is not None else out[:num]
    out = torch.cat([F.linear(slab, weight, bias) for slab in x.split(rows)])
    return out[:num]


def set_fixed_rows(model: nn.Module, rows: int) -> None:
    """Switch every Linear of `model` to batch-invariant slabs of `rows` rows (0: plain)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.fixed_rows = rows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The mean of squares is computed in float32: in bf16 it loses too many digits.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, its RMSNorm): the residual stream's add and the next norm."""
        residual = residual + x
        return residual, self(residual)


Rotate = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (q, k) -> rotated (q, k)


class Rotation:
    """The rotary embedding of one batch's positions: built once per forward, shared by all layers.
    Called as rotation(q, k) -> (q, k)."""

    def __init__(self, positions: torch.Tensor, dtype: torch.dtype, rotary: RotaryEmbedding) -> None:
        angles = positions.float()[:, None] * rotary.inv_freq.float()[None, :]  # [T, head_dim/2]
        angles = torch.cat((angles, angles), dim=-1)  # both halves of a head share one angle
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, params: dict, max_positions: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        self._cos_sin_cache: torch.Tensor | None = None
        # Not persistent: derived from the config, never stored in checkpoints.
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, params), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        return Rotation(positions, dtype, self)

    def cos_sin_cache(self) -> torch.Tensor:
        """[max_positions, head_dim] float32: cos of every angle, then sin (fused GPU paths)."""
        if self._cos_sin_cache is None:
            positions = torch.arange(self.max_positions, device=self.inv_freq.device, dtype=torch.float32)
            angles = positions[:, None] * self.inv_freq.float()[None, :]
            self._cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
        return self._cos_sin_cache


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] pairwise: dim i is paired with dim i + D/2 ("rotate-half", HF/Neox style)."""
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat((-second, first), dim=-1)
    return x * cos[:, None, :] + rotated_half * sin[:, None, :]


class TorchKernels:
    """The decoder's elementwise steps in plain torch: the reference, and the only path on CPU and
    in float32. gpu/fused_ops.py's FusedKernels overrides each step with fused GPU kernels that
    compute the same; a model reads its kernels from `CausalLM.kernels`."""

    def rms_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def add_rms_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, its RMSNorm). Fused versions may overwrite both inputs: callers own them."""
        return norm.add_and_norm(x, residual)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotation(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> Rotate:
        """The rotary of one batch's positions, made once per forward and passed to every layer's
        qkv_epilogue (the same kernels object's)."""
        return rotary(positions, dtype)

    def qkv_epilogue(self, attn: Attention, qkv: torch.Tensor, rotation: Rotate, out_slots: torch.Tensor,
                     k_pool: torch.Tensor, v_pool: torch.Tensor, q_out: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Everything between attn's q/k/v projection and attention: split into heads, q/k norm
        (Qwen3), rotary. Returns (q, k, v); here the K/V pool writes are left to the attention
        backend (a fused version writes them itself and returns k = v = None). `q_out`: where q
        goes (a piecewise CUDA graph's fixed buffer), else a new tensor."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.reshape(num_tokens, attn.num_heads, attn.head_dim)
        k = k.reshape(num_tokens, attn.num_kv_heads, attn.head_dim)
        v = v.reshape(num_tokens, attn.num_kv_heads, attn.head_dim)
        if attn.qk_norm:
            q, k = self.rms_norm(attn.q_norm, q), self.rms_norm(attn.k_norm, k)
        q, k = rotation(q, k)
        return (q if q_out is None else q_out.copy_(q)), k, v


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, head_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = head_dim
        family = FAMILY_OF_ARCHITECTURE[config.architectures[0]]  # "llama", "qwen2" or "qwen3"
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = family == "qwen2" or attention_bias  # Qwen2 always has q/k/v bias
        out_bias = family != "qwen2" and attention_bias

        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=out_bias)
        self.qk_norm = family == "qwen3"
        if self.qk_norm:  # one RMSNorm over head_dim, shared by all heads
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def project(self, x: torch.Tensor, rope: Rotate, out_slots: torch.Tensor, kv: KVCache, kernels: TorchKernels,
                q_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Everything before attention: (q, k, v); k = v = None when the kernels already wrote the new
        K/V into the pool. Attention itself is the backend's (CausalLM.forward)."""
        qkv = self.qkv_proj(x)
        return kernels.qkv_epilogue(self, qkv, rope, out_slots, kv.k[self.layer_id], kv.v[self.layer_id], q_out)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """Attention's result [T, Hq, D] through the output projection."""
        return self.o_proj(attended.reshape(attended.shape[0], self.q_size))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, kernels: TorchKernels) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, head_dim: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id, head_dim)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    # Pre-norm residual blocks, residual + attn(norm(...)) then residual + mlp(norm(...)), with the
    # residual stream carried beside `h` (the previous block's output, not added yet), so that every
    # add is fused with the norm after it. A layer is two halves around the backend's attention:
    # CausalLM.forward runs them in order, and a piecewise CUDA graph (gpu/piecewise_graph.py)
    # captures one layer's second half with the next layer's first.
    def before_attention(self, h: torch.Tensor, residual: torch.Tensor | None, rope: Rotate, out_slots: torch.Tensor,
                         kv: KVCache, kernels: TorchKernels, q_out: torch.Tensor | None = None
                         ) -> tuple[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]:
        """((q, k, v), residual). `residual` is None at the first layer."""
        if residual is None:
            residual, x = h, kernels.rms_norm(self.input_layernorm, h)
        else:
            residual, x = kernels.add_rms_norm(self.input_layernorm, h, residual)
        return self.self_attn.project(x, rope, out_slots, kv, kernels, q_out), residual

    def after_attention(self, attended: torch.Tensor, residual: torch.Tensor, kernels: TorchKernels
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual): the output projection, the residual add and norm, the MLP."""
        residual, x = kernels.add_rms_norm(self.post_attention_layernorm, self.self_attn.output(attended), residual)
        return self.mlp(x, kernels), residual


class Decoder(nn.Module):
    """Container named `model` inside CausalLM, so parameter names match the checkpoint."""

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, head_dim) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(head_dim, rope_parameters(config), config.max_position_embeddings)


class CausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = config.num_key_value_heads or config.num_attention_heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.vocab_size: int = config.vocab_size
        self.model = Decoder(config, self.head_dim)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.kernels = TorchKernels()  # the engine may hand the model fused GPU ones instead

    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVCache, backend: AttentionBackend,
        every_position: bool = False,
    ) -> torch.Tensor:
        """input_ids [T] (the new tokens of all requests) -> logits [B, vocab] in the model's dtype,
        one row per request, for its last new token (the one that predicts the next token);
        `every_position`: [T, vocab], one row per new token (a speculative verify)."""
        h, residual = self.model.embed_tokens(input_ids), None
        kernels = self.kernels
        rope = kernels.rotation(self.model.rotary, meta.positions, h.dtype)  # computed once, shared by all layers
        for layer in self.model.layers:
            (q, k, v), residual = layer.before_attention(h, residual, rope, meta.out_slots, kv, kernels)
            attended = backend.forward(q, k, v, layer.self_attn.layer_id, meta, kv)
            h, residual = layer.after_attention(attended, residual, kernels)
        return self.logits(h, residual, meta, every_position)

    def logits(self, h: torch.Tensor, residual: torch.Tensor, meta: AttentionMetadata,
               every_position: bool = False) -> torch.Tensor:
        """The last layer's output and residual -> logits (see forward)."""
        kernels = self.kernels
        # Only the last new token of each request needs logits; the vocab projection is
        # the largest matmul in small models, so skip it for all other prompt tokens.
        last_rows = meta.qo_indptr[1:].long() - 1 if not every_position else slice(None)
        _, h = kernels.add_rms_norm(self.model.norm, h[last_rows], residual[last_rows])
        # Not cast to float32 here: a greedy step only needs the argmax, which is the same in bf16,
        # and the cast would write and read [B, vocab] float32 each step; sample() casts if it samples.
        return self.lm_head(h)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> tuple[CausalLM, PretrainedConfig]:
    """Build a CausalLM from a local Hugging Face checkpoint folder (config.json + *.safetensors).
    Anything malformed is one ValueError that names the file, key or tensor."""
    model_dir = Path(model_dir)
    config, _ = load_config(model_dir, dtype)
    files = safetensors_files(model_dir)

    # Build on the "meta" device: shapes only, no memory, no slow random init.
    # The real tensors are then swapped in straight from the checkpoint.
    with torch.device("meta"):
        model = CausalLM(config)
    expected = model.state_dict()  # name -> meta tensor with the shape the config implies
    device = torch.device(device)
    with ExitStack() as stack:
        # safe_open maps the files lazily; a tensor is only read when asked for.
        file_of = open_all(files, device, stack)
        tied = bool(getattr(config, "tie_word_embeddings", False)) and _tie_stored_matrices(file_of, model_dir, dtype)
        params = [name for name in expected if not (tied and name == "lm_head.weight")]
        _check_tensor_names(params, file_of, tied, model_dir)

        def read(name: str) -> torch.Tensor:
            handle, path = file_of[name]
            return read_tensor(handle, name, path).to(dtype)

        state: dict[str, torch.Tensor] = {}
        for name in params:
            parts = [read(p) for p in _checkpoint_names(name)]
            state[name] = _fuse(name, parts, expected[name].shape, model_dir)
    if tied:  # the output projection reuses the input embedding matrix
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight  # one shared Parameter, not two
    model.to(device)  # moves the rotary buffer; weights are already there
    model.eval().requires_grad_(False)
    return model, config


# Checkpoint tensors that are derived, not learned: some exporters store them, we recompute them.
_DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)


def _tie_stored_matrices(file_of: dict, model_dir: Path, dtype: torch.dtype) -> bool:
    """With tie_word_embeddings, whether to tie. As in transformers, a checkpoint that stores an
    lm_head.weight different from the embedding is not tied: the stored head is used, with a
    warning (tying would silently answer with another model's tokens)."""
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    if head not in file_of or embed not in file_of:
        return True  # a missing embedding is reported by _check_tensor_names
    stored = [read_tensor(handle, name, path).to(dtype) for name, (handle, path) in
              ((embed, file_of[embed]), (head, file_of[head]))]
    if stored[0].shape == stored[1].shape and torch.equal(*stored):
        return True
    warnings.warn(f"{str(model_dir)!r}: config.json says tie_word_embeddings, but the checkpoint stores an "
                  f"lm_head.weight that differs from model.embed_tokens.weight; it is used, not tied (as transformers "
                  f"does). Set tie_word_embeddings to false to silence this warning.", UserWarning, stacklevel=3)
    return False


def _check_tensor_names(params: list[str], file_of: dict, tied: bool, model_dir: Path) -> None:
    """Every tensor the model needs is present, and every tensor present is used: a stray one
    means the config describes a different model than the weights (e.g. q/k norms left out)."""
    needed = {part for name in params for part in _checkpoint_names(name)}
    missing = sorted(needed - file_of.keys())
    ignorable = {"lm_head.weight"} if tied else set()  # tied: some checkpoints still store the copy
    unused = sorted(n for n in file_of.keys() - needed - ignorable if not n.endswith(_DERIVED_SUFFIXES))
    if missing:
        more = f" (and {len(missing) - 1} more: {missing[1:8]})" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint in {str(model_dir)!r} is missing weight {missing[0]!r}{more}")
    if unused:
        raise ValueError(f"checkpoint in {str(model_dir)!r} has {len(unused)} tensor(s) this model does not use "
                         f"(does config.json describe these weights?): {unused[:8]}")


def _fuse(name: str, parts: list[torch.Tensor], shape: torch.Size, model_dir: Path) -> torch.Tensor:
    """One parameter from its checkpoint part(s), with the shape the config implies."""
    shapes = [tuple(p.shape) for p in parts]
    if not all(len(s) == len(shape) and s[1:] == tuple(shape[1:]) for s in shapes) or \
            sum(s[0] for s in shapes) != shape[0]:
        raise ValueError(f"checkpoint in {str(model_dir)!r}: {'+'.join(_checkpoint_names(name))} has shape(s) "
                         f"{shapes}, the config implies {tuple(shape)} for {name}")
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _checkpoint_names(param_name: str) -> list[str]:
    """Checkpoint tensor names that make up one of our parameters (several for fused ones)."""
    for fused, parts in FUSED_WEIGHTS.items():
        if f".{fused}." in param_name:
            return [param_name.replace(fused, part) for part in parts]
    return [param_name]
