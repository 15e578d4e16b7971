"""A small fine-tuning loop for Hugging Face causal LMs, patched by samoyeds or not.

:func:`finetune` runs AdamW over the model's trainable Parameters (those that require grad:
for a patched model the packed expert values too, unless frozen by
:func:`samoyeds.freeze_experts`) on next-token prediction, and returns the loss of every
step.  It is meant for short runs: healing a freshly sparsified model on a little data,
tests, notebooks.  Longer runs use ``transformers.Trainer`` on the patched model like on any
other (docs/HF.md, "Training").

A gradient step on packed experts moves only the kept weights: the gradient of the packed
values is the dense gradient at the kept positions, and the masks (metadata, row indices)
are buffers that never change, so the model stays in the format it was packed in.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from torch import nn

from ._array import check_model

__all__ = ["finetune"]


def _inputs(batch: Any, device: torch.device) -> Dict[str, Any]:
    """Model inputs of one batch: ``input_ids`` (a tensor) or a dict of model inputs; labels
    default to the input ids, with padding (``attention_mask`` 0) ignored."""
    if isinstance(batch, torch.Tensor):
        kw: Dict[str, Any] = {"input_ids": batch}
    elif isinstance(batch, Mapping):
        kw = dict(batch)
        if "input_ids" not in kw and "inputs_embeds" not in kw:
            raise ValueError(f"batches: a dict batch needs 'input_ids' or 'inputs_embeds', got keys {sorted(kw)}")
    else:
        raise TypeError(f"batches: expected input_ids tensors or dicts of model inputs, got {type(batch).__name__}")
    kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    if "labels" not in kw:
        if "input_ids" not in kw:
            raise ValueError("batches: a batch of inputs_embeds needs 'labels'")
        labels = kw["input_ids"].clone()
        mask = kw.get("attention_mask")
        if mask is not None:
            labels = labels.masked_fill(mask == 0, -100)
        kw["labels"] = labels
    kw.setdefault("use_cache", False)
    return kw


def _checkpointing(model: nn.Module, on: Optional[bool] = None) -> bool:
    """Whether the model recomputes activations in the backward; ``on`` switches it first
    (transformers' ``activation_checkpointing_*``, ``gradient_checkpointing_*`` before 5.x's rename)."""
    if on is not None:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(f"gradient_checkpointing: {type(model).__name__} does not support it")
        name = "enable" if on else "disable"
        fn = getattr(model, f"activation_checkpointing_{name}", None) or getattr(model, f"gradient_checkpointing_{name}")
        fn()
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def finetune(model: nn.Module, batches: Iterable[Any], *, steps: Optional[int] = None, lr: float = 1e-4,
             weight_decay: float = 0.0, betas: Tuple[float, float] = (0.9, 0.999), max_grad_norm: Optional[float] = 1.0,
             router_aux_loss: bool = False, gradient_checkpointing: bool = False,
             callback: Optional[Callable[[int, float], Any]] = None, progress: bool = False) -> List[float]:
    """Fine-tunes ``model`` in place with AdamW for ``steps`` steps; returns the loss of each step.

    Args:
        model: a transformers causal LM (``model(input_ids=..., labels=...)`` returns a
            ``loss``), patched by :func:`samoyeds.patch_model` / :func:`samoyeds.sparsify_model`
            or not.  Only its Parameters that require grad are updated; freeze the packed
            experts with :func:`samoyeds.freeze_experts` (or ``requires_grad_(False)``) to
            train the rest alone.
        batches: input_ids tensors ``[B, T]`` or dicts of model inputs, one per step, taken in
            order and cycled when ``steps`` is larger.  Labels are the input ids (the model
            shifts them) with padded positions (``attention_mask`` 0) ignored, unless a dict
            gives ``labels``.  Moved to the model's device.
        steps: optimizer steps (default: one per batch; required for a ``batches`` without ``len``).
        lr, weight_decay, betas: AdamW's (``torch.optim.AdamW``, decoupled weight decay on every
            trained Parameter).
        max_grad_norm: clip the gradients' global norm to this (None: no clipping).
        router_aux_loss: pass ``output_router_logits=True``, so that the model adds its router
            load-balancing loss (``router_aux_loss_coef * aux_loss``) to the loss it returns;
            the returned history is that total.
        gradient_checkpointing: recompute activations in the backward
            (``model.activation_checkpointing_enable()``, formerly ``gradient_checkpointing_enable``,
            for the run; disabled after unless it was on before).
        callback: called as ``callback(step, loss)`` after every step (``step`` from 0).
        progress: a tqdm bar over the steps.
    Returns:
        The loss of every step, as Python floats (before that step's update).
    Raises:
        ValueError: no Parameter requires grad, ``steps`` is missing or not positive, a
            loss is not finite (nothing learns from a NaN: the step is not taken),
            ``router_aux_loss`` for a model without a router auxiliary loss (DeepSeek-V2/V3,
            Llama 4 in transformers 5.24).
    The model is in train mode during the run and goes back to the mode it was in.
    """
    check_model(model)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{type(model).__name__}: no Parameter requires grad; nothing to fine-tune "
                         "(samoyeds.freeze_experts(model, False) unfreezes the packed experts)")
    if steps is None:
        if not hasattr(batches, "__len__"):
            raise ValueError("steps: required when batches has no len()")
        steps = len(batches)  # type: ignore[arg-type]
        if steps == 0:
            raise ValueError("batches: empty; nothing to fine-tune on")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected an int >= 1, got {steps!r}")
    device = params[0].device
    it = itertools.cycle(batches) if hasattr(batches, "__len__") else iter(batches)
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    was_training = model.training
    was_checkpointing = _checkpointing(model)
    if gradient_checkpointing and not was_checkpointing:
        _checkpointing(model, True)
    bar = None
    if progress:
        try:
            from tqdm.auto import tqdm
            bar = tqdm(total=steps, desc="samoyeds: fine-tuning", unit="step")
        except ImportError:
            pass
    history: List[float] = []
    model.train()
    try:
        for step in range(steps):
            try:
                batch = next(it)
            except StopIteration:
                raise ValueError(f"batches: ran out after {step} of {steps} steps") from None
            kw = _inputs(batch, device)
            if router_aux_loss:
                kw["output_router_logits"] = True
            out = model(**kw)
            loss = out.loss
            if loss is None:
                raise ValueError(f"{type(model).__name__} returned no loss for labels; expected a causal LM")
            if router_aux_loss and getattr(out, "aux_loss", None) is None:
                raise ValueError(f"router_aux_loss: {type(model).__name__} returns no router auxiliary loss "
                                 "(output_router_logits is not one of its inputs)")
            value = float(loss.detach())
            if not math.isfinite(value):
                raise ValueError(f"step {step}: the loss is {value}; lower lr or check the batches")
            loss.backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            history.append(value)
            if callback is not None:
                callback(step, value)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{value:.4f}")
    finally:
        opt.zero_grad(set_to_none=True)
        if bar is not None:
            bar.close()
        if gradient_checkpointing and not was_checkpointing:
            _checkpointing(model, False)
        model.train(was_training)
    return history
