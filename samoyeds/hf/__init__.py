"""Hugging Face ``transformers`` integration: a model's MoE experts in the Samoyeds
format, patched in place.

``patch_model(model)`` packs the ``gate_up_proj``/``down_proj`` weights of every experts
module into the Samoyeds format (the dense tensors are released) and selects the
``"samoyeds"`` experts implementation, registered in transformers' ``ExpertsInterface``;
Llama 4's block, which does not dispatch through it, gets a patched class.  Around the
routed experts it gives the modules that samoyeds' kernels speed up a subclass of their own
class: unpruned shared experts (the dense decode path), routers (one fused op) and MoE
blocks (shared experts on a second stream).  :func:`unpatch_model` undoes all of it.

The package, one job per module (each imports only those listed before it):

* ``families.py``: small random models of every supported family (demo, tests);
* ``swap.py``: the one class-swap mechanism (a subclass per kind and base class);
* ``experts.py``: finding, checking, packing and running experts modules;
* ``streams.py``: a block's shared MLP on a second stream;
* ``shared.py``: shared experts, unpruned (``SamoyedsDense<...>``) or packed (:class:`SamoyedsMLP`);
* ``router.py``: routers run by :func:`samoyeds.router` (``SamoyedsRouter<...>``);
* ``llama4.py``: Llama 4's block (``SamoyedsLlama4<...>``);
* ``parallel.py``: a model transformers distributed (expert parallel): local experts only;
* this file: the public API and the class lookup for pickles.

A patched model trains: the packed values are Parameters (trainable unless frozen, e.g. by
:func:`freeze_experts`) and the op has a backward (docs/HF.md, "Training").
"""
from __future__ import annotations

import sys
from typing import Any, List, Mapping, Optional, Union

import torch
from torch import nn

from .._array import check_model
from ..format import SparseFormat
from . import llama4, swap
from . import parallel as _parallel
from . import router as _routers
from . import shared as _shared
from . import streams as _streams
from .experts import (ARRAYS, IMPLEMENTATION, PROJS, SHARED_NAMES, ExpertsPatch, MaskFn, PatchedModelError, Target,
                      UnsupportedModelError, experts_forward, experts_layout, find_experts, packed_parameters,
                      patch_experts, register, set_implementation, unpatch_experts)
from .experts import progress as _progress
from .router import RouterSpec
from .shared import (MLP_PROJS, SamoyedsMLP, SharedTarget, find_shared, packed_shared, patch_shared, shared_dims,
                     unpatch_shared)

__all__ = [
    "IMPLEMENTATION", "ExpertsPatch", "MaskFn", "PatchedModelError", "RouterSpec", "SamoyedsConfig", "SamoyedsMLP",
    "UnsupportedModelError",
    "experts_forward", "experts_parameters", "experts_weight_nbytes", "freeze_experts", "is_patched", "patch_model",
    "register", "to_dense", "unpatch_model",
]

_PREVIOUS_ATTR = "_samoyeds_previous_experts_implementation"

# The swapped classes by the prefix of their names (swap.py): a pickle of a patched model
# names its classes ``samoyeds.hf.<prefix>...>``, which __getattr__ makes again.
_FACTORIES = {
    _shared.DENSE_PREFIX: _shared.dense_class,
    _routers.ROUTER_PREFIX: _routers.router_class,
    _streams.BLOCK_PREFIX: _streams.block_class,
    llama4.LLAMA4_PREFIX: llama4.patched_class,
}


def __getattr__(name: str) -> Any:
    if name in ("SamoyedsConfig", "SamoyedsHfQuantizer"):
        from . import quantizer

        return getattr(quantizer, name)
    for prefix, make in _FACTORIES.items():
        base = swap.class_by_name(name, prefix)
        if base is not None:
            return make(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_options(router: Any, shared_stream: Any, shared_stream_min_rows: Any) -> None:
    """Checks patch_model's (and from_pretrained's) ``router``, ``shared_stream`` and
    ``shared_stream_min_rows`` before anything changes."""
    for name, value in (("router", router), ("shared_stream", shared_stream)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    if isinstance(shared_stream_min_rows, bool) or not isinstance(shared_stream_min_rows, int) \
            or shared_stream_min_rows < 0:
        raise ValueError(f"shared_stream_min_rows: expected an int >= 0, got {shared_stream_min_rows!r}")


class SwitchGuard:
    """Stands in for ``model._check_and_adjust_experts_implementation`` while the model is
    patched: ``model.set_experts_implementation(other)`` raises :class:`PatchedModelError`
    before anything changes (the packed experts run only as ``"samoyeds"``; transformers'
    implementations read dense Parameters that patching deleted).  Stateless, so a
    pickled or copied model keeps it."""

    def __call__(self, requested: Any) -> Any:
        if requested == IMPLEMENTATION:
            return requested
        raise PatchedModelError(
            f"set_experts_implementation({requested!r}): this model's experts are packed by samoyeds and run only "
            f"as {IMPLEMENTATION!r}; call samoyeds.unpatch_model(model) first (dense masked experts again, then any "
            "implementation works)")


_GUARD_ATTR = "_check_and_adjust_experts_implementation"


def select(model: nn.Module, targets: List[Target]) -> None:
    """Selects ``"samoyeds"`` for a model whose experts were just packed (patch_model and
    the quantizer's load), remembering the previous implementation for unpatch_model, and
    guards the choice (:class:`SwitchGuard`)."""
    previous = model.get_experts_implementation() if hasattr(model, "get_experts_implementation") else None
    if isinstance(previous, dict):
        previous = {k: (None if v == IMPLEMENTATION else v) for k, v in previous.items()}
    elif previous == IMPLEMENTATION:
        previous = None
    if not hasattr(model, _PREVIOUS_ATTR):
        setattr(model, _PREVIOUS_ATTR, previous)
    set_implementation(model, [t.experts for t in targets if t.block is None], IMPLEMENTATION)
    if hasattr(model, "set_experts_implementation"):
        model.__dict__[_GUARD_ATTR] = SwitchGuard()


def install(model: nn.Module, targets: List[Target], *, dense_shared: bool, router: bool, shared_stream: bool,
            shared_stream_min_rows: int) -> None:
    """Gives the modules around patched experts (``targets``) their samoyeds classes: the
    unpruned shared MLPs (``dense_shared``), the routers (``router``) and the blocks
    (``shared_stream``, with its row limit).  patch_model and from_pretrained call it."""
    if dense_shared:
        _shared.patch_dense_all(model, targets)
    if router:
        _routers.patch_all(model, targets)
    if shared_stream:
        _streams.enable(model, targets, shared_stream_min_rows)


def patch_model(model: nn.Module, fmt: Union[str, SparseFormat, tuple] = "samoyeds-1:2:128",
                method: Union[str, MaskFn] = "magnitude", progress: bool = True, *,
                masks: Optional[Mapping[str, Mapping[str, torch.Tensor]]] = None,
                shared_experts: bool = False, router: bool = True, shared_stream: bool = True,
                shared_stream_min_rows: int = 4096) -> nn.Module:
    """Packs every MoE experts module of a transformers model into ``fmt``, in place.

    Args:
        model: a transformers ``PreTrainedModel`` (Mixtral, Qwen2-MoE, Qwen3-MoE,
            OLMoE, DeepSeek-V2/V3, GPT-OSS, Phi-MoE, Granite-MoE, Llama 4, or any
            model whose experts use ``@use_experts_implementation`` with a SwiGLU
            or GPT-OSS gate).  Expert weights fp32/bf16/fp16, on the CPU or CUDA
            (packing runs where the weights are).
        fmt: the sparse format (preset name, ``"n:m:v"`` or a ``SparseFormat``).
        method: how to choose the kept weights: ``"magnitude"`` (largest ``|w|``),
            or a callable ``(module_name, "gate_up_proj" | "down_proj", w, fmt) ->
            bool mask`` where ``w`` is ``[E, R, C]`` in packing layout (output rows,
            gate rows before up rows).
        progress: show a tqdm bar over the MoE layers.
        masks: precomputed bool masks, ``{experts module name: {"gate_up_proj": m,
            "down_proj": m}}``, each shaped like the module's Parameter; they take
            precedence over ``method``.  With ``shared_experts``, also ``{shared MLP name:
            {"gate_proj": m, "up_proj": m, "down_proj": m}}`` shaped like its Linear weights.
        shared_experts: also pack each MoE block's shared experts (the always-on MLP of
            DeepSeek-V2/V3, Qwen2-MoE, Llama 4 blocks) into a :class:`SamoyedsMLP`; every
            token passes through them, so this changes the model more than the routed
            experts' packing does.  A ``method`` callable gets ``"gate_up_proj"`` (``[1, 2I,
            H]``, gate rows then up rows) and ``"down_proj"`` (``[1, H, I]``) for them.
            Without it, shared experts that are a gated SiLU MLP of bias-free ``nn.Linear``
            keep their dense weights and run :func:`samoyeds.dense_decode` at decode sizes
            on the GPU (their class becomes a ``SamoyedsDense<...>`` subclass; hf/shared.py).
        router: give every router whose rule samoyeds knows (and reproduces on a probe)
            its ``SamoyedsRouter<...>`` subclass: one :func:`samoyeds.router` call for
            inference on the GPU (hf/router.py).  False leaves the routers as they are.
        shared_stream: run each block's shared experts on a second CUDA stream beside its
            routed experts (``SamoyedsBlock<...>``, hf/streams.py) for inputs of at least
            ``shared_stream_min_rows`` token rows; below, and with False, one stream.
        shared_stream_min_rows: that row limit.
    Returns:
        ``model``, with ``gate_up_proj``/``down_proj`` (and GPT-OSS's
        ``gate_up_proj_bias``) replaced by the ``samoyeds_*`` arrays (values and bias:
        Parameters with the dense weights' ``requires_grad``; meta, idx: buffers) and the experts
        implementation set to ``"samoyeds"``; with ``shared_experts``, each shared MLP
        replaced by a :class:`SamoyedsMLP`.
    Raises:
        UnsupportedModelError: an experts module has a layout samoyeds cannot run
            (checked for every module before anything changes).
        NotImplementedError: ``method`` names another sparsifier (calibrated ones run
            through :func:`samoyeds.sparsify_model`).
        ValueError: a given or computed mask does not fit the format; the modules
            packed before the failing one get dense Parameters back (masked).
    """
    check_model(model)
    fmt = SparseFormat.parse(fmt)
    if isinstance(method, str):
        if method != "magnitude":
            raise NotImplementedError(
                f"method={method!r}: patch_model builds only 'magnitude' masks; the calibrated methods "
                "('activation', 'sparsegpt') run through samoyeds.sparsify_model(model, fmt, method, "
                "calibration=...), or pass a mask function (name, proj, w, fmt) -> mask or masks=...")
    elif not callable(method):
        raise TypeError(f"method: expected 'magnitude' or a callable, got {type(method).__name__}")
    check_options(router, shared_stream, shared_stream_min_rows)
    register()
    targets = find_experts(model)
    if not targets:
        raise UnsupportedModelError(f"{type(model).__name__}: no Mixture-of-Experts experts module found")
    done = [t.name for t in targets if getattr(t.experts, "_samoyeds", None) is not None]
    if done:
        raise ValueError(f"{type(model).__name__} is already patched ({done[0]!r}, ...); "
                         "call samoyeds.unpatch_model(model) first")
    shared = find_shared(model, targets) if shared_experts else []
    if shared_experts and not shared:
        raise UnsupportedModelError(f"{type(model).__name__}: shared_experts=True, but its MoE blocks have no "
                                    f"shared experts (a child named {' or '.join(SHARED_NAMES)})")
    masks = dict(masks or {})
    unknown = sorted(set(masks) - {t.name for t in targets} - {st.name for st in shared})
    if unknown:
        raise ValueError(f"masks: no experts module named {unknown}; expected names among "
                         f"{[t.name for t in targets] + [st.name for st in shared]}")
    dims = {st.name: shared_dims(st, model, fmt) for st in shared}
    for st in shared:
        given = masks.get(st.name, {})
        for key, m in given.items():
            lin = st.mlp._modules.get(key)
            if key not in MLP_PROJS or lin is None:
                raise ValueError(f"masks[{st.name!r}]: expected keys 'gate_proj', 'up_proj' and 'down_proj', got {key!r}")
            if tuple(m.shape) != tuple(lin.weight.shape):
                raise ValueError(f"masks[{st.name!r}][{key!r}]: expected shape {tuple(lin.weight.shape)} (the "
                                 f"Linear weight's), got {tuple(m.shape)}")
        if given and set(given) != set(MLP_PROJS):
            raise ValueError(f"masks[{st.name!r}]: expected all of 'gate_proj', 'up_proj' and 'down_proj', "
                             f"got {sorted(given)}")
    for t in targets:
        for key, m in masks.get(t.name, {}).items():
            param = t.experts._parameters.get(key)
            if key not in ("gate_up_proj", "down_proj") or param is None:
                raise ValueError(f"masks[{t.name!r}]: expected keys 'gate_up_proj' and 'down_proj', got {key!r}")
            if tuple(m.shape) != tuple(param.shape):
                raise ValueError(f"masks[{t.name!r}][{key!r}]: expected shape {tuple(param.shape)} (the "
                                 f"Parameter's), got {tuple(m.shape)}")
    # expert parallel (hf/parallel.py): each rank packs its own experts; masks cut to them
    localized = _parallel.localize(model, targets, masks, shared_experts)
    try:
        for t in targets:
            t.layout = experts_layout(t, model, fmt)
    except Exception:
        _parallel.restore(localized)
        raise

    done: List[Target] = []
    done_shared: List[SharedTarget] = []
    failing = ""  # the module being packed, for the note on failure
    with torch.no_grad():
        try:
            for t in _progress(targets, progress, f"samoyeds: packing experts ({fmt.name})"):
                failing = t.name
                patch_experts(t, method, masks.get(t.name))
                if t.block is not None:
                    t.block.__class__ = llama4.patched_class(type(t.block))
                done.append(t)
            for st in shared:
                failing = st.name
                patch_shared(st, fmt, dims[st.name], method, masks.get(st.name))
                done_shared.append(st)
        except Exception as e:
            for d in done:   # back to dense, so that the model stays runnable as before
                unpatch_experts(d.experts)
                if d.block is not None:
                    swap.unswap(d.block)
            for d in done_shared:
                unpatch_shared(d.parent, d.attr)
            _parallel.restore(localized)
            if (done or done_shared) and hasattr(e, "add_note"):
                e.add_note(f"samoyeds.patch_model failed at {failing!r}; the {len(done) + len(done_shared)} "
                           "module(s) packed before it were unpacked and now hold their masked dense weights")
            raise
    install(model, targets, dense_shared=not shared_experts, router=router, shared_stream=shared_stream,
            shared_stream_min_rows=shared_stream_min_rows)
    _parallel.keep_sharded(model, targets)
    select(model, targets)
    if hasattr(model, "save_pretrained") and hasattr(model, "config"):
        from . import quantizer

        # the method that chose the kept weights, as far as patch_model knows it ("custom":
        # a mask function or given masks, e.g. sparsify_model's)
        quantizer.attach(model, fmt, "custom" if masks or not isinstance(method, str) else method, router,
                         shared_stream, shared_stream_min_rows)
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undoes :func:`patch_model`: every patched experts module gets dense Parameters
    again, in the model's own layout, holding the masked weights (exactly
    ``w * mask``), and the previous experts implementation is restored; every
    :class:`SamoyedsMLP` gives way to the module it replaced, with dense ``nn.Linear``
    projections holding its masked weights, and unpruned shared experts get their own
    class back, as do routers and blocks.  Returns ``model``."""
    check_model(model)
    targets = [t for t in find_experts(model) if getattr(t.experts, "_samoyeds", None) is not None]
    shared = packed_shared(model)
    if not targets and not shared:
        raise ValueError(f"{type(model).__name__} has no experts module patched by samoyeds")
    decorated = [t.experts for t in targets if t.block is None]
    fallback = [m._samoyeds.previous_implementation for m in decorated]
    with torch.no_grad():
        for t in targets:
            unpatch_experts(t.experts)
        for _, parent, attr in shared:
            unpatch_shared(parent, attr)
        swap.unswap_all(model)
        _parallel.restore(_parallel.recorded(model))
    previous = getattr(model, _PREVIOUS_ATTR, None)
    if hasattr(model, _PREVIOUS_ATTR):
        delattr(model, _PREVIOUS_ATTR)
    model.__dict__.pop(_GUARD_ATTR, None)
    set_implementation(model, decorated, previous, fallback)
    if "transformers.quantizers.auto" in sys.modules:
        from . import quantizer

        quantizer.detach(model)
    return model


#: Alias of :func:`unpatch_model`: the model back with dense (masked) expert weights.
to_dense = unpatch_model


def is_patched(model: nn.Module) -> bool:
    """True when some experts module (or shared-experts MLP) of ``model`` holds samoyeds-packed weights."""
    check_model(model)
    return any(getattr(m, "_samoyeds", None) is not None or isinstance(m, SamoyedsMLP) for m in model.modules())


def experts_weight_nbytes(model: nn.Module, shared_experts: bool = False) -> int:
    """Bytes held by the expert weight matrices (gate_up and down; biases excluded):
    the dense Parameters, or the packed values, metadata and row indices.  With
    ``shared_experts``, the MoE blocks' shared-experts MLPs too (their dense ``nn.Linear``
    weights, or a :class:`SamoyedsMLP`'s packed arrays)."""
    packed_names = [f"samoyeds_{proj}_{a}" for proj in PROJS for a in ARRAYS]
    held = []
    targets = find_experts(model)
    for t in targets:
        mod = t.experts
        names = packed_names if getattr(mod, "_samoyeds", None) is not None else ["gate_up_proj", "down_proj"]
        held += [getattr(mod, n, None) for n in names]
    for st in find_shared(model, targets) if shared_experts else []:
        if isinstance(st.mlp, SamoyedsMLP):
            held += [getattr(st.mlp, n) for n in packed_names]
        else:
            held += [getattr(st.mlp._modules.get(k), "weight", None) for k in MLP_PROJS]
    return sum(x.numel() * x.element_size() for x in held if x is not None)


def experts_parameters(model: nn.Module) -> List[nn.Parameter]:
    """The Parameters samoyeds holds in ``model``: the packed values of every patched experts
    module and :class:`SamoyedsMLP` (``samoyeds_{gate_up,down}_values``) and GPT-OSS's packed
    ``samoyeds_gate_up_bias``, in module order.  Empty for a model that is not patched.  The
    model's own Parameters of the experts modules (GPT-OSS's ``down_proj_bias``) are not among
    them."""
    out: List[nn.Parameter] = []
    for mod in model.modules():
        if getattr(mod, "_samoyeds", None) is not None or isinstance(mod, SamoyedsMLP):
            out += packed_parameters(mod)
    return out


def freeze_experts(model: nn.Module, freeze: bool = True) -> nn.Module:
    """Freezes (``requires_grad=False``) the packed expert weights of a patched model, or
    unfreezes them with ``freeze=False``: the Parameters :func:`experts_parameters` lists, and
    the expert biases of models that have them (GPT-OSS's ``down_proj_bias``).  Everything else
    keeps its ``requires_grad`` (attention, routers, embeddings, shared experts left dense).
    Same as ``p.requires_grad_(not freeze)`` on each; a frozen expert costs no gradient memory
    and its backward computes only the gradient of its input.  Returns ``model``.

    Raises ValueError for a model samoyeds has not patched (nothing would change), TypeError
    for a ``freeze`` that is not a bool (``freeze="no"`` would freeze)."""
    check_model(model)
    if not isinstance(freeze, bool):
        raise TypeError(f"freeze: expected a bool, got {type(freeze).__name__}")
    params = experts_parameters(model)
    if not params:
        raise ValueError(f"{type(model).__name__} has no experts packed by samoyeds; call samoyeds.patch_model first")
    for mod in model.modules():
        if getattr(mod, "_samoyeds", None) is not None and mod._samoyeds.bias:
            params.append(mod.down_proj_bias)
    for p in params:
        p.requires_grad_(not freeze)
    return model
