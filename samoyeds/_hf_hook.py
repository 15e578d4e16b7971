"""Registers samoyeds' transformers quantization method (``quant_method: "samoyeds"``,
samoyeds/hf/quantizer.py) as soon as transformers' quantizer registry exists, without
importing transformers (or torch) at ``import samoyeds``.

``samoyeds/__init__.py`` calls :func:`install`: if ``transformers.quantizers.auto`` is already
imported, the method is registered now; otherwise a one-shot import hook registers it right
after that module runs (transformers imports it with ``modeling_utils``, i.e. before any
``from_pretrained``).  So ``import samoyeds`` then ``AutoModelForCausalLM.from_pretrained(d)``
finds the method for a saved samoyeds model.  Stdlib only.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["install"]

_TARGET = "transformers.quantizers.auto"


def _register() -> None:
    mod = sys.modules.get("samoyeds.hf.quantizer")
    if mod is not None and not hasattr(mod, "register"):
        return  # samoyeds.hf.quantizer is importing transformers: it registers itself when it ends
    try:
        from .hf import quantizer

        quantizer.register()
    except Exception as e:  # never break transformers' own import
        warnings.warn(f"samoyeds: could not register its transformers quantization method "
                      f"({type(e).__name__}: {e}); saved samoyeds models will not load through transformers",
                      RuntimeWarning, stacklevel=2)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``transformers.quantizers.auto`` through the other finders and registers the
    method after the module has run."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 (importlib's signature)
        if name != _TARGET:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):  # noqa: ANN001, ANN202
            run(module)
            _register()

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Registers the method now (transformers' registry already imported) or on its import."""
    if _TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
