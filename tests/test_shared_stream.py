"""Shared experts beside the routed ones: a patched MoE block whose shared MLP samoyeds runs
starts that MLP on a second stream before its own forward (SamoyedsBlock<...>); the result
must be the one-stream result bit for bit, the streams must join whatever the block does, and
nothing changes off the GPU, with autograd, under a CUDA-graph capture, below the row limit
(patch_model's shared_stream_min_rows) or with patch_model(..., shared_stream=False)."""
from __future__ import annotations

import copy
import io

import pytest
import torch

transformers = pytest.importorskip("transformers")

import samoyeds as sm  # noqa: E402
from samoyeds.hf import shared, streams  # noqa: E402
from samoyeds.hf.families import Shape, build_model  # noqa: E402

transformers.logging.set_verbosity_error()

SHAPE = Shape(vocab=128, hidden=128, layers=2, experts=8, top_k=2, intermediate=64, heads=4, kv_heads=2,
              head_dim=32, init_std=0.1)
FMT = "samoyeds-1:2:128"


def _blocks(model):
    return [m for m in model.modules() if streams.shared_mlp(m) is not None]


def _marks(model):
    """The stream marks left on the model's shared MLPs (none once a block has returned)."""
    return [m for m in model.modules() if "_samoyeds_mark" in m.__dict__]


def _patched(family, seed, packed=False, device="cuda", **options):
    model = build_model(family, SHAPE, seed=seed)
    sm.patch_model(model, FMT, progress=False, shared_experts=packed, **options)
    return model.to(device=device, dtype=torch.bfloat16)


@pytest.mark.parametrize("family", ["deepseek_v2", "qwen2_moe"])
@pytest.mark.parametrize("packed", [False, True])
def test_block_class_swap_and_undo(family, packed):
    """patch_model gives each block with shared experts its SamoyedsBlock subclass (state-dict
    names, parameters and CPU logits unchanged), which deepcopy and torch.save keep, and
    unpatch_model gives the block its class back; blocks without shared experts, and those
    samoyeds has subclassed already (Llama 4), keep their class."""
    model = build_model(family, SHAPE, seed=3)
    ids = torch.randint(3, SHAPE.vocab, (2, 9), generator=torch.Generator().manual_seed(4))
    keys = {k for k in model.state_dict() if ".shared_expert" in k}
    sm.patch_model(model, FMT, progress=False, shared_experts=packed)
    blocks = _blocks(model)
    assert blocks
    for b in blocks:
        assert type(b).__name__.startswith("SamoyedsBlock<") and type(b)._samoyeds_block
        assert isinstance(b, type(b)._samoyeds_base)
    with torch.no_grad():
        logits = model(ids).logits
    if not packed:
        assert {k for k in model.state_dict() if ".shared_expert" in k} == keys
    clone = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad():
        assert torch.equal(clone(ids).logits, logits)
        assert torch.equal(loaded(ids).logits, logits)
    assert [type(b) for b in _blocks(loaded)] == [type(b) for b in blocks]
    assert all(b.__dict__[streams.MIN_ROWS_ATTR] == 4096 for b in _blocks(loaded))
    sm.unpatch_model(model)
    assert not any(getattr(type(m), "_samoyeds_block", False) for m in model.modules())
    assert not any(streams.MIN_ROWS_ATTR in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("family", ["deepseek_v2", "llama4"])
def test_shared_stream_options(family, tmp_path):
    """shared_stream=False leaves every block on one stream (no SamoyedsBlock class, no row
    limit, Llama 4's block included), through patch_model, from_pretrained and
    sparsify_model; shared_stream_min_rows is each block's row limit and must be an
    int >= 0."""
    def one_stream(model):
        assert _blocks(model)
        assert not any(getattr(type(m), "_samoyeds_block", False) for m in model.modules())
        assert not any(streams.MIN_ROWS_ATTR in m.__dict__ for m in model.modules())

    model = build_model(family, SHAPE, seed=3)
    sm.patch_model(model, FMT, progress=False, shared_stream=False)
    one_stream(model)
    sm.save_pretrained(model, tmp_path / "ckpt")
    one_stream(sm.from_pretrained(tmp_path / "ckpt", shared_stream=False))
    assert all(b.__dict__[streams.MIN_ROWS_ATTR] == 5 for b in _blocks(
        sm.from_pretrained(tmp_path / "ckpt", shared_stream_min_rows=5)))
    one_stream(sm.sparsify_model(build_model(family, SHAPE, seed=3), FMT, "magnitude", progress=False,
                                 shared_stream=False))
    model = build_model(family, SHAPE, seed=3)
    sm.patch_model(model, FMT, progress=False, shared_stream_min_rows=7)
    assert [b.__dict__[streams.MIN_ROWS_ATTR] for b in _blocks(model)] == [7] * len(_blocks(model))
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="shared_stream_min_rows"):
            sm.patch_model(build_model(family, SHAPE, seed=3), FMT, progress=False, shared_stream_min_rows=bad)
    with pytest.raises(TypeError, match="shared_stream: expected a bool"):
        sm.patch_model(build_model(family, SHAPE, seed=3), FMT, progress=False, shared_stream=1)


def test_blocks_without_shared_experts_keep_their_class():
    """Mixtral has no shared experts; Llama 4's block is samoyeds' subclass already and marks
    its start in its own forward."""
    for family in ("mixtral", "llama4"):
        model = build_model(family, SHAPE, seed=5)
        sm.patch_model(model, FMT, progress=False)
        assert not any(getattr(type(m), "_samoyeds_block", False) for m in model.modules()), family


def _spy(monkeypatch):
    """Records the stream each shared MLP's fast path (unpruned or packed) runs on."""
    seen = []
    real_dense, real_packed = shared.dense_fast, shared.SamoyedsMLP._samoyeds_fast

    def stream(x):
        seen.append(torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None)

    def dense(mod, x):
        stream(x)
        return real_dense(mod, x)

    def packed(self, x):
        stream(x)
        return real_packed(self, x)
    monkeypatch.setattr(shared, "dense_fast", dense)
    monkeypatch.setattr(shared.SamoyedsMLP, "_samoyeds_fast", packed)
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("family,packed", [("deepseek_v2", False), ("deepseek_v2", True), ("qwen2_moe", False),
                                           ("qwen2_moe", True), ("llama4", False)])
def test_two_streams_bit_identical_gpu(family, packed, monkeypatch):
    """bf16 on the GPU: the model's logits with the shared MLPs on the second stream equal
    those of the same model patched with shared_stream=False bit for bit, at decode sizes
    (dense_decode) and above (cuBLAS and glu; packed: the ssmm calls), and the shared MLPs
    did run on the second stream; they do not below the row limit, with autograd, or while
    a CUDA graph is captured (whose replay gives the eager output)."""
    model = _patched(family, 7, packed, shared_stream_min_rows=1)
    single = _patched(family, 7, packed, shared_stream=False)
    above_300 = _patched(family, 7, packed, shared_stream_min_rows=300)
    seen = _spy(monkeypatch)
    main = torch.cuda.current_stream().cuda_stream
    side = streams.side(torch.device("cuda"))[0].cuda_stream
    gen = torch.Generator().manual_seed(8)
    for batch, length in ((1, 1), (1, 5), (2, 8), (1, 17), (3, 100)):
        ids = torch.randint(3, SHAPE.vocab, (batch, length), generator=gen).cuda()
        with torch.no_grad():
            seen.clear()
            two = model(ids).logits
            assert seen and set(seen) == {side}, (batch, length, seen)
            seen.clear()
            one = single(ids).logits
            assert seen and set(seen) == {main}, seen
        assert torch.isfinite(two).all() and torch.equal(two, one), (batch, length)
        assert not _marks(model)
    # another thread orders its blocks with a stream and events of its own
    import threading
    other = []
    th = threading.Thread(target=lambda: other.append(streams.side(torch.device("cuda"))))
    th.start()
    th.join()
    assert all(a is not b for a, b in zip(other[0], streams.side(torch.device("cuda"))))
    # below the row limit: one stream
    seen.clear()
    with torch.no_grad():
        above_300(torch.randint(3, SHAPE.vocab, (2, 149), generator=gen).cuda())
        assert seen and set(seen) == {main}
        seen.clear()
        above_300(torch.randint(3, SHAPE.vocab, (2, 150), generator=gen).cuda())
        assert seen and set(seen) == {side}
    # a fresh input each call, the previous freed: no result read before it is written
    for i in range(20):
        ids = torch.randint(3, SHAPE.vocab, (2, 40 + i), generator=gen).cuda()
        with torch.no_grad():
            two = model(ids).logits
            one = single(ids).logits
        assert torch.equal(two, one), i
    # autograd: the modules' own forwards on the current stream
    seen.clear()
    with torch.enable_grad():
        model(ids)
    assert side not in seen
    # a CUDA graph capture of a block: one stream; the replay gives the eager output
    block = _blocks(model)[0]
    x = torch.randn(1, 12, SHAPE.hidden, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = block(x)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            block(x)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(s)
        seen.clear()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = block(x)
        assert seen and side not in seen
        g.replay()
        torch.cuda.synchronize()
    eager, out = (t[0] if isinstance(t, tuple) else t for t in (eager, out))
    assert torch.equal(out, eager)


@pytest.mark.gpu
def test_other_rows_and_unused_mark_gpu(monkeypatch):
    """A shared MLP called on other rows than the block's input (or on its input changed in
    place) runs on the current stream (the second stream would read them before they are
    written); a block that never calls its shared MLP leaves no mark behind; a mark is
    taken only by the thread that made it."""
    model = _patched("deepseek_v2", 11, shared_stream_min_rows=1000)
    seen = _spy(monkeypatch)
    main = torch.cuda.current_stream().cuda_stream
    side = streams.side(torch.device("cuda"))[0].cuda_stream
    block = _blocks(model)[0]
    mlp = streams.shared_mlp(block)
    H = SHAPE.hidden
    x = torch.randn(1, 1500, H, device="cuda", dtype=torch.bfloat16)
    base = type(block)._samoyeds_base
    real = base.forward
    want = type(mlp)._samoyeds_base.forward(mlp, x)

    def in_another_thread(self, h):
        got = []
        th = __import__("threading").Thread(target=lambda: got.append(self.shared_experts(h)))
        th.start()
        th.join()
        return got[0]
    calls = {"other": lambda self, h: self.shared_experts(h * 1),
             "view": lambda self, h: self.shared_experts(h.view(-1, H)),
             "in_place": lambda self, h: self.shared_experts(h.mul_(1)),
             "thread": in_another_thread,
             "none": lambda self, h: h * 2}
    try:
        for name, fwd in calls.items():
            base.forward = fwd
            seen.clear()
            xi = x.clone()   # (a tensor outside inference mode: it has a version counter)
            with torch.no_grad():
                out = block(xi)
            assert not _marks(model), name
            torch.cuda.synchronize()
            if name == "none":
                assert not seen and torch.equal(out, x * 2)
                continue
            if name != "thread":   # (another thread's current stream is its own default stream)
                assert seen == [side if name == "view" else main], (name, seen)
            else:
                assert len(seen) == 1 and seen[0] != side, seen
            assert torch.allclose(out.view_as(want).float(), want.float(), rtol=2e-2, atol=2e-2), name
    finally:
        base.forward = real


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_block_on_another_device_keeps_the_current_device():
    """A block on a GPU other than the current device: the shared MLP still runs on that
    device's second stream, the current device and both devices' current streams are as
    before, and the output is the one-stream output."""
    block = _blocks(_patched("deepseek_v2", 13, device="cuda:1", shared_stream_min_rows=1))[0]
    single = _blocks(_patched("deepseek_v2", 13, device="cuda:1", shared_stream=False))[0]
    x = torch.randn(1, 50, SHAPE.hidden, device="cuda:1", dtype=torch.bfloat16)
    torch.cuda.set_device(0)
    before = (torch.cuda.current_stream(0), torch.cuda.current_stream(1))
    with torch.no_grad():
        two = block(x)
        assert torch.cuda.current_device() == 0
        assert (torch.cuda.current_stream(0), torch.cuda.current_stream(1)) == before
        one = single(x)
    assert torch.equal(two, one)
