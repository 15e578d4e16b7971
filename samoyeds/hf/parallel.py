"""Expert parallelism: patching a model that transformers has distributed.

transformers (5.2x) shards a MoE model when it is loaded with
``from_pretrained(path, distributed_config=DistributedConfig(tp_size=N, ep_size=N))``
under ``torchrun``: the model's ``ep_plan`` gives every experts module's weights the
``grouped_gemm`` style (a DTensor ``Shard(0)`` on the expert dimension: rank ``r`` holds
experts ``[r * E / N, (r + 1) * E / N)``; ``module.num_experts`` becomes ``E / N``) and the
module the ``ep_dispatch_experts`` style: its ``forward`` becomes an instance attribute
that calls an ``EPImplementation`` around the module's own forward.  At inference the
default (``"auto"``) is ``AllReduceEP``: every rank runs its own experts on the whole batch,
the ids of other ranks' experts replaced by the placeholder ``E / N`` with weight 0, and an
all-reduce sums the partial outputs.  The module's own forward dispatches through
``ExpertsInterface`` by the config's experts implementation on every call, so once
:func:`samoyeds.patch_model` selects ``"samoyeds"`` the same plan runs samoyeds' kernels:
the placeholders are ids ``>= E / N``, which contribute nothing, and the communication stays
transformers' and ``torch.distributed``'s.

What this module adds (patch_model calls it; a model without DTensor expert weights
passes through unchanged):

* :func:`localize`: each rank packs only its local experts.  The sharded expert
  Parameters (DTensors) are replaced by their local shards before packing; masks given
  for the whole model (shaped like the DTensor, ``[E, ...]``) are cut to the rank's
  experts the same way; what was replaced is recorded on the module.
* :func:`restore`: the inverse, for unpatch_model and a failed patch: the local
  Parameters become DTensors of the recorded mesh and placements again.
* :func:`keep_sharded`: shared experts that transformers shards tensor-parallel (a
  ``colwise``/``rowwise`` plan whose forward all-reduces) keep their own forward: the
  dense decode path and the second stream read whole local weights, so such modules get
  their own class back.  Packing them (``shared_experts=True``) is refused.

Routers are replicated by every plan transformers ships, so they keep samoyeds' router.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, MutableMapping, Optional, Tuple

import torch
from torch import nn

from . import swap
from .experts import Target, UnsupportedModelError
from .shared import find_shared

#: The Parameters of an experts module that an expert-parallel plan shards.
EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
#: Where :func:`localize` records what it replaced: ``{name: (mesh, placements)}``.
RECORD_ATTR = "_samoyeds_ep"


def is_dtensor(t: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (also as a Parameter)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def is_sharded(mod: nn.Module) -> bool:
    """True when some Parameter of ``mod`` or its children is a DTensor."""
    return any(is_dtensor(p) for p in mod.parameters())


def local_part(t: torch.Tensor, mesh: Any, placements: Tuple[Any, ...]) -> torch.Tensor:
    """The part of the whole tensor ``t`` that this rank holds under ``placements``
    (no communication: every rank cuts its own part)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t, mesh, list(placements), src_data_rank=None).to_local()


def localize(model: nn.Module, targets: List[Target],
             masks: MutableMapping[str, Mapping[str, torch.Tensor]], shared_experts: bool) -> List[nn.Module]:
    """Replaces the DTensor expert Parameters of ``targets`` by their local shards and cuts
    whole-model ``masks`` (shaped like the DTensors) to the local experts, in place.

    Returns the modules changed (for :func:`restore`).  Raises UnsupportedModelError for
    ``shared_experts=True`` on tensor-parallel shared experts, before anything changes.
    """
    sharded = [t for t in targets if any(is_dtensor(t.experts._parameters.get(n)) for n in EXPERT_PARAMS)]
    if not sharded:
        return []
    if shared_experts:
        for st in find_shared(model, targets):
            if is_sharded(st.mlp):
                raise UnsupportedModelError(
                    f"{type(model).__name__}: shared_experts=True, but {st.name!r} is sharded tensor-parallel "
                    "by the model's distributed plan; samoyeds packs whole shared experts only (leave "
                    "shared_experts=False: they stay dense and transformers runs them)")
    changed = []
    for t in sharded:
        mod, record = t.experts, {}
        given = masks.get(t.name)
        cut = dict(given) if given is not None else None
        for name in EXPERT_PARAMS:
            p = mod._parameters.get(name)
            if not is_dtensor(p):
                continue
            mesh, placements = p.device_mesh, tuple(p.placements)
            record[name] = (mesh, placements)
            if cut is not None and name in cut and tuple(cut[name].shape) == tuple(p.shape):
                cut[name] = local_part(cut[name], mesh, placements)
            mod._parameters[name] = nn.Parameter(p.to_local(), requires_grad=p.requires_grad)
        if cut is not None:
            masks[t.name] = cut
        mod.__dict__[RECORD_ATTR] = record
        changed.append(mod)
    return changed


def restore(modules: List[nn.Module]) -> None:
    """Inverse of :func:`localize`: the recorded Parameters that are local tensors again
    (after unpatching, or a patch that failed) become DTensors of their mesh."""
    from torch.distributed.tensor import DTensor

    for mod in modules:
        record: Optional[Dict[str, Tuple[Any, Tuple[Any, ...]]]] = mod.__dict__.pop(RECORD_ATTR, None)
        for name, (mesh, placements) in (record or {}).items():
            p = mod._parameters.get(name)
            if p is None or is_dtensor(p):
                continue
            d = DTensor.from_local(p.detach(), mesh, list(placements), run_check=False)
            mod._parameters[name] = nn.Parameter(d, requires_grad=p.requires_grad)


def recorded(model: nn.Module) -> List[nn.Module]:
    """The modules of ``model`` that :func:`localize` changed."""
    return [m for m in model.modules() if RECORD_ATTR in m.__dict__]


def keep_sharded(model: nn.Module, targets: List[Target]) -> None:
    """Gives the shared MLPs that the distributed plan shards (DTensor weights), and the
    blocks owning them, their own class back: their forward is transformers' sharded one."""
    for st in find_shared(model, targets):
        if is_sharded(st.mlp):
            swap.unswap(st.mlp)
            swap.unswap(st.parent)
