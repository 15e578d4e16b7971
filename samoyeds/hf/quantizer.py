"""Samoyeds as a transformers quantization method: ``model.save_pretrained`` and
``AutoModel*.from_pretrained`` handle packed experts natively.

A model patched by :func:`samoyeds.patch_model` carries ``model.hf_quantizer`` (a
:class:`SamoyedsHfQuantizer`) and ``config.quantization_config`` (a :class:`SamoyedsConfig`,
``quant_method: "samoyeds"``), so ``model.save_pretrained(d)`` writes the packed arrays (the
experts modules' ``samoyeds_*`` arrays, under their transformers names) and the config.
With the method registered (``import samoyeds`` arranges it), transformers' loader

* on a saved samoyeds model (pre-quantized): builds the model on the meta device, replaces
  every experts module's dense Parameters by meta tensors shaped like the packed arrays and
  reads the file's arrays into them; no dense expert weight is ever created;
* on a dense checkpoint with ``quantization_config=SamoyedsConfig(format=..., method=
  "magnitude")``: keeps the dense Parameters on the meta device and packs each one as the
  loader hands it over (on the device the ``device_map`` gives it), so one projection of one
  layer is dense at a time.

Either way the model is then patched as :func:`samoyeds.patch_model` leaves it: experts
implementation ``"samoyeds"``, routers, unpruned shared experts and blocks with their
samoyeds classes.  Packed shared experts (``patch_model(..., shared_experts=True)``) are not
serialisable.  Tested with transformers 5.24 (written against its ``transformers.quantizers``
API: ``param_needs_quantization``, ``get_quantize_ops``, ``_process_model_*_weight_loading``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn
from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                          register_quantization_config, register_quantizer)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .. import _C
from ..format import SparseFormat
from ..packed import PackedDims, PackedWeight, mask as magnitude_mask, pack
from . import experts as _experts

__all__ = ["QUANT_METHOD", "SamoyedsConfig", "SamoyedsHfQuantizer", "attach", "detach", "register"]

#: ``quant_method`` in config.json.
QUANT_METHOD = "samoyeds"
_DENSE = ("gate_up_proj", "down_proj", "gate_up_proj_bias")


class SamoyedsConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of a model with samoyeds-packed experts.

    Args:
        format: the sparse format of the routed experts (a preset name such as
            ``"samoyeds-1:2:128"``, ``"n:m:v"``, or a :class:`samoyeds.SparseFormat`).
        method: how a dense checkpoint is pruned while loading: ``"magnitude"`` (the
            only method that needs no calibration data; ``samoyeds.sparsify_model`` runs
            the calibrated ones on a loaded model).  A saved model records the method
            that made it (``"custom"`` for a mask function or given masks).
        router, shared_stream, shared_stream_min_rows: as :func:`samoyeds.patch_model`'s,
            applied when the model is loaded.
        layout_version: the packed layout version of the arrays (set on saving; a model
            saved with another version is refused on loading).
    """

    def __init__(self, format: Any = "samoyeds-1:2:128", method: str = "magnitude", router: bool = True,
                 shared_stream: bool = True, shared_stream_min_rows: int = 4096,
                 layout_version: Optional[int] = None, **kwargs: Any) -> None:
        self.quant_method = QUANT_METHOD
        self.format = SparseFormat.parse(format).name
        if not isinstance(method, str):
            raise TypeError(f"method: expected a method name such as 'magnitude', got {type(method).__name__}")
        self.method = method
        from . import check_options

        check_options(router, shared_stream, shared_stream_min_rows)
        self.router = router
        self.shared_stream = shared_stream
        self.shared_stream_min_rows = shared_stream_min_rows
        self.layout_version = int(_C.LAYOUT_VERSION if layout_version is None else layout_version)
        self.samoyeds_version = str(kwargs.pop("samoyeds_version", _C.__version__))
        kwargs.pop("quant_method", None)
        if kwargs:
            raise TypeError(f"SamoyedsConfig: unexpected arguments {sorted(kwargs)}")

    @property
    def fmt(self) -> SparseFormat:
        return SparseFormat.parse(self.format)

    def to_dict(self) -> Dict[str, Any]:
        return {"quant_method": QUANT_METHOD, "format": self.format, "method": self.method, "router": self.router,
                "shared_stream": self.shared_stream, "shared_stream_min_rows": self.shared_stream_min_rows,
                "layout_version": self.layout_version, "samoyeds_version": self.samoyeds_version}

    def to_diff_dict(self) -> Dict[str, Any]:
        return self.to_dict()


def _packed_shapes(layout: "_experts.ExpertsPatch") -> Dict[str, Dict[str, tuple]]:
    """{proj: {array: shape}} of one experts module's packed arrays."""
    E, H, I = layout.num_experts, layout.hidden, layout.intermediate
    out = {}
    for proj, (R, C), glu in (("gate_up", (2 * I, H), True), ("down", (H, I), False)):
        d = PackedDims.of(layout.fmt, E, R, C, glu)
        shapes = {"values": (E, d.rp, d.cp // 2), "meta": (E, d.rp // 16, d.cp // 32, 16)}
        if layout.fmt.selects_rows:
            shapes["idx"] = (E, d.slices, d.rp)
        out[proj] = shapes
    return out


_ARRAY_DTYPES = {"meta": torch.uint32, "idx": torch.uint8}


class SamoyedsHfQuantizer(HfQuantizer):
    """transformers' side of a samoyeds model: builds packed experts modules on load,
    packs dense checkpoints while loading, and lets ``save_pretrained`` write the packed
    arrays (module docstring)."""

    requires_calibration = False

    def __init__(self, quantization_config: SamoyedsConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self._layouts: Dict[str, "_experts.ExpertsPatch"] = {}
        self._targets: List["_experts.Target"] = []

    # -- checks --------------------------------------------------------------------------------
    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        cfg = self.quantization_config
        if self.pre_quantized:
            if cfg.layout_version != _C.LAYOUT_VERSION:
                raise ValueError(f"quantization_config.layout_version: the model was packed with layout version "
                                 f"{cfg.layout_version}; this samoyeds reads layout version {_C.LAYOUT_VERSION} "
                                 "(repack it from its dense weights)")
        elif cfg.method != "magnitude":
            raise NotImplementedError(
                f"SamoyedsConfig(method={cfg.method!r}): only 'magnitude' packs while loading; the calibrated "
                "methods run through samoyeds.sparsify_model(model, fmt, method, calibration=...) on a loaded model")
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("device_map: samoyeds experts cannot be offloaded to disk")

    def update_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    # The packed values are Parameters with a backward (docs/HF.md, "Training"): transformers'
    # Trainer may fine-tune a samoyeds model whole, or with adapters.
    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        return True

    def is_serializable(self, safe_serialization: Any = None) -> bool:
        model = getattr(self, "_model_ref", None)
        if model is not None:
            from .shared import packed_shared

            shared = packed_shared(model)
            if shared:
                raise NotImplementedError(
                    f"{type(model).__name__}: shared experts {[n for n, _, _ in shared][:2]} are packed "
                    "(patch_model(..., shared_experts=True)); saved samoyeds models hold packed routed experts only: "
                    "save the model patched without shared_experts=True")
        return True

    # -- loading -------------------------------------------------------------------------------
    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs: Any) -> bool:
        if self.pre_quantized:
            return False
        mod, _, attr = param_name.rpartition(".")
        return attr in _DENSE and mod in self._layouts

    def param_element_size(self, model: nn.Module, param_name: str, param: torch.Tensor) -> float:
        """What transformers' allocator warm-up reserves per element: nothing for a dense experts
        tensor packed while loading (only its packed arrays, counted apart, stay on the device).
        Counting it reserved the dense experts' size on the GPU before the first tensor came."""
        if self.param_needs_quantization(model, param_name):
            return 0
        return param.element_size()

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        """On the meta-device model: every experts module gets meta tensors shaped like
        its packed arrays; a pre-quantized load drops the dense Parameters now, a packing
        load keeps them (on meta) for the loader to hand over."""
        _experts.register()
        fmt = self.quantization_config.fmt
        self._targets = _experts.find_experts(model)
        self._layouts = {}
        for t in self._targets:
            layout = _experts.experts_layout(t, model, fmt, allow_meta=True)
            dtype = t.experts._parameters["gate_up_proj"].dtype
            device = t.experts._parameters["gate_up_proj"].device
            for proj, shapes in _packed_shapes(layout).items():
                arrays = {a: torch.empty(shape, dtype=_ARRAY_DTYPES.get(a, dtype), device=device)
                          for a, shape in shapes.items()}
                # values: a Parameter (the loader keeps it one), meta and idx: buffers
                _experts.set_arrays(t.experts, proj, arrays["values"], arrays["meta"], arrays.get("idx"),
                                    layout.requires_grad)
            bias = None
            if layout.bias:
                bias = torch.empty((layout.num_experts, 2 * layout.intermediate), dtype=dtype, device=device)
            _experts.set_bias(t.experts, bias, layout.requires_grad)
            if self.pre_quantized:
                _drop_dense(t.experts, layout)
            # transformers' weight init must not touch a module whose Parameters are gone
            t.experts._is_hf_initialized = True
            self._layouts[t.name] = layout
        return model

    def get_quantize_ops(self) -> Any:
        return _pack_op(self)

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        """Checks the loaded arrays and patches the model as patch_model leaves it."""
        from . import install, llama4, select
        from ..checkpoint import CheckpointError

        cfg = self.quantization_config
        for t in self._targets:
            layout = self._layouts[t.name]
            _drop_dense(t.experts, layout)
            for proj, (R, C), glu in (("gate_up", (2 * layout.intermediate, layout.hidden), True),
                                      ("down", (layout.hidden, layout.intermediate), False)):
                arrays = [getattr(t.experts, f"samoyeds_{proj}_{a}") for a in _experts.ARRAYS]
                left = [a for a, x in zip(_experts.ARRAYS, arrays) if x is not None and x.device.type == "meta"]
                if left:
                    raise CheckpointError(f"{t.name}: no value loaded for samoyeds_{proj}_{left[0]}")
                pw = PackedWeight(*arrays, layout.fmt, (layout.num_experts, R, C), glu=glu)
                _check_codes(pw, f"{t.name}.samoyeds_{proj}")
            t.experts._samoyeds = layout
            if t.block is not None and not getattr(type(t.block), "_samoyeds_swapped", False):
                t.block.__class__ = llama4.patched_class(type(t.block))
        install(model, self._targets, dense_shared=True, router=cfg.router, shared_stream=cfg.shared_stream,
                shared_stream_min_rows=cfg.shared_stream_min_rows)
        select(model, self._targets)
        self.pre_quantized = True
        self._model_ref = model
        return model

    def _dequantize(self, model: nn.Module, dtype: Any = None) -> nn.Module:
        from . import unpatch_model

        return unpatch_model(model)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_model_ref", None)
        state["_targets"] = []
        return state


def _drop_dense(mod: nn.Module, layout: "_experts.ExpertsPatch") -> None:
    for name in _DENSE:
        if name in mod._parameters and (name != "gate_up_proj_bias" or layout.bias):
            delattr(mod, name)


def _check_codes(pw: PackedWeight, key: str) -> None:
    """The row indices and 2:4 codes the kernels index with (checkpoint.py's check)."""
    from .. import checkpoint

    check = getattr(checkpoint, "_check_codes", None)
    if check is not None:
        check(pw, "model weights", key)


def _pack_op(quantizer: SamoyedsHfQuantizer) -> Any:
    from transformers.core_model_loading import ConversionOps

    class SamoyedsPack(ConversionOps):
        """Packs a dense experts Parameter handed over by the loader into its packed arrays."""

        def convert(self, input_dict: Dict[str, Any], source_patterns: Any = None, target_patterns: Any = None,
                    missing_keys: Any = None, **kwargs: Any) -> Dict[str, Any]:
            out: Dict[str, Any] = {}
            for key, value in input_dict.items():
                w = value[0] if isinstance(value, list) else value
                mod_name, _, attr = key.rpartition(".")
                layout = quantizer._layouts.get(mod_name)
                if layout is None or attr not in _DENSE:
                    out[key] = value
                    continue
                if missing_keys is not None:
                    missing_keys.discard(key)
                with torch.no_grad():
                    if attr == "gate_up_proj_bias":
                        b = w.detach()
                        b = _experts.split_gate_up(b, 1) if layout.interleaved else b
                        out[f"{mod_name}.samoyeds_gate_up_bias"] = b.contiguous()
                        continue
                    proj = attr[: -len("_proj")]
                    wp = _experts.to_pack(w, layout, proj)
                    pw = pack(wp, layout.fmt, mask=magnitude_mask(wp, layout.fmt), glu=proj == "gate_up")
                    del wp
                for a, arr in pw.tensors().items():
                    out[f"{mod_name}.samoyeds_{proj}_{a}"] = arr
            return out

    return SamoyedsPack()


def attach(model: nn.Module, fmt: SparseFormat, method: Any, router: bool, shared_stream: bool,
           shared_stream_min_rows: int) -> None:
    """Gives a model just patched by patch_model its quantization config and quantizer, so
    that ``model.save_pretrained`` writes it as a samoyeds model."""
    if not hasattr(model, "config") or not hasattr(model, "save_pretrained"):
        return
    cfg = SamoyedsConfig(format=fmt, method=method if isinstance(method, str) else "custom", router=router,
                         shared_stream=shared_stream, shared_stream_min_rows=shared_stream_min_rows)
    q = SamoyedsHfQuantizer(cfg, pre_quantized=True)
    q._model_ref = model
    model.hf_quantizer = q
    model.config.quantization_config = cfg


def detach(model: nn.Module) -> None:
    """Undoes :func:`attach` (unpatch_model): the model is a plain dense one again."""
    q = getattr(model, "hf_quantizer", None)
    if isinstance(q, SamoyedsHfQuantizer):
        del model.hf_quantizer
        for attr in ("is_quantized", "quantization_method"):
            if attr in model.__dict__:
                delattr(model, attr)
    cfg = getattr(model, "config", None)
    if isinstance(getattr(cfg, "quantization_config", None), SamoyedsConfig):
        del cfg.quantization_config
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and getattr(c, "_is_quantized", False) and not hasattr(c, "quantization_config"):
            c._is_quantized = False


def register() -> None:
    """Registers ``quant_method="samoyeds"`` with transformers (idempotent)."""
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not SamoyedsConfig:
        AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)
        register_quantization_config(QUANT_METHOD)(SamoyedsConfig)
    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not SamoyedsHfQuantizer:
        AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
        register_quantizer(QUANT_METHOD)(SamoyedsHfQuantizer)


register()
