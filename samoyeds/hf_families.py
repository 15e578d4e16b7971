"""Alias of :mod:`samoyeds.hf.families`, kept so that ``samoyeds.hf_families`` imports as before."""
from .hf.families import FAMILIES, Shape, build_model, make_config  # noqa: F401

__all__ = ["FAMILIES", "Shape", "build_model", "make_config"]
