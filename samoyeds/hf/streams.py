"""Shared experts beside the routed ones: a second CUDA stream.

A MoE block's shared MLP reads only the block's input, so on the GPU its kernels need not
wait for the router, the routing and the routed experts, nor they for it.  A patched block
whose shared MLP samoyeds runs (a class with ``_samoyeds_shared``: shared.py's
``SamoyedsMLP`` and ``SamoyedsDense<...>``) becomes a ``SamoyedsBlock<...>`` subclass
(Llama 4's block, a samoyeds subclass already, does the same in its own forward): its
forward marks the current stream where it starts and hands the mark to the shared MLP it
owns, then runs the block's own forward; when that calls the shared MLP on the block's
input (the same rows, unchanged), the MLP takes the mark and runs its fast path (its
``_samoyeds_fast`` method) on a second stream that waits only for the mark, and the current
stream waits for it before it goes on.  A mark is taken once, by the thread that made it;
the block drops one its MLP did not take.

The routed path's launches come first, so a block started on an idle GPU is not held
behind the shared MLP; on a busy GPU the two overlap.  The kernels and rows are the same
as on one stream (bit-identical).  Below the block's row limit
(``patch_model(..., shared_stream_min_rows=4096)``) everything stays on one stream: there
a block's launches take the host about as long as its kernels take the GPU, and the
ordering costs the host more than the overlap saves.  ``shared_stream=False`` keeps every
block on one stream.

This module knows shared MLPs only by that protocol (it imports nothing of shared.py).
"""
from __future__ import annotations

import threading
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from .experts import SHARED_NAMES, Target, blocks
from .swap import swapped_class

BLOCK_PREFIX = "SamoyedsBlock<"
_MARK = "_samoyeds_mark"                          # on a shared MLP while its block's forward runs
MIN_ROWS_ATTR = "_samoyeds_shared_stream_min_rows"  # on a block: its row limit (absent: one stream)

# Per thread: the second stream of each device and the two events that order it against the
# current stream (a resource cache; a mark goes from the block to its MLP as an attribute).
_RESOURCES = threading.local()


def shared_mlp(block: nn.Module) -> Optional[nn.Module]:
    """The block's shared MLP where samoyeds runs it, else None."""
    for attr in SHARED_NAMES:
        mod = block._modules.get(attr)
        if mod is not None and getattr(type(mod), "_samoyeds_shared", False):
            return mod
    return None


def side(device: torch.device) -> Tuple[Any, Any, Any]:
    """This thread's second stream of ``device`` and the two events that order it against the
    current stream (made once; an event is recorded again by each call, and a wait takes the
    record made before it, so one pair serves every block the thread runs in turn)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    per = _RESOURCES.__dict__.setdefault("by_device", {})
    got = per.get(idx)
    if got is None:
        got = per[idx] = (torch.cuda.Stream(device=idx), torch.cuda.Event(), torch.cuda.Event())
    return got


def _input_key(x: torch.Tensor) -> tuple:
    """What identifies a block's input when its shared MLP is called on it, or on a view of
    it with the same rows: where its elements lie, how many, their dtype and its version
    (inference tensors have none)."""
    return (x.data_ptr(), x.numel(), x.shape[-1] if x.ndim else 0, x.dtype, x.is_contiguous(),
            None if x.is_inference() else x._version)


def block_start(block: nn.Module, x: Any) -> Optional[tuple]:
    """Marks the current stream at the block's start and hands the mark to its shared MLP:
    returns (the MLP, the mark), or None where the MLP stays on the current stream: a block
    without a row limit (``shared_stream=False``), off the GPU, with autograd, under
    torch.compile or a CUDA-graph capture, below the block's row limit."""
    min_rows = block.__dict__.get(MIN_ROWS_ATTR)
    if (min_rows is None or torch.compiler.is_compiling() or not isinstance(x, torch.Tensor) or not x.is_cuda
            or x.dtype not in (torch.bfloat16, torch.float16) or x.ndim == 0):
        return None
    rows = x.numel() // max(1, x.shape[-1])
    if rows < min_rows or torch.cuda.is_current_stream_capturing():
        return None
    mod = shared_mlp(block)
    if mod is None or (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in mod.parameters()))):
        return None
    main = torch.cuda.current_stream(x.device)
    _, start, _ = side(x.device)
    start.record(main)
    mark = (threading.get_ident(), _input_key(x), main)
    mod.__dict__[_MARK] = mark
    return mod, mark


def run_on_side(mod: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The shared MLP's output on ``x`` from the second stream, which waits for the mark of
    the block's start, once the current stream has waited for it; None where the block did
    not mark its start for this call or ``x`` is not the block's input (the MLP then runs on
    the current stream as it would without the block).  Called by the MLP's forward."""
    if torch.compiler.is_compiling():
        return None
    mark = mod.__dict__.get(_MARK)
    if mark is None or mark[0] != threading.get_ident():
        return None
    del mod.__dict__[_MARK]
    if not isinstance(x, torch.Tensor) or _input_key(x) != mark[1]:
        return None
    main = mark[2]
    stream, start, done = side(x.device)
    stream.wait_event(start)
    if x.device.index == torch.cuda.current_device():
        torch.cuda.set_stream(stream)   # (the lighter switch; it also makes the stream's device current)
        try:
            y = mod._samoyeds_fast(x)
        finally:
            torch.cuda.set_stream(main)
    else:   # another device than the current one, which stays current
        with torch.cuda.stream(stream):
            y = mod._samoyeds_fast(x)
    if y is None:   # nothing launched
        return None
    done.record(stream)
    main.wait_event(done)
    x.record_stream(stream)   # x's memory is not reused before the second stream has read it
    y.record_stream(main)     # y is read on the current stream
    return y


def block_end(marked: Optional[tuple]) -> None:
    """Drops the mark of a block's start that its shared MLP did not take."""
    if marked is not None:
        mod, mark = marked
        if mod.__dict__.get(_MARK) is mark:
            del mod.__dict__[_MARK]


def _block_forward(self: nn.Module, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
    marked = block_start(self, hidden_states)
    try:
        return type(self)._samoyeds_base.forward(self, hidden_states, *args, **kwargs)
    finally:
        block_end(marked)


def block_class(base: type) -> type:
    return swapped_class(BLOCK_PREFIX, base, {"forward": _block_forward, "_samoyeds_block": True},
                         "whose shared experts run beside its routed experts, on a second stream.",
                         instance_attrs=(MIN_ROWS_ATTR,))


def enable(model: nn.Module, targets: List[Target], min_rows: int) -> None:
    """Gives every block owning ``targets`` whose shared MLP samoyeds runs the row limit
    ``min_rows``, and its SamoyedsBlock subclass where its class is its own (Llama 4's,
    a samoyeds subclass already, marks its start in its own forward)."""
    for _, block in blocks(model, targets):
        if shared_mlp(block) is None:
            continue
        if not hasattr(type(block), "_samoyeds_base"):
            block.__class__ = block_class(type(block))
        block.__dict__[MIN_ROWS_ATTR] = min_rows
