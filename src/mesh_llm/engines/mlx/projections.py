"""Projections that read the same input, computed as one product: q, k and v in attention, gate and
up in the MLP; and q and k given their rotary embedding in one call.

On a GPU, MLX's one-stream decode is bound by the host. A kernel costs 6-13 µs to hand over, a
biased cuBLASLt product more, and a llama or qwen2 layer runs 17 kernels a token. Computing q, k and
v as one product (one ``Linear`` over the concatenated weights, then split into views) and gate and
up as another leaves 14.

On the H200 (2026-12-03), Qwen2.5-0.5B shape, one stream, alternated in one run:
- kernels a token: 412 → 340; their GPU time 1.91 → 1.49 ms;
- a step: 5.09 → 3.31 ms and 4.18 → 3.11 ms (197 → 302 and 239 → 321 tok/s);
- logits bit for bit the same in float16.
With one rotary embedding for q and k together (llama, qwen2: no per-head norm between): 316 kernels
a token (7B shape: 564 → 368; H200, 2026-12-04).

The weights are concatenated once at load, before they are read, and the separate ones dropped, so
memory does not grow. The engine does it on a GPU only: a CPU's step is bound by arithmetic, and
there the fused product rounds differently (float32 logits within 3.5e-6 of their size, measured on
the embedded SmolLM2), so the CPU keeps its results as they were. Only mlx-lm's own llama, qwen2
and qwen3 ``Attention`` and ``MLP`` are re-stated here (``_MODULES``), with float weights or
quantized ones of one kind (each output row is quantized on its own, so they stack the same way);
every other layer is left as it is.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx import nn
from mlx_lm.models.activations import swiglu

# mlx-lm model modules whose Attention and MLP __call__ are re-stated below (mistral models load
# through llama's module; qwen3's attention adds a norm of each head's q and k)
_MODULES = frozenset({"llama", "qwen2", "qwen3"})
_fused_classes: dict[type, type] = {}


def fuse_projections(model: nn.Module) -> int:
    """Fuse the projections of every layer that takes it; returns how many layers did."""
    name = type(model).__module__
    module = sys.modules.get(name)
    if module is None or name.rsplit(".", 1)[-1] not in _MODULES:
        return 0
    fused = 0
    for layer in getattr(getattr(model, "model", None), "layers", ()):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if (type(attn) is not getattr(module, "Attention", None)
                or type(mlp) is not getattr(module, "MLP", None)):
            continue
        parts = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
        if not all(all(type(p) is nn.Linear for p in group) or _same_quantization(group)
                   for group in (parts[:3], parts[3:])):
            continue
        attn.qkv_proj, attn.head_size = _concatenated(parts[:3]), attn.q_proj.weight.shape[0] // attn.n_heads
        mlp.gate_up_proj = _concatenated(parts[3:])
        del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
        attn.__class__ = _fused_class(type(attn), {"__call__": _attention, "_module": module})
        mlp.__class__ = _fused_class(type(mlp), {"__call__": _mlp})
        fused += 1
    return fused


def _same_quantization(parts: list) -> bool:
    """Quantized layers that concatenate into one: each output row is quantized on its own, so rows
    of the same bits, group size and mode stack as the float weights do."""
    first = parts[0]
    return all(type(p) is nn.QuantizedLinear and (p.bits, p.group_size, p.mode) == (first.bits, first.group_size,
               first.mode) and (p.get("biases") is None) == (first.get("biases") is None)
               and ("bias" in p) == ("bias" in first) for p in parts)


def _concatenated(parts: list[nn.Linear | nn.QuantizedLinear]) -> nn.Linear | nn.QuantizedLinear:
    first = parts[0]
    if type(first) is nn.Linear:
        out = nn.Linear(1, 1, bias="bias" in first)
    else:  # built empty: its constructor would quantize a random weight of the whole size
        out = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
        nn.Module.__init__(out)
        out.group_size, out.bits, out.mode = first.group_size, first.bits, first.mode
        out.scales = mx.concatenate([p.scales for p in parts])
        out.biases = None if first.get("biases") is None else mx.concatenate([p.biases for p in parts])
    out.weight = mx.concatenate([p.weight for p in parts])
    if "bias" in first:
        out.bias = mx.concatenate([p.bias for p in parts])
    if type(first) is not nn.Linear:
        out.freeze()
    return out


def _fused_class(base: type, members: dict) -> type:
    if base not in _fused_classes:
        _fused_classes[base] = type("Fused" + base.__name__, (base,), members)
    return _fused_classes[base]


def _attention(self, x: mx.array, mask=None, cache=None) -> mx.array:
    """mlx-lm's llama, qwen2 and qwen3 attention, with q, k and v taken from one product, and q and
    k given their rotary embedding in one call where no per-head norm (qwen3's) comes between."""
    batch, length, _ = x.shape
    heads = self.qkv_proj(x).reshape(batch, length, -1, self.head_size)  # q, k and v heads in a row
    offset = cache.offset if cache is not None else 0
    n, kv = self.n_heads, self.n_heads + self.n_kv_heads
    if "q_norm" in self:  # qwen3
        queries = self.rope(self.q_norm(heads[:, :, :n]).transpose(0, 2, 1, 3), offset=offset)
        keys = self.rope(self.k_norm(heads[:, :, n:kv]).transpose(0, 2, 1, 3), offset=offset)
    else:
        qk = self.rope(heads[:, :, :kv].transpose(0, 2, 1, 3), offset=offset)
        queries, keys = qk[:, :n], qk[:, n:]
    values = heads[:, :, kv:].transpose(0, 2, 1, 3)
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    # the module's own function, looked up now: mlx_attention may have routed it
    out = self._module.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale,
                                                    mask=mask)
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


def _mlp(self, x: mx.array) -> mx.array:
    gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
    return self.down_proj(swiglu(gate, up))
