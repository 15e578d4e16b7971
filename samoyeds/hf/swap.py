"""The one class-swap mechanism of the Hugging Face integration.

A patched module keeps its state, its parameters and its state-dict names; only its class
changes, to a subclass of its own class whose members (``forward`` above all) run
samoyeds' kernels.  There is one such subclass per (kind, base class), made on first use
and kept.  Its name says what it is and where its base class lives, e.g.
``SamoyedsRouter<transformers:models:mixtral:modeling_mixtral:MixtralTopKRouter>``, and
its ``__module__`` is ``samoyeds.hf``: a pickle of a patched model finds the class through
``samoyeds.hf.__getattr__`` in a fresh process, which gives the name to the factory
registered for its prefix (hf/__init__.py).

Every swapped class carries ``_samoyeds_base`` (its base) and ``_samoyeds_swapped``;
:func:`unswap_all` gives every module of a model its own class back.
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, Mapping, Optional, Tuple

from torch import nn

__all__ = ["class_by_name", "swapped_class", "unswap", "unswap_all"]

# where pickles look the classes up (the package, whose __getattr__ makes them)
_HOME = "samoyeds.hf"
_CLASSES: Dict[Tuple[str, type], type] = {}


def swapped_class(prefix: str, base: type, members: Mapping[str, Any], doc: str,
                  instance_attrs: Tuple[str, ...] = ()) -> type:
    """The subclass of ``base`` of the kind ``prefix`` (``"Samoyeds<Kind><"``), with
    ``members`` (``forward``, flags); made once per (prefix, base) and kept.
    ``instance_attrs``: attributes the patch sets on a module of the class, dropped when
    the module gets its own class back."""
    cls = _CLASSES.get((prefix, base))
    if cls is None:
        name = f"{prefix}{base.__module__.replace('.', ':')}:{base.__qualname__.replace('.', ':')}>"
        cls = type(name, (base,), {**members, "__module__": _HOME, "__qualname__": name,
                                   "__doc__": f"{base.__name__} {doc}", "_samoyeds_base": base,
                                   "_samoyeds_swapped": True, "_samoyeds_instance_attrs": tuple(instance_attrs)})
        _CLASSES[(prefix, base)] = cls
    return cls


def class_by_name(name: str, prefix: str) -> Optional[type]:
    """The base class a swapped class's ``name`` (of the kind ``prefix``) stands for, or None."""
    if not (name.startswith(prefix) and name.endswith(">")):
        return None
    parts = name[len(prefix):-1].split(":")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj if isinstance(obj, type) else None
    return None


def unswap(mod: nn.Module) -> None:
    """Gives ``mod`` its own class back if samoyeds swapped it (and drops the patch's
    instance attributes)."""
    cls = type(mod)
    if getattr(cls, "_samoyeds_swapped", False):
        mod.__class__ = cls._samoyeds_base
        for attr in cls._samoyeds_instance_attrs:
            mod.__dict__.pop(attr, None)


def unswap_all(model: nn.Module) -> None:
    """Gives every module of ``model`` whose class samoyeds swapped its own class back."""
    for mod in model.modules():
        unswap(mod)
