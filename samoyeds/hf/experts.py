"""A model's routed experts in the Samoyeds format: finding the experts modules, checking
their layout, packing them in place and running them.

:func:`patch_experts` packs the ``gate_up_proj``/``down_proj`` Parameters of one experts
module into the Samoyeds format and replaces them by the packed arrays (the dense tensors
are released); the module then runs :func:`experts_forward`, registered in transformers'
``ExpertsInterface`` as ``"samoyeds"``, which calls ``torch.ops.samoyeds.moe_forward`` (one
opaque node for ``torch.compile``, with a backward) on the module's arrays.

Arrays of a patched experts module (``E`` experts, hidden ``H``, expert width ``I``):

* ``samoyeds_gate_up_values`` (an ``nn.Parameter``), ``_meta``, ``_idx`` (buffers): the
  ``[E, 2I, H]`` gate_up weight packed with ``glu=True`` (gate rows, then up rows; ``_idx``
  is None for plain 2:4);
* ``samoyeds_down_values`` (Parameter), ``_meta``, ``_idx`` (buffers): the ``[E, H, I]`` down weight;
* ``samoyeds_gate_up_bias``: an ``[E, 2I]`` Parameter (gate, then up) for models with expert
  biases, else a None buffer; ``down_proj_bias`` stays the model's Parameter.

The values are Parameters so that ``model.parameters()``, optimizers, ``requires_grad_``,
PEFT's freezing and ``save_pretrained`` see them; they keep the ``requires_grad`` of the
dense weights they replace (trainable, as loaded).  The masks (meta, idx) never change: a
gradient step moves only the kept weights.

Layouts.  Most families store ``gate_up_proj [E, 2I, H]`` with the gate rows first.
GPT-OSS stores it transposed, ``[E, H, 2I]``, with gate and up columns interleaved (gate
0, up 0, gate 1, ...), and ``down_proj`` as ``[E, I, H]``: its weights and biases are
transposed and de-interleaved at pack time (:func:`to_pack`), and its clamped SwiGLU runs
with the module's ``alpha``/``limit``.  Llama 4 stores transposed weights without
interleaving (its block: llama4.py).
"""
from __future__ import annotations

import copyreg
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from .. import _config, torch_ops
from ..format import SparseFormat
from ..packed import PackedDims, PackedWeight, mask as magnitude_mask, pack, unpack

#: The name registered in transformers' ExpertsInterface.
IMPLEMENTATION = "samoyeds"

#: A mask function for :func:`samoyeds.patch_model`: ``(experts module name, "gate_up_proj"
#: or "down_proj", weight [E, R, C] in packing layout, format) -> bool mask [E, R, C]``.
MaskFn = Callable[[str, str, torch.Tensor, SparseFormat], torch.Tensor]

PROJS = ("gate_up", "down")
ARRAYS = ("values", "meta", "idx")
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The attribute names of a MoE block's shared-experts MLP.
SHARED_NAMES = ("shared_experts", "shared_expert")


class UnsupportedModelError(ValueError):
    """The model (or one of its experts modules) has a layout samoyeds cannot run."""


class PatchedModelError(RuntimeError):
    """An operation a samoyeds-patched model cannot do (another experts implementation); the
    message names :func:`samoyeds.unpatch_model`, which gives the model its dense (masked)
    experts back."""


@dataclass(frozen=True)
class ExpertsPatch:
    """What :func:`samoyeds.patch_model` did to one experts module (kept as ``module._samoyeds``).

    ``transposed``: the model stores ``[E, in, out]`` (``x @ W``) rather than
    ``[E, out, in]``; ``interleaved``: gate and up outputs alternate in gate_up.
    """

    fmt: SparseFormat
    num_experts: int
    hidden: int
    intermediate: int
    act: str
    alpha: float
    limit: float
    transposed: bool
    interleaved: bool
    bias: bool
    requires_grad: bool
    previous_implementation: Optional[str] = None

    def __setstate__(self, state: dict) -> None:
        # a patched module unpickled (or copied) runs "samoyeds", in a fresh process too
        register()
        self.__dict__.update(state)

    @property
    def act_id(self) -> int:
        return torch_ops.act_id(self.act)

    @property
    def n(self) -> int:
        return self.fmt.c_args()[0]

    @property
    def m(self) -> int:
        return self.fmt.c_args()[1]

    @property
    def v(self) -> int:
        return self.fmt.c_args()[2]


@dataclass
class Target:
    name: str                       # experts module name in model.named_modules()
    experts: nn.Module
    block: Optional[nn.Module]      # Llama4TextMoe owning the experts, else None
    layout: Optional[ExpertsPatch] = None


# --- registration and the forward -----------------------------------------------------------------

def register() -> None:
    """Registers ``"samoyeds"`` in ``transformers.integrations.moe.ExpertsInterface``.

    Call it before ``from_pretrained(..., experts_implementation="samoyeds")``
    (transformers validates the name when a model is built).  Idempotent;
    :func:`samoyeds.patch_model` calls it.
    """
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"samoyeds"`` experts implementation (transformers' ExpertsInterface contract).

    Args:
        self: a patched experts module.
        hidden_states: ``[T, H]`` (fp32/bf16/fp16 on the CPU; bf16/fp16 on CUDA).
        top_k_index: ``[T, K]`` int64 expert ids; ids ``>= E`` (expert-parallel
            placeholders) contribute nothing.
        top_k_weights: ``[T, K]`` routing weights (fp32 or the model's dtype).
    Returns:
        ``[T, H]`` in hidden_states' dtype.
    """
    if getattr(self, "_samoyeds", None) is None:
        raise RuntimeError(
            f"{type(self).__name__} runs experts_implementation={IMPLEMENTATION!r} but holds dense weights; "
            "call samoyeds.patch_model(model) to pack them first")
    return run_experts(self, hidden_states, top_k_index, top_k_weights)


def needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """True when autograd records a graph through ``tensors``: grad mode is on and one of
    them (None skipped) requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def moe_op(x: torch.Tensor, *tensors: Optional[torch.Tensor], training: bool = False) -> Callable[..., torch.Tensor]:
    """The MoE forward to call on ``x`` and the op's other tensors (routing weights, packed
    values, biases): eager inference skips the dispatcher (host time per call is what
    decode pays); compiled graphs go through the op.  With autograd (an input or a weight
    that requires grad, with grad mode on) the op's autograd formula runs: for a module in
    ``training`` mode through ``moe_forward_train``, which keeps the gate_up pre-activation
    for the backward (one matmul fewer there; in bf16/fp16 it rounds the pre-activation
    before the activation, docs/TRAINING.md), in eval mode through ``moe_forward``, whose
    output is the inference output bit for bit (the backward recomputes the pre-activation)."""
    if torch.compiler.is_compiling():
        return torch.ops.samoyeds.moe_forward
    if not needs_grad(x, *tensors):
        return torch_ops.moe_forward_eager
    return _train_forward if training else _eval_forward


def _train_forward(*args: Any) -> torch.Tensor:
    return torch_ops.moe_forward_autograd(*args, save_preact=_config.get().save_preact)


def _eval_forward(*args: Any) -> torch.Tensor:
    return torch_ops.moe_forward_autograd(*args, save_preact=False)


def run_experts(mod: nn.Module, x: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
    """A patched experts module on ``x [T, H]`` routed by ``top_k_index/_weights [T, K]``."""
    p = mod._samoyeds
    H, I = p.hidden, p.intermediate
    down_bias = mod.down_proj_bias if p.bias else None
    gu, dn, gu_bias = mod.samoyeds_gate_up_values, mod.samoyeds_down_values, mod.samoyeds_gate_up_bias
    return moe_op(x, top_k_weights, gu, dn, gu_bias, down_bias, training=mod.training)(
        x, top_k_index, top_k_weights,
        gu, mod.samoyeds_gate_up_meta, mod.samoyeds_gate_up_idx, 2 * I, H,
        dn, mod.samoyeds_down_meta, mod.samoyeds_down_idx, H, I,
        p.n, p.m, p.v, p.act_id, gu_bias, down_bias, p.alpha, p.limit)


# --- finding and checking experts modules ---------------------------------------------------------

def llama4_moe_class() -> Optional[type]:
    """transformers' ``Llama4TextMoe`` (its experts are not dispatched through
    ExpertsInterface), or None."""
    try:
        from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
    except ImportError:
        return None
    return Llama4TextMoe


def is_decorated(mod: nn.Module) -> bool:
    """True for an experts module built by transformers' @use_experts_implementation."""
    return (hasattr(type(mod).forward, "__wrapped__")
            and all(hasattr(mod, a) for a in ("has_gate", "has_bias", "is_transposed", "is_concatenated")))


def find_experts(model: nn.Module) -> List[Target]:
    """Every experts module of ``model`` samoyeds can patch, in module order; raises
    :class:`UnsupportedModelError` for a fused experts module it has no patch for."""
    llama4 = llama4_moe_class()
    targets: List[Target] = []
    claimed = set()
    for name, mod in model.named_modules():
        if llama4 is not None and isinstance(mod, llama4):
            targets.append(Target(f"{name}.experts" if name else "experts", mod.experts, mod))
            claimed.add(id(mod.experts))
        elif is_decorated(mod):
            targets.append(Target(name, mod, None))
            claimed.add(id(mod))
    for name, mod in model.named_modules():
        if id(mod) in claimed:
            continue
        w = mod._parameters.get("gate_up_proj")
        if w is not None and w.dim() == 3:
            raise UnsupportedModelError(
                f"{type(model).__name__}: experts module {name!r} ({type(mod).__name__}) is not supported: "
                "it is not dispatched through transformers' ExpertsInterface (@use_experts_implementation) "
                "and samoyeds has no patch for its MoE block")
    return targets


def blocks(model: nn.Module, targets: List[Target]) -> Iterable[Tuple[str, nn.Module]]:
    """(name, module) of each MoE block owning ``targets``' experts, once each."""
    seen = set()
    for t in targets:
        bname = t.name.rsplit(".", 1)[0] if "." in t.name else ""
        block = t.block if t.block is not None else (model.get_submodule(bname) if bname else model)
        if id(block) not in seen:
            seen.add(id(block))
            yield bname, block


def is_silu(fn: Any) -> bool:
    if isinstance(fn, nn.SiLU):
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:
        return False
    return isinstance(fn, SiLUActivation)


def experts_layout(t: Target, model: nn.Module, fmt: SparseFormat, allow_meta: bool = False) -> ExpertsPatch:
    """The layout of one experts module; ``allow_meta``: its weights may be on the meta
    device (a model built without storage, whose packed weights come from a file)."""
    mod = t.experts

    def fail(reason: str) -> None:
        raise UnsupportedModelError(f"{type(model).__name__}: experts module {t.name!r} ({type(mod).__name__}) "
                                    f"is not supported: {reason}")

    alpha, limit = 1.702, 7.0
    if t.block is not None:
        transposed, interleaved, bias, act = True, False, False, "swiglu"
        if not is_silu(getattr(mod, "act_fn", None)):
            fail(f"its activation {type(getattr(mod, 'act_fn', None)).__name__} is not SiLU; the fused gate is SwiGLU")
    else:
        if not mod.has_gate:
            fail("it has no gate (up_proj only); samoyeds fuses a gated activation (SwiGLU or GPT-OSS's) "
                 "into the gate_up matmul")
        if getattr(mod, "has_post_expert_norm", False):
            fail("it applies a norm after each expert (has_post_expert_norm), which samoyeds does not fuse")
        from transformers.integrations.moe import _default_apply_gate

        gate_fn = getattr(type(mod), "_apply_gate", None)
        if gate_fn is _default_apply_gate:
            act = "swiglu"
            if not is_silu(getattr(mod, "act_fn", None)):
                fail(f"its activation {type(getattr(mod, 'act_fn', None)).__name__} is not SiLU; samoyeds fuses "
                     "SwiGLU (silu(gate) * up)")
        elif getattr(gate_fn, "__qualname__", "") == "GptOssExperts._apply_gate":
            act, alpha, limit = "gptoss", float(mod.alpha), float(mod.limit)
        else:
            fail(f"its gate function {getattr(gate_fn, '__qualname__', gate_fn)!r} is neither SwiGLU nor "
                 "GPT-OSS's clamped SwiGLU")
        transposed, interleaved, bias = bool(mod.is_transposed), not mod.is_concatenated, bool(mod.has_bias)

    gu, dn = mod._parameters.get("gate_up_proj"), mod._parameters.get("down_proj")
    if gu is None or dn is None:
        fail("expected Parameters gate_up_proj and down_proj")
    if gu.dim() != 3 or dn.dim() != 3:
        fail(f"expected 3-d gate_up_proj and down_proj, got shapes {tuple(gu.shape)} and {tuple(dn.shape)}")
    for w in (gu, dn):
        if w.dtype not in SUPPORTED_DTYPES:
            fail(f"its expert weights are {w.dtype}; samoyeds packs float32, bfloat16 and float16")
        if w.device.type == "meta" and not allow_meta:
            fail("its expert weights are on the meta device (not loaded)")
    E = gu.shape[0]
    H, I2 = (gu.shape[1], gu.shape[2]) if transposed else (gu.shape[2], gu.shape[1])
    I = I2 // 2
    want_down = (E, I, H) if transposed else (E, H, I)
    if I2 % 2 or tuple(dn.shape) != want_down:
        fail(f"gate_up_proj {tuple(gu.shape)} and down_proj {tuple(dn.shape)} do not form a gated MLP "
             f"(expected down_proj {want_down})")
    try:
        PackedDims.of(fmt, E, 2 * I, H, True)
        PackedDims.of(fmt, E, H, I, False)
    except ValueError as e:
        fail(f"format {fmt.name} does not fit hidden size {H} and expert width {I}: {e}")
    if bias:
        gb, db = mod._parameters.get("gate_up_proj_bias"), mod._parameters.get("down_proj_bias")
        if gb is None or db is None or tuple(gb.shape) != (E, 2 * I) or tuple(db.shape) != (E, H):
            fail(f"expected biases gate_up_proj_bias [{E}, {2 * I}] and down_proj_bias [{E}, {H}]")
    previous = getattr(getattr(mod, "config", None), "_experts_implementation", None)
    return ExpertsPatch(fmt, E, H, I, act, alpha, limit, transposed, interleaved, bias,
                        bool(gu.requires_grad), None if previous == IMPLEMENTATION else previous)


# --- layout transforms between the model's Parameters and the packing layout --------------------

def split_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved (gate 0, up 0, gate 1, ...) along dim -> all gates, then all ups."""
    idx = torch.arange(t.shape[dim], device=t.device)
    return torch.cat([t.index_select(dim, idx[0::2]), t.index_select(dim, idx[1::2])], dim=dim)


def merge_gate_up(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of :func:`split_gate_up`."""
    half = t.shape[dim] // 2
    gate, up = t.narrow(dim, 0, half), t.narrow(dim, half, half)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def to_pack(w: torch.Tensor, p: ExpertsPatch, proj: str) -> torch.Tensor:
    """A model Parameter (or a mask shaped like it) -> ``[E, R, C]`` with R the output rows."""
    w = w.detach()
    if p.transposed:
        w = w.transpose(1, 2)
    if proj == "gate_up" and p.interleaved:
        w = split_gate_up(w, 1)
    return w.contiguous()


def from_pack(w: torch.Tensor, p: ExpertsPatch, proj: str) -> torch.Tensor:
    """Inverse of :func:`to_pack`."""
    if proj == "gate_up" and p.interleaved:
        w = merge_gate_up(w, 1)
    if p.transposed:
        w = w.transpose(1, 2)
    return w.contiguous()


# --- packing one experts module -------------------------------------------------------------------

def method_mask(name: str, proj: str, w: torch.Tensor, fmt: SparseFormat, method: Union[str, MaskFn]) -> torch.Tensor:
    """The mask of ``w`` (packing layout) by a mask function, or by magnitude."""
    if callable(method):
        key = f"{proj}_proj"
        m = method(name, key, w, fmt)
        if tuple(m.shape) != tuple(w.shape):
            raise ValueError(f"method({name!r}, {key!r}, ...): expected a mask of shape {tuple(w.shape)}, "
                             f"got {tuple(m.shape)}")
        return m.contiguous()
    return magnitude_mask(w, fmt)


def _mask_for(t: Target, p: ExpertsPatch, proj: str, w: torch.Tensor, method: Union[str, MaskFn],
              given: Optional[Mapping[str, torch.Tensor]]) -> torch.Tensor:
    key = f"{proj}_proj"
    if given is not None and key in given:
        return to_pack(given[key].to(device=w.device), p, proj)
    return method_mask(t.name, proj, w, p.fmt, method)


def _drop(mod: nn.Module, name: str) -> None:
    """Removes ``name`` from ``mod`` whether it is a Parameter, a buffer or neither."""
    mod._parameters.pop(name, None)
    mod._buffers.pop(name, None)
    mod._non_persistent_buffers_set.discard(name)


#: What a packed module keeps in its ``__dict__`` that is made again on use (hf/shared.py).
DERIVED_CACHES = frozenset({"_packed_cache", "_offsets_cache"})


class _Uint32:
    """A uint32 tensor in a pickle: torch pickles a uint32 tensor but cannot unpickle it (its
    untyped storage has no dtype), so it travels as an int32 view of the same bytes."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __reduce__(self) -> tuple:
        return (_as_uint32, (self.t.view(torch.int32),))


def _as_uint32(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint32)


def _reduce_module(mod: nn.Module) -> tuple:
    """pickle's (and deepcopy's) reduction of a module class holding packed arrays: the
    default one, with the uint32 buffers (the 2:4 metadata) as :class:`_Uint32` and
    samoyeds' derived caches (:data:`DERIVED_CACHES`, made again on use) left out."""
    state = {k: v for k, v in mod.__dict__.items() if k not in DERIVED_CACHES}
    bufs = state.get("_buffers")
    if bufs and any(v is not None and v.dtype == torch.uint32 for v in bufs.values()):
        state["_buffers"] = type(bufs)((k, _Uint32(v) if v is not None and v.dtype == torch.uint32 else v)
                                       for k, v in bufs.items())
    return (copyreg.__newobj__, (type(mod),), state, None, None)


def _picklable(cls: type) -> None:
    """Registers :func:`_reduce_module` for ``cls`` (once; not over another reduction)."""
    if cls not in copyreg.dispatch_table:
        copyreg.pickle(cls, _reduce_module)


def set_arrays(mod: nn.Module, proj: str, values: torch.Tensor, meta: torch.Tensor, idx: Optional[torch.Tensor],
               requires_grad: bool) -> None:
    """Gives ``mod`` the packed arrays of ``proj`` (``"gate_up"`` or ``"down"``): the values
    as the Parameter ``samoyeds_{proj}_values`` (``requires_grad`` as given; a Parameter
    passed in is kept as it is), the metadata and row indices as buffers (the mask: never
    trained).  patch_model, the transformers quantizer and samoyeds' checkpoint loader use it."""
    name = f"samoyeds_{proj}_values"
    _drop(mod, name)
    if not isinstance(values, nn.Parameter):
        values = nn.Parameter(values, requires_grad=requires_grad)
    mod.register_parameter(name, values)
    for a, t in (("meta", meta), ("idx", idx)):
        _drop(mod, f"samoyeds_{proj}_{a}")
        mod.register_buffer(f"samoyeds_{proj}_{a}", t)
    _picklable(type(mod))


def set_bias(mod: nn.Module, bias: Optional[torch.Tensor], requires_grad: bool) -> None:
    """``samoyeds_gate_up_bias``: a Parameter holding ``bias`` (gate, then up), or a None
    buffer for experts without biases."""
    _drop(mod, "samoyeds_gate_up_bias")
    if bias is None:
        mod.register_buffer("samoyeds_gate_up_bias", None)
    else:
        if not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias, requires_grad=requires_grad)
        mod.register_parameter("samoyeds_gate_up_bias", bias)


def packed_parameters(mod: nn.Module) -> List[nn.Parameter]:
    """The trainable tensors samoyeds gave a patched experts module (or a SamoyedsMLP): the
    packed values of both projections and the gate_up bias, where there is one."""
    names = [f"samoyeds_{proj}_values" for proj in PROJS] + ["samoyeds_gate_up_bias"]
    return [mod._parameters[n] for n in names if mod._parameters.get(n) is not None]


def patch_experts(t: Target, method: Union[str, MaskFn], given: Optional[Mapping[str, torch.Tensor]]) -> None:
    """Packs one experts module by ``t.layout``; it changes only once both weights are packed
    (Llama 4's block gets its class from the caller: llama4.py).  The packed values become
    Parameters with the ``requires_grad`` of the dense weights."""
    mod, p = t.experts, t.layout
    packed = {}
    for proj in PROJS:
        w = to_pack(mod._parameters[f"{proj}_proj"], p, proj)
        packed[proj] = pack(w, p.fmt, mask=_mask_for(t, p, proj, w, method, given), glu=proj == "gate_up")
        del w
    gate_up_bias, bias_grad = None, False
    if p.bias:
        b = mod._parameters["gate_up_proj_bias"]
        bias_grad = b.requires_grad
        b = b.detach()
        gate_up_bias = (split_gate_up(b, 1) if p.interleaved else b).contiguous()
        delattr(mod, "gate_up_proj_bias")
    for proj in PROJS:
        delattr(mod, f"{proj}_proj")
        pw = packed[proj]
        set_arrays(mod, proj, pw.values, pw.meta, pw.idx, p.requires_grad)
    set_bias(mod, gate_up_bias, bias_grad)
    mod._samoyeds = p


def unpatch_experts(mod: nn.Module) -> None:
    """Gives a patched experts module dense Parameters again (the masked weights), with the
    ``requires_grad`` its packed values have now."""
    p: ExpertsPatch = mod._samoyeds
    shapes = {"gate_up": (p.num_experts, 2 * p.intermediate, p.hidden),
              "down": (p.num_experts, p.hidden, p.intermediate)}
    for proj in PROJS:
        arrays = [getattr(mod, f"samoyeds_{proj}_{a}") for a in ARRAYS]
        rg = arrays[0].requires_grad
        dense = unpack(PackedWeight(arrays[0].detach(), *arrays[1:], p.fmt, shapes[proj], glu=proj == "gate_up"))
        for a in ARRAYS:
            _drop(mod, f"samoyeds_{proj}_{a}")
        setattr(mod, f"{proj}_proj", nn.Parameter(from_pack(dense, p, proj), requires_grad=rg))
    b = mod.samoyeds_gate_up_bias
    _drop(mod, "samoyeds_gate_up_bias")
    if p.bias:
        rg = b.requires_grad
        b = b.detach()
        b = merge_gate_up(b, 1) if p.interleaved else b
        mod.gate_up_proj_bias = nn.Parameter(b.contiguous(), requires_grad=rg)
    del mod._samoyeds


def progress(items: List[Any], enabled: bool, desc: str) -> Iterable[Any]:
    """``items`` under a tqdm bar when ``enabled`` and tqdm is installed."""
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="layer")


def set_implementation(model: nn.Module, modules: List[nn.Module], impl: Any,
                       fallback: Optional[List[Optional[str]]] = None) -> None:
    """Selects ``impl`` (a name, a per-subconfig dict, or None for transformers' default)
    through ``model.set_experts_implementation``, then makes sure every module of
    ``modules`` (decorated experts) reads ``"samoyeds"`` exactly when it is patched:
    a sub-model transformers does not recognise as switchable, or a bare module
    passed as ``model``, keeps its config otherwise.  ``fallback[i]`` is what an
    unpatched ``modules[i]`` gets then (None: ``"eager"``)."""
    if not modules:
        return
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
    for i, mod in enumerate(modules):
        cfg = getattr(mod, "config", None)
        if cfg is None:
            continue
        patched = getattr(mod, "_samoyeds", None) is not None
        now = cfg._experts_implementation
        if patched and now != IMPLEMENTATION:
            cfg._experts_implementation_internal = IMPLEMENTATION
        elif not patched and now == IMPLEMENTATION:
            cfg._experts_implementation_internal = (fallback[i] if fallback else None) or "eager"
