"""The fast decode path of patched models on the CPU: a decode step with transformers'
StaticCache compiles with ``fullgraph=True`` (no graph break), every patched experts module
appears in the graph as one ``samoyeds::moe_forward`` node (the eager fast path, which
bypasses the dispatcher, is not traced), and ``generate(..., cache_implementation="static")``
with compilation forced on the CPU gives the eager model's tokens."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import samoyeds as sm  # noqa: E402
from samoyeds.hf import experts as shf_experts  # noqa: E402
from samoyeds.hf.families import Shape, build_model  # noqa: E402

transformers.logging.set_verbosity_error()

SHAPE = Shape(vocab=128, hidden=128, layers=2, experts=8, top_k=2, intermediate=64, heads=4, kv_heads=2,
              head_dim=32, init_std=0.1)
FMT = "samoyeds-1:2:128"


def _patched(family="qwen3_moe", seed=3):
    model = build_model(family, SHAPE, seed=seed)
    sm.patch_model(model, FMT, progress=False)
    return model


class _Recorder:
    """A torch.compile backend that keeps the FX graphs it is given and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self):
        return [str(n.target) for g in self.graphs for n in g.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_static_cache_decode_step_compiles_fullgraph(family):
    model = _patched(family)
    ids = torch.randint(3, SHAPE.vocab, (2, 6), generator=torch.Generator().manual_seed(1))
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)                       # prefill, eager
        nxt = torch.randint(3, SHAPE.vocab, (2, 1), generator=torch.Generator().manual_seed(2))
        pos = torch.tensor([6])
        eager_cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        model(ids, cache=eager_cache, use_cache=True)
        want = model(nxt, cache=eager_cache, use_cache=True, cache_position=pos).logits
        torch._dynamo.reset()
        rec = _Recorder()
        step = torch.compile(model, fullgraph=True, backend=rec)
        got = step(nxt, cache=cache, use_cache=True, cache_position=pos).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    ops = [t for t in rec.targets() if "samoyeds" in t]
    n_experts = len(shf_experts.find_experts(model))
    assert len(ops) == n_experts and set(ops) <= {"samoyeds.moe_forward", "samoyeds.moe_forward.default"}, ops
    assert not any("moe_forward_eager" in t for t in rec.targets())


def test_eager_fast_path_not_traced(monkeypatch):
    """While dynamo traces, moe_op hands out the registered op; calling the eager fast path
    from inside a trace fails the test."""
    model = _patched()
    calls = {"traced": 0}
    real = sm.torch_ops.moe_forward_eager

    def spy(*args, **kwargs):
        if torch.compiler.is_compiling():
            calls["traced"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(sm.torch_ops, "moe_forward_eager", spy)
    ids = torch.randint(3, SHAPE.vocab, (1, 5))
    with torch.no_grad():
        torch._dynamo.reset()
        torch.compile(model, fullgraph=True, backend="aot_eager")(ids)
    assert calls["traced"] == 0


def test_generate_static_cache_compiled_matches_eager():
    model = _patched("olmoe", seed=5)
    ids = torch.randint(3, SHAPE.vocab, (2, 7), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **kw)
    cc = transformers.CompileConfig(backend="eager", mode=None, fullgraph=True)
    cc._compile_all_devices = True
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    got = model.generate(ids, cache_implementation="static", compile_config=cc, **kw)
    assert torch.equal(got, want)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
