"""Hugging Face transformers on the node's active kernels: ``apply_kernels(model)`` patches a model in place.

Llama family (``config.model_type == "llama"``). Per decoder layer, on the module instances (the classes and
other models in the process are untouched):

* ``rmsnorm``: the post-attention residual add and RMSNorm become one ``kernelctl.add_rmsnorm`` call
  (``y, h = add_rmsnorm(attn_out, residual, weight)``; the MLP's residual is ``h``). The input norm and the
  final norm have no add before them and stay transformers' RMSNorm.
* ``mlp``: ``silu(gate_proj(x)) * up_proj(x)`` becomes ``kernelctl.swiglu`` between the projections.
* ``rope``: the attention forward applies ``kernelctl.rope`` to q and k in the projections' (tokens, heads,
  head_dim) layout, before the transpose, with cos/sin cut to their first half (Llama's rotary tables repeat
  it); the KV cache and the attention interface then see what transformers' code would give them.
* ``attention``: the model's attention implementation becomes ``"kernelctl"``, registered in transformers'
  ``AttentionInterface`` (masks as for SDPA): causal self-attention without a cache prefix (q_len == kv_len,
  no padding mask) in fp16/bf16 with head_dim 64/128 runs ``kernelctl.flash_attn`` (GQA in the kernel: k and v
  keep their kv heads); a decode step (one query token over the KV cache with transformers' bool mask, as its
  static cache gives it) runs ``kernelctl.decode_attn`` (GQA in the kernel); everything else runs transformers'
  SDPA path.

A call outside an op's domain (dtype, sizes, eps, activation) runs transformers' own code for that call; each
reason is logged once (logger ``kernelpack.integrations.transformers``) and counted in :data:`FALLBACKS`.
The ops dispatch to the node's active version (``kernelpack.torch_ops``); ``generate`` is wrapped so that a
version switch drops the model's compiled call (``torch.compile`` / CUDA graphs) before the next request.
"""

from __future__ import annotations

import inspect
import logging
import types
import weakref
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from kernelpack import torch_ops
from kernelpack.kernels import add_rmsnorm as _add_rmsnorm_mod
from kernelpack.kernels import decode_attn as _decode_mod
from kernelpack.kernels import flash_attn as _flash_mod
from kernelpack.kernels import rope as _rope_mod
from kernelpack.kernels import swiglu as _swiglu_mod

log = logging.getLogger("kernelpack.integrations.transformers")

ATTN_IMPL = "kernelctl"
KINDS = ("rmsnorm", "mlp", "rope", "attention")
SUPPORTED_MODEL_TYPES = ("llama",)
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

TokenWindow = tuple[int, int | None]  # (fewest, most) tokens per call that run the kernel; None: no ceiling
KIND_OPS = {"rmsnorm": "add_rmsnorm", "mlp": "swiglu", "rope": "rope", "attention": "flash_attn"}

FALLBACKS: Counter[tuple[str, str]] = Counter()  # (kind, reason) -> calls that ran transformers' code
_logged: set[tuple[str, str]] = set()


class UnsupportedModelError(ValueError):
    """``apply_kernels`` was given a model whose family it does not patch."""


def _fallback(kind: str, reason: str) -> None:
    if torch.compiler.is_compiling():  # decided at trace time; counted on eager calls only
        return
    FALLBACKS[(kind, reason)] += 1
    if (kind, reason) not in _logged:
        _logged.add((kind, reason))
        log.warning("kernelctl %s: running transformers' code: %s", kind, reason)


def _policy_reason(module: nn.Module, kind: str, tokens: int, op: str | None = None) -> str | None:
    """Why a call of ``tokens`` tokens runs transformers' code by policy: outside the window ``apply_kernels``
    was given for ``kind``, or else outside the windows where the serving bundle says its kernel (``op``,
    default the kind's) wins on this arch (its manifest's ``wins`` table; none shipped for the arch: the kernel
    runs)."""
    op = op or KIND_OPS[kind]
    window = module.__dict__.get("_kernelctl_policy", {}).get(kind)
    if window is None:
        if torch_ops.kernel_wins(op, tokens):
            return None
        return f"policy: the serving bundle measured {op} slower than the baseline at this call's size"
    lo, hi = window
    if tokens < lo or (hi is not None and tokens > hi):
        return f"policy: calls outside [{lo}, {hi if hi is not None else 'inf'}] tokens run transformers' code"
    return None


def _dtype_reason(op_domain: Any, dtype: torch.dtype) -> str | None:
    name = _DTYPE_NAMES.get(dtype)
    return None if name in op_domain.dtypes else f"dtype {dtype} not in the kernel's {op_domain.dtypes}"


# ---------------------------------------------------------------------------------------------- add + RMSNorm
def _rmsnorm_reason(x: torch.Tensor, norm: nn.Module) -> str | None:
    eps = getattr(norm, "variance_epsilon", None)
    if eps is None or not _add_rmsnorm_mod.DOMAIN.params["eps"].contains(eps):
        return f"RMSNorm eps {eps} outside the kernel's domain"
    if norm.weight.dtype != x.dtype:
        return f"RMSNorm weight dtype {norm.weight.dtype} differs from the activations' {x.dtype}"
    hidden = x.shape[-1]
    if not _add_rmsnorm_mod.DOMAIN.dims["hidden"].contains(hidden):
        return f"hidden size {hidden} outside the kernel's domain"
    return _dtype_reason(_add_rmsnorm_mod.DOMAIN, x.dtype)


def _rmsnorm_call_reason(layer: nn.Module, x: torch.Tensor) -> str | None:
    return _rmsnorm_reason(x, layer.post_attention_layernorm) or _policy_reason(layer, "rmsnorm", x.numel() // x.shape[-1])


def _add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, norm: nn.Module,
                 layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) through the fused op, or transformers' code outside its domain."""
    why = _call_reason("rmsnorm", layer, x)
    if why is not None:
        _fallback("rmsnorm", why)
        h = residual + x
        return norm(h), h
    shape = x.shape
    y, h = torch.ops.kernelctl.add_rmsnorm(x.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1]), norm.weight,
                                           float(norm.variance_epsilon))
    return y.view(shape), h.view(shape)


def _cache_kwarg(ml: types.ModuleType) -> str:
    """The name transformers' Llama layers give the KV cache argument: ``cache`` since 5.24, before that
    ``past_key_values`` (5.24 still accepts the old name, with a deprecation warning)."""
    return "cache" if "cache" in inspect.signature(ml.LlamaAttention.forward).parameters else "past_key_values"


def _decoder_layer_forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: Any = None,
                           position_ids: Any = None, use_cache: bool | None = False,
                           position_embeddings: Any = None, **kwargs: Any) -> torch.Tensor:
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    attn_out, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                 position_ids=position_ids, use_cache=use_cache,
                                 position_embeddings=position_embeddings, **kwargs)  # the cache among kwargs
    normed, hidden_states = _add_rmsnorm(attn_out, residual, self.post_attention_layernorm, self)
    return hidden_states + self.mlp(normed)


# ---------------------------------------------------------------------------------------------------- SwiGLU
def _mlp_call_reason(mlp: nn.Module, gate: torch.Tensor) -> str | None:
    inter = gate.shape[-1]
    why = _dtype_reason(_swiglu_mod.DOMAIN, gate.dtype)
    if why is None and not _swiglu_mod.DOMAIN.dims["hidden"].contains(inter):
        why = f"intermediate size {inter} outside the kernel's domain"
    return why or _policy_reason(mlp, "mlp", gate.numel() // inter)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    inter = gate.shape[-1]
    why = _call_reason("mlp", self, gate)
    if why is not None:
        _fallback("mlp", why)
        return self.down_proj(self.act_fn(gate) * up)
    y = torch.ops.kernelctl.swiglu(gate.reshape(-1, inter), up.reshape(-1, inter))
    return self.down_proj(y.view(gate.shape))


# ----------------------------------------------------------------------------------------- rope + attention
def _rope_reason(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, head_dim: int) -> str | None:
    if cos.shape[-1] != head_dim:
        return f"rotary table width {cos.shape[-1]} != head_dim {head_dim} (partial rotary)"
    if cos.dtype != q.dtype:
        return f"rotary table dtype {cos.dtype} differs from q's {q.dtype}"
    dims = _rope_mod.DOMAIN.dims
    if not (dims["head_dim"].contains(head_dim) and dims["q_heads"].contains(q.shape[-2])
            and dims["kv_heads"].contains(k.shape[-2])):
        return f"heads {q.shape[-2]}/{k.shape[-2]} x head_dim {head_dim} outside the kernel's domain"
    return _dtype_reason(_rope_mod.DOMAIN, q.dtype)


def _rope_call_reason(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> str | None:
    return _rope_reason(q, k, cos, attn.head_dim) or _policy_reason(attn, "rope", q.shape[0] * q.shape[1])


def _half_table(t: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    half = t.shape[-1] // 2
    return t[..., :half].expand(batch, seq, half).reshape(batch * seq, half).contiguous()


def _make_attention_forward(ml: types.ModuleType):
    """The Llama attention forward of transformers' modeling module ``ml`` with rope on kernelctl.rope."""

    cache_kw = _cache_kwarg(ml)

    def forward(self: nn.Module, hidden_states: torch.Tensor, position_embeddings: Any = None,
                attention_mask: Any = None, **kwargs: Any) -> tuple[Any, Any]:
        cache = kwargs.pop(cache_kw, None)
        if cache is None and cache_kw == "cache":  # a caller still using the old name
            cache = kwargs.pop("past_key_values", None)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape)  # (batch, seq, heads, head_dim): the op's layout
        k = self.k_proj(hidden_states).view(hidden_shape)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        why = _call_reason("rope", self, q, k, cos)
        if why is None:
            b, s = input_shape
            hd = q.shape[-1]
            qo, ko = torch.ops.kernelctl.rope(q.reshape(b * s, q.shape[-2], hd), k.reshape(b * s, k.shape[-2], hd),
                                              _half_table(cos, b, s), _half_table(sin, b, s))
            q = qo.view(b, s, -1, hd).transpose(1, 2)
            k = ko.view(b, s, -1, hd).transpose(1, 2)
        else:
            _fallback("rope", why)
            q, k = ml.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        if cache is not None:
            k, v = (cache.update(k, v, self.layer_idx, kwargs=kwargs) if cache_kw == "cache"
                    else cache.update(k, v, self.layer_idx))
        attention_interface = ml.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, ml.eager_attention_forward)
        attn_output, attn_weights = attention_interface(
            self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    return forward


def _flash_reason(module: nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: Any,
                  dropout: float, scaling: float | None) -> str | None:
    if query.shape[2] != key.shape[2]:
        return "q_len != kv_len (decode or a cached prefix): the kernel is causal self-attention only"
    if attention_mask is not None:
        return "an explicit attention mask (padding or a static cache): the kernel masks causally only"
    if not getattr(module, "is_causal", True):
        return "non-causal attention"
    if dropout:
        return "attention dropout"
    if query.shape[1] % key.shape[1]:
        return f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} kv heads"
    d = query.shape[-1]
    if d not in _flash_mod.HEAD_DIMS:
        return f"head_dim {d} not in the kernel's {_flash_mod.HEAD_DIMS}"
    if scaling is not None and abs(scaling - d**-0.5) > 1e-9:
        return f"softmax scale {scaling} != 1/sqrt(head_dim)"
    return _dtype_reason(_flash_mod.DOMAIN, query.dtype)


def _decode_reason(query: torch.Tensor, key: torch.Tensor, attention_mask: Any, dropout: float,
                   scaling: float | None) -> str | None:
    """Why a decode step (one query token over the KV cache) runs SDPA instead of ``kernelctl.decode_attn``."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
        return "decode without a bool attention mask"
    b, hq, _, d = query.shape
    if not _decode_mod.DOMAIN.dims["batch"].contains(b):
        return f"decode batch {b} outside the decode kernel's domain"
    if attention_mask.dim() != 4 or attention_mask.shape[1:3] != (1, 1) or attention_mask.shape[0] not in (1, b):
        return f"decode mask of shape {tuple(attention_mask.shape)}"
    if dropout:
        return "attention dropout"
    if d not in _decode_mod.HEAD_DIMS:
        return f"head_dim {d} not in the decode kernel's {_decode_mod.HEAD_DIMS}"
    if hq % key.shape[1] or hq // key.shape[1] > _decode_mod.MAX_GROUP:
        return f"{hq} query heads over {key.shape[1]} kv heads"
    if scaling is not None and abs(scaling - d**-0.5) > 1e-9:
        return f"softmax scale {scaling} != 1/sqrt(head_dim)"
    return _dtype_reason(_decode_mod.DOMAIN, query.dtype)


def _attention_call_reason(module: nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: Any,
                           dropout: float, scaling: float | None) -> str | None:
    return _flash_reason(module, query, key, attention_mask, dropout, scaling) or _policy_reason(
        module, "attention", query.shape[0] * query.shape[2])


def kernelctl_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface: ``kernelctl.flash_attn`` where it applies, else SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] == 1 and key.shape[2] > 1:  # a decode step over the KV cache
        why = _call_reason("decode", module, query, key, attention_mask, dropout, scaling)
        if why is None:
            b, hq, _, d = query.shape
            mask = attention_mask[:, 0, 0, :].expand(b, -1).contiguous()
            o = torch.ops.kernelctl.decode_attn(query.reshape(b, hq, d), key.contiguous(), value.contiguous(), mask)
            return o.view(b, 1, hq, d), None
        _fallback("attention", why)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    why = _call_reason("attention", module, query, key, attention_mask, dropout, scaling)
    if why is not None:
        _fallback("attention", why)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    o = torch.ops.kernelctl.flash_attn(query.contiguous(), key.contiguous(), value.contiguous())  # GQA in-kernel
    return o.transpose(1, 2).contiguous(), None


# ------------------------------------------------------------------------------- decisions under torch.compile
def _decode_call_reason(module: nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: Any,
                        dropout: float, scaling: float | None) -> str | None:
    return _decode_reason(query, key, attention_mask, dropout, scaling) or _policy_reason(
        module, "attention", query.shape[0], op="decode_attn")


_CALL_REASONS = {"rmsnorm": _rmsnorm_call_reason, "mlp": _mlp_call_reason, "rope": _rope_call_reason,
                 "attention": _attention_call_reason, "decode": _decode_call_reason}
_TENSOR, _MODULE = "__kernelctl_tensor__", "__kernelctl_module__"  # tensors and modules as constants
_MODULES: list[weakref.ref[nn.Module]] = []  # patched modules by their _kernelctl_key


def _register(module: nn.Module) -> None:
    key = module.__dict__.get("_kernelctl_key")
    if key is None or _MODULES[key]() is not module:  # new, or a deep copy carrying its original's key
        module.__dict__["_kernelctl_key"] = len(_MODULES)
        _MODULES.append(weakref.ref(module))


def _as_constant(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (_TENSOR, tuple(a.shape), a.dtype)
    if isinstance(a, nn.Module):
        return (_MODULE, a._kernelctl_key)
    return a


def _from_constant(a: Any) -> Any:
    if isinstance(a, tuple) and a[:1] == (_TENSOR,):
        return torch.empty(a[1], dtype=a[2], device="meta")
    if isinstance(a, tuple) and a[:1] == (_MODULE,):
        module = _MODULES[a[1]]()
        if module is None:
            raise RuntimeError("a patched module was garbage-collected while a copy of it is compiled: call "
                               "apply_kernels on the copied model before compiling it")
        return module
    return a


@torch._dynamo.assume_constant_result
def _traced_reason(kind: str, *args: Any) -> str | None:
    """The decision of one call site, made once per traced shape: dynamo runs this at trace time and installs
    no guards on what it reads (modules' eps and policy, the kernels' domains); its arguments are constants
    (tensors as shape and dtype, modules as their registration key). Those are fixed once ``apply_kernels``
    has run; a version switch drops the compiled call (see ``_follow_switches_in_generate``)."""
    return _CALL_REASONS[kind](*(_from_constant(a) for a in args))


def _call_reason(kind: str, *args: Any) -> str | None:
    """Why this call runs transformers' code (None: the kernel). Eagerly, per call. Under ``torch.compile``
    through :func:`_traced_reason`, so the compiled model checks no more per step than transformers' own:
    ``generate`` at batch 1 is bound by the host (dynamo's guards and the CUDA graph launch), and the
    per-call-site reads of module attributes and domain tables cost ~60 us of guards per token in a
    4-layer model (profiled on an H100, docs/gpu.md "generate")."""
    if not torch.compiler.is_compiling():
        return _CALL_REASONS[kind](*args)
    return _traced_reason(kind, *(_as_constant(a) for a in args))


def register_attention() -> None:
    """Register ``"kernelctl"`` in transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPL, kernelctl_attention)
    AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)


# ------------------------------------------------------------------------------------------------ switches
def _follow_switches_in_generate(model: nn.Module) -> None:
    """Drop the model's compiled call (and dynamo's graphs) before a ``generate`` under new served kernels."""
    if getattr(model, "_kernelctl_generate", None) is not None or not hasattr(model, "generate"):
        return
    original = model.generate
    state: dict[str, Any] = {"key": None}

    def generate(*args: Any, **kwargs: Any) -> Any:
        rt = torch_ops.runtime()
        rt.poll()
        key = rt.served_key(torch_ops.bundle())
        if state["key"] is not None and key != state["key"]:
            log.info("served kernels changed: dropping %s's compiled call before this request",
                     type(model).__name__)
            if hasattr(model, "_compiled_call"):
                del model._compiled_call
            torch._dynamo.reset()
        state["key"] = key
        return original(*args, **kwargs)

    model._kernelctl_generate = original  # type: ignore[assignment]
    model.generate = generate  # type: ignore[method-assign]


# ------------------------------------------------------------------------------------------------- entry
_PATCHED_CLASSES: dict[tuple[type, Any], type] = {}


def _patch_forward(module: nn.Module, forward: Any) -> None:
    """Give this instance ``forward`` through a subclass of its class (one per class and forward, shared by the
    layers), not an instance attribute: a per-instance bound method costs dynamo guards on every call of the
    compiled model (the method's type, its function and closure, per module), the subclass none beyond the
    class check it makes anyway. Other instances of the class are untouched."""
    cls = type(module)
    key = (cls, forward)
    sub = _PATCHED_CLASSES.get(key)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                          "__qualname__": f"{cls.__qualname__}[kernelctl]"})
        _PATCHED_CLASSES[key] = sub
    module.__class__ = sub


def _decoder_layers(model: nn.Module) -> Iterable[nn.Module]:
    for m in model.modules():
        if all(hasattr(m, a) for a in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")):
            yield m


def apply_kernels(model: nn.Module, kinds: Iterable[str] = KINDS,
                  policy: Mapping[str, TokenWindow] | None = None) -> dict[str, int]:
    """Patch ``model`` (a Llama-family transformers model) in place; returns the modules replaced per kind.

    ``kinds`` selects among ``rmsnorm``, ``mlp``, ``rope`` and ``attention`` (default: all). By default a call
    runs the kernel where the version serving the op says it wins on this arch (its manifest's ``wins`` table,
    per arch, measured against the baseline a serving team runs: docs/serving.md), and everywhere in the
    kernel's domain where the bundle ships no table for the arch. ``policy`` overrides that per kind with a
    window of tokens per call (batch x sequence) where the kernel runs. Under ``torch.compile`` the choice is
    made at trace time (static shapes), so it costs nothing per call.
    Applying twice replaces nothing new (the counts of the second call are 0)."""
    kinds = set(kinds)
    unknown = (kinds | set(policy or {})) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown kernel kind(s) {sorted(unknown)}; known: {', '.join(KINDS)}")
    for kind, (lo, hi) in (policy or {}).items():
        if lo < 0 or (hi is not None and hi < lo):
            raise ValueError(f"policy for {kind}: token window [{lo}, {hi}] is empty or negative")
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"apply_kernels supports model_type {', '.join(SUPPORTED_MODEL_TYPES)}; got {model_type!r}")
    import importlib

    ml = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    counts = dict.fromkeys(KINDS, 0)
    attn_forward = _make_attention_forward(ml)
    for layer in _decoder_layers(model):
        for m in (layer, layer.mlp, layer.self_attn):
            m.__dict__["_kernelctl_policy"] = dict(policy or {})
            _register(m)
        patched: set[str] = layer.__dict__.setdefault("_kernelctl_kinds", set())
        if "rmsnorm" in kinds and "rmsnorm" not in patched:
            _patch_forward(layer, _decoder_layer_forward)
            patched.add("rmsnorm")
            counts["rmsnorm"] += 1
        mlp = layer.mlp
        if "mlp" in kinds and "mlp" not in patched:
            if getattr(config, "hidden_act", None) == "silu" and all(
                    hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj")):
                _patch_forward(mlp, _mlp_forward)
                patched.add("mlp")
                counts["mlp"] += 1
            else:
                _fallback("mlp", f"activation {getattr(config, 'hidden_act', None)!r} is not SiLU (SwiGLU)")
        if "rope" in kinds and "rope" not in patched:
            _patch_forward(layer.self_attn, attn_forward)
            patched.add("rope")
            counts["rope"] += 1
        if "attention" in kinds and "attention" not in patched:
            patched.add("attention")
            counts["attention"] += 1
    if counts["attention"]:
        register_attention()
        model.set_attn_implementation(ATTN_IMPL)
    _follow_switches_in_generate(model)
    log.info("kernelctl kernels applied to %s: %s", type(model).__name__, counts)
    return counts
