"""transformers' common model tests (``ModelTesterMixin`` of its ``tests/test_modeling_common.py``)
on samoyeds-patched models, one ``unittest`` class per family.

Copied by run.py into the test package it builds beside transformers' own test files, where
``from .test_modeling_common import ModelTesterMixin`` resolves.  Every model of a family's
classes is patched with ``samoyeds.patch_model`` at its first forward (plugin.py), so each
common test runs the samoyeds experts.  The families' configs come from
``samoyeds.hf.families`` at a small shape the samoyeds format divides.
"""
from __future__ import annotations

import os
import unittest

import torch
import transformers
from transformers.testing_utils import require_torch

from samoyeds.hf.families import FAMILIES, Shape, make_config

from .generation.test_utils import GenerationTesterMixin
from .test_modeling_common import ModelTesterMixin, ids_tensor

# hidden 64, expert width 32: samoyeds-1:2:128 divides both (plugin.py picks the format)
SHAPE = Shape(vocab=99, hidden=64, layers=2, experts=4, top_k=2, intermediate=32, heads=4, kv_heads=2,
              head_dim=16, max_positions=512)
BASE_CLASSES = {
    "mixtral": "MixtralModel", "qwen2_moe": "Qwen2MoeModel", "qwen3_moe": "Qwen3MoeModel",
    "olmoe": "OlmoeModel", "deepseek_v2": "DeepseekV2Model", "deepseek_v3": "DeepseekV3Model",
    "gpt_oss": "GptOssModel", "phimoe": "PhimoeModel", "granitemoe": "GraniteMoeModel",
    "llama4": "Llama4TextModel",
}


class FamilyTester:
    """The ``model_tester`` ModelTesterMixin reads: a config and inputs of one family."""

    def __init__(self, parent, family: str):
        self.parent = parent
        self.family = family
        self.batch_size = 3
        self.seq_length = 7
        self.is_training = True
        self.vocab_size = SHAPE.vocab
        self.hidden_size = SHAPE.hidden
        self.num_hidden_layers = SHAPE.layers
        self.num_attention_heads = SHAPE.heads
        self.num_choices = 4

    def get_config(self):
        return make_config(self.family, SHAPE)

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        mask = torch.tril(torch.ones_like(input_ids))
        return self.get_config(), {"input_ids": input_ids, "attention_mask": mask}


def _test_class(family: str) -> type:
    fam = FAMILIES[family]
    classes = (getattr(transformers, BASE_CLASSES[family]), getattr(transformers, fam.model_class))

    def setUp(self):
        self.model_tester = FamilyTester(self, family)

    name = "Samoyeds" + "".join(p.capitalize() for p in family.split("_")) + "Test"
    # GenerationTesterMixin: transformers' own where the tests folder has it (a git checkout),
    # else run.py's empty stand-in (the sdist lacks tests/generation/)
    return require_torch(type(name, (ModelTesterMixin, GenerationTesterMixin, unittest.TestCase),
                              {"all_model_classes": classes, "setUp": setUp, "test_resize_embeddings": True,
                               "_samoyeds_family": family}))


_WANT = [f for f in os.environ.get("SAMOYEDS_SUITE_FAMILIES", ",".join(FAMILIES)).split(",") if f]
for _family in _WANT:
    _cls = _test_class(_family)
    globals()[_cls.__name__] = _cls
del _cls, _family
