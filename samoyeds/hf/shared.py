"""Shared experts: the always-on MLP that DeepSeek-V2/V3, Qwen2-MoE and Llama 4 blocks run
beside their routed experts (``shared_experts`` / ``shared_expert``:
``down_proj(silu(gate_proj(x)) * up_proj(x))`` with bias-free ``nn.Linear``).

Unpruned (the default).  The MLP keeps its dense weights, its parameters and its
state-dict names; its class becomes a subclass of its own (``SamoyedsDense<...>``) whose
forward, for inference on the GPU at up to ``samoyeds.get_config().dense_decode_max_rows``
tokens (default 16; 0 turns it off), runs two :func:`samoyeds.dense_decode` launches (gate,
up and SiLU in one; down in the other, its weights requested while the first ends) instead
of five, under ``torch.compile`` as the op ``torch.ops.samoyeds.shared_mlp``; above that
limit, in eager inference on the GPU, cuBLAS's three matmuls with SiLU-times-up as one
:func:`samoyeds.glu` pass; otherwise (autograd, the CPU, ``torch.compile`` above the limit)
the module's own forward.

Packed (opt-in, ``patch_model(..., shared_experts=True)``).  The MLP is replaced by a
:class:`SamoyedsMLP` holding it in the Samoyeds format: one expert that every token is
routed to with weight 1, run by the same op as the routed experts (SwiGLU fused).  It
changes the model more than packing the routed experts does (every token passes through
it), so it is off by default.

Both classes carry ``_samoyeds_shared`` and their own fast path, ``_samoyeds_fast(x)``
(None where it does not apply), which the block may run on a second stream (streams.py);
their forward asks :func:`streams.run_on_side` first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from .. import _config, torch_ops
from ..format import SparseFormat
from ..ops import ssmm
from ..packed import PackedDims, PackedWeight, pack, unpack
from . import streams
from .experts import (ARRAYS, PROJS, SHARED_NAMES, SUPPORTED_DTYPES, MaskFn, Target, UnsupportedModelError, blocks,
                      is_silu, method_mask, moe_op, set_arrays)
from .swap import swapped_class

DENSE_PREFIX = "SamoyedsDense<"
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")


class SamoyedsMLP(nn.Module):
    """A block's shared-experts MLP (``down(silu(gate(x)) * up(x))``) in the Samoyeds
    format: one expert that every token is routed to with weight 1, run by
    ``torch.ops.samoyeds.moe_forward`` with the SwiGLU fused (eager inference on the GPU
    skips the routing: two ``ssmm`` calls on x's rows as they lie).  Made by
    :func:`samoyeds.patch_model` (``shared_experts=True``); :func:`samoyeds.unpatch_model`
    puts the original module back with its (masked) dense weights.

    Arrays: ``samoyeds_gate_up_values/_meta/_idx`` (``[1, 2I, H]``, gate rows then up
    rows, packed with ``glu=True``) and ``samoyeds_down_values/_meta/_idx`` (``[1, H, I]``);
    the values are Parameters (trainable like the Linear weights they replace), metadata and
    row indices buffers.
    """

    _samoyeds_shared = True

    def __init__(self, fmt: SparseFormat, hidden: int, intermediate: int, gate_up: PackedWeight,
                 down: PackedWeight, original: nn.Module, requires_grad: bool = False):
        super().__init__()
        self.fmt, self.hidden, self.intermediate = fmt, hidden, intermediate
        for proj, pw in (("gate_up", gate_up), ("down", down)):
            set_arrays(self, proj, pw.values, pw.meta, pw.idx, requires_grad)
        # the module it replaces, without its weights (not a submodule: no state, no parameters)
        self.__dict__["_original"] = original

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, intermediate={self.intermediate}, fmt={self.fmt.name}"

    def _packed(self, proj: str) -> PackedWeight:
        """The buffers of ``proj`` as a PackedWeight, made again only when they were replaced
        (``.to()``, ``load_state_dict``)."""
        arrays = tuple(getattr(self, f"samoyeds_{proj}_{a}") for a in ARRAYS)
        cache = self.__dict__.setdefault("_packed_cache", {})
        got = cache.get(proj)
        if got is None or any(a is not b for a, b in zip(got[0], arrays)):
            shape = (1, 2 * self.intermediate, self.hidden) if proj == "gate_up" else (1, self.hidden, self.intermediate)
            got = cache[proj] = (arrays, PackedWeight(*arrays, self.fmt, shape, glu=proj == "gate_up"))
        return got[1]

    def _offsets(self, T: int, device: torch.device) -> torch.Tensor:
        """``[0, T]`` as int32 on ``device``, made there (no copy from the host) and kept per T
        and stream (a call on another stream never reads it before it is written); while a
        CUDA graph is being captured, made afresh and not kept (a tensor made in a capture
        holds its values only once the graph has run)."""
        if torch.cuda.is_current_stream_capturing():
            return torch.arange(2, dtype=torch.int32, device=device) * T
        cache = self.__dict__.setdefault("_offsets_cache", {})
        key = (device, T, torch.cuda.current_stream(device).cuda_stream)
        got = cache.get(key)
        if got is None:
            if len(cache) >= 64:
                cache.clear()
            got = cache[key] = torch.arange(2, dtype=torch.int32, device=device) * T
        return got

    def _samoyeds_fast(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Eager inference on the GPU: two matmuls on x's rows as they lie (no routing, no
        combine; on Hopper the rows come by TMA), the SwiGLU fused into the first; else None."""
        x2 = x.reshape(-1, self.hidden)
        direct = moe_op(x2, self.samoyeds_gate_up_values, self.samoyeds_down_values) is torch_ops.moe_forward_eager
        if not (x2.is_cuda and direct):   # (with autograd, the op: its values may require grad)
            return None
        x2 = x2.contiguous()
        offsets = self._offsets(x2.shape[0], x2.device)
        y = ssmm(x2, self._packed("gate_up"), offsets, None, act="swiglu", check=False)
        return ssmm(y, self._packed("down"), offsets, None, check=False).reshape(x.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = streams.run_on_side(self, x)
        if y is None:
            y = self._samoyeds_fast(x)
        if y is not None:
            return y
        shape = x.shape
        x2 = x.reshape(-1, self.hidden)
        T, H, I = x2.shape[0], self.hidden, self.intermediate
        # compiled graphs, autograd and the CPU: the op, one expert that every token is routed to
        index = torch.zeros((T, 1), dtype=torch.int64, device=x2.device)
        weight = torch.ones((T, 1), dtype=torch.float32, device=x2.device)
        n, m, v = self.fmt.c_args()
        gu, dn = self.samoyeds_gate_up_values, self.samoyeds_down_values
        y = moe_op(x2, gu, dn, training=self.training)(
            x2, index, weight, gu, self.samoyeds_gate_up_meta, self.samoyeds_gate_up_idx, 2 * I, H,
            dn, self.samoyeds_down_meta, self.samoyeds_down_idx, H, I, n, m, v, torch_ops.act_id("swiglu"))
        return y.reshape(shape)


@dataclass
class SharedTarget:
    name: str               # the shared MLP's name in model.named_modules()
    parent: nn.Module       # the MoE block holding it
    attr: str               # its attribute name there
    mlp: nn.Module


def find_shared(model: nn.Module, targets: List[Target]) -> List[SharedTarget]:
    """The shared-experts modules of the MoE blocks that own ``targets``' experts."""
    found: List[SharedTarget] = []
    for bname, block in blocks(model, targets):
        for attr in SHARED_NAMES:
            mod = block._modules.get(attr)
            if mod is not None:
                found.append(SharedTarget(f"{bname}.{attr}" if bname else attr, block, attr, mod))
    return found


def shared_dims(st: SharedTarget, model: nn.Module, fmt: SparseFormat) -> Tuple[int, int]:
    """(H, I) of a shared MLP samoyeds can pack, else UnsupportedModelError."""
    mod = st.mlp

    def fail(reason: str) -> None:
        raise UnsupportedModelError(f"{type(model).__name__}: shared experts {st.name!r} ({type(mod).__name__}) "
                                    f"are not supported: {reason}")

    if isinstance(mod, SamoyedsMLP):
        fail("they are packed already")
    lin = [mod._modules.get(k) for k in MLP_PROJS]
    if not all(isinstance(m, nn.Linear) for m in lin):
        fail("expected nn.Linear gate_proj, up_proj and down_proj")
    if any(m.bias is not None for m in lin):
        fail("their projections have biases; samoyeds packs bias-free shared experts")
    act = getattr(mod, "act_fn", getattr(mod, "activation_fn", None))  # (Llama 4: activation_fn)
    if not is_silu(act):
        fail(f"their activation {type(act).__name__} is not SiLU; the fused gate is SwiGLU")
    gate, up, down = (m.weight for m in lin)
    I, H = gate.shape
    if tuple(up.shape) != (I, H) or tuple(down.shape) != (H, I):
        fail(f"gate_proj {tuple(gate.shape)}, up_proj {tuple(up.shape)} and down_proj {tuple(down.shape)} "
             "do not form a gated MLP")
    for w in (gate, up, down):
        if w.dtype not in SUPPORTED_DTYPES:
            fail(f"their weights are {w.dtype}; samoyeds packs float32, bfloat16 and float16")
        if w.device.type == "meta":
            fail("their weights are on the meta device (not loaded)")
    try:
        PackedDims.of(fmt, 1, 2 * I, H, True)
        PackedDims.of(fmt, 1, H, I, False)
    except ValueError as e:
        fail(f"format {fmt.name} does not fit hidden size {H} and width {I}: {e}")
    return H, I


# --- unpruned shared experts: the dense decode path ---------------------------------------------

def mlp_weights(mod: nn.Module) -> Optional[List[torch.Tensor]]:
    """The gate, up and down weights of an MLP of three bias-free ``nn.Linear``, else None."""
    lin = [mod._modules.get(k) for k in MLP_PROJS]
    if not all(type(m) is nn.Linear and m.bias is None for m in lin):
        return None
    return [m.weight for m in lin]


def dense_fast(mod: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The shared MLP's output on the GPU in inference: up to the row limit two dense_decode
    launches (torch.ops.samoyeds.shared_mlp under torch.compile), above it cuBLAS's matmuls
    with SiLU and the product in one samoyeds.glu pass (under torch.compile: None, inductor
    fuses them itself); else None, where the module's own forward runs: off the GPU, with
    autograd, and for modules the kernels do not take (the op itself falls back to torch
    for weights it cannot read as they lie: dtype, device, alignment)."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    ws = mlp_weights(mod)  # (again per call: a projection may have been replaced since)
    if ws is None or (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in ws))):
        return None
    H = ws[0].shape[1]
    if x.shape[-1] != H:
        return None
    rows = _config.get().dense_decode_max_rows
    small = x.numel() <= rows * H
    if torch.compiler.is_compiling():
        return torch.ops.samoyeds.shared_mlp(x, *ws) if small else None
    return torch_ops.shared_mlp_eager(x, *ws, decode_rows=rows)


def _dense_fast_method(self: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    return dense_fast(self, x)


def _dense_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = streams.run_on_side(self, x)
    if y is None:
        y = dense_fast(self, x)
    return y if y is not None else type(self)._samoyeds_base.forward(self, x)


def dense_class(base: type) -> type:
    return swapped_class(DENSE_PREFIX, base, {"forward": _dense_forward, "_samoyeds_fast": _dense_fast_method,
                                              "_samoyeds_shared": True, "_samoyeds_dense_shared": True},
                         "whose forward runs samoyeds.dense_decode at decode sizes and samoyeds.glu above, on the GPU.")


def _dense_ok(mod: nn.Module) -> bool:
    """A gated SiLU MLP of bias-free nn.Linear projections, not patched yet."""
    if getattr(type(mod), "_samoyeds_shared", False):
        return False
    ws = mlp_weights(mod)
    if ws is None:
        return False
    act = getattr(mod, "act_fn", getattr(mod, "activation_fn", None))
    g, u, d = ws
    return is_silu(act) and g.shape == u.shape and tuple(d.shape) == (g.shape[1], g.shape[0])


def patch_dense_all(model: nn.Module, targets: List[Target]) -> None:
    """Gives every unpruned shared MLP of the blocks owning ``targets`` that the dense decode
    path takes its SamoyedsDense subclass (patch_model, from_pretrained)."""
    for st in find_shared(model, targets):
        if _dense_ok(st.mlp):
            st.mlp.__class__ = dense_class(type(st.mlp))


# --- packed shared experts ----------------------------------------------------------------------

def _shared_weights(mod: nn.Module) -> Dict[str, torch.Tensor]:
    """A shared MLP's weights in packing layout: gate_up [1, 2I, H], down [1, H, I]."""
    return {"gate_up": torch.cat([mod.gate_proj.weight.detach(), mod.up_proj.weight.detach()], 0)[None].contiguous(),
            "down": mod.down_proj.weight.detach()[None].contiguous()}


def _shared_mask(st: SharedTarget, proj: str, w: torch.Tensor, fmt: SparseFormat, method: Union[str, MaskFn],
                 given: Optional[Mapping[str, torch.Tensor]]) -> torch.Tensor:
    if given:
        if proj == "gate_up":
            m = torch.cat([given["gate_proj"], given["up_proj"]], 0)[None]
        else:
            m = given["down_proj"][None]
        return m.to(device=w.device).contiguous()
    return method_mask(st.name, proj, w, fmt, method)


def patch_shared(st: SharedTarget, fmt: SparseFormat, dims: Tuple[int, int], method: Union[str, MaskFn],
                 given: Optional[Mapping[str, torch.Tensor]]) -> None:
    """Replaces one shared MLP by a :class:`SamoyedsMLP` holding it packed."""
    H, I = dims
    mod = st.mlp
    ws = _shared_weights(mod)
    packed = {proj: pack(w, fmt, mask=_shared_mask(st, proj, w, fmt, method, given), glu=proj == "gate_up")
              for proj, w in ws.items()}
    del ws
    requires_grad = bool(mod.gate_proj.weight.requires_grad)
    for k in MLP_PROJS:
        delattr(mod, k)
    setattr(st.parent, st.attr, SamoyedsMLP(fmt, H, I, packed["gate_up"], packed["down"], mod, requires_grad))


def unpatch_shared(parent: nn.Module, attr: str) -> None:
    """Puts back the module a :class:`SamoyedsMLP` replaced, with its masked dense weights."""
    sm_mod: SamoyedsMLP = parent._modules[attr]
    I = sm_mod.intermediate
    dense = {proj: unpack(sm_mod._packed(proj))[0] for proj in PROJS}
    original = sm_mod._original
    rg = bool(sm_mod.samoyeds_gate_up_values.requires_grad)
    for k, w in (("gate_proj", dense["gate_up"][:I]), ("up_proj", dense["gate_up"][I:]), ("down_proj", dense["down"])):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        lin.weight = nn.Parameter(w.contiguous(), requires_grad=rg)
        setattr(original, k, lin)
    setattr(parent, attr, original)


def packed_shared(model: nn.Module) -> List[Tuple[str, nn.Module, str]]:
    """(name, parent, attr) of every SamoyedsMLP in ``model``."""
    out = []
    for name, mod in model.named_modules():
        for attr, child in mod._modules.items():
            if isinstance(child, SamoyedsMLP):
                out.append((f"{name}.{attr}" if name else attr, mod, attr))
    return out
