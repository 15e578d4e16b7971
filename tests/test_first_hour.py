"""The first hour of a new user (issue 45): what they try, and what they must see.

Each test is one stumble from the issue: the README's snippets run as written on this
machine; messages name the argument in one vocabulary (torch/numpy dtype names, the
dtypes of *that* argument, a `.contiguous()` hint where it fixes the call, the shape
before the layout, samoyeds' words around a producer's device error); ids outside
[0, E) can be checked; a tensor requiring grad is not dropped silently; reprs summarise;
packed weights pickle; notebooks' temporary folders go away.  The CLI's and the
format spellings' cases are in tests/test_cli.py and tests/test_format.py."""
from __future__ import annotations

import copy
import os
import pickle
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import samoyeds as sm
from samoyeds import _array
from samoyeds.moe import moe_forward

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import run_python  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict:
    """The environment of a fresh interpreter that imports the samoyeds these tests import."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(sm.__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def _moe_case(seed: int, T: int = 6, E: int = 4, H: int = 64, I: int = 64, K: int = 2):
    gen = torch.Generator().manual_seed(seed)
    gu = sm.pack(torch.randn(E, 2 * I, H, generator=gen), "samoyeds-1:2:64", glu=True)
    dn = sm.pack(torch.randn(E, H, I, generator=gen), "samoyeds-1:2:64")
    x = torch.randn(T, H, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen) + 0.1
    return x, idx, w, gu, dn


# ---- the README's snippets -------------------------------------------------------------------------

def _readme_snippets() -> list:
    text = open(os.path.join(ROOT, "README.md")).read()
    return re.findall(r"```python\n(.*?)```", text, re.S)


@pytest.mark.parametrize("i", range(len(_readme_snippets())))
def test_readme_snippet_runs_as_written(i, tmp_path):
    """Every ```python block of the README runs verbatim here (CPU or GPU), from a folder
    that is not the source tree."""
    code = _readme_snippets()[i]
    if "transformers" in code:
        pytest.importorskip("transformers")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "a snippet shows its result"


# ---- dtype messages: one vocabulary, the argument's own list ---------------------------------------

@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.int16, torch.uint8])
def test_pack_names_only_the_dtypes_it_packs(dtype):
    w = (torch.rand(64, 64) * 4).to(dtype)
    with pytest.raises(TypeError) as e:
        sm.pack(w)
    name = str(dtype).replace("torch.", "")
    assert re.fullmatch(rf"w: expected dtype float32, float16 or bfloat16, got ({name}|an unsupported one "
                        rf"\({name}\))", str(e.value)), e.value
    # the same words as the extension's own check (mask given: no Python check before it)
    if dtype in (torch.float64, torch.int32):
        with pytest.raises(TypeError, match=rf"^w: expected dtype float32, float16 or bfloat16, got {name}$"):
            sm.pack(w, mask=torch.ones(64, 64, dtype=torch.bool))


@pytest.mark.parametrize("dtype,name", [(torch.int16, "int16"), (torch.int8, "int8"), (torch.uint64, "uint64"),
                                        (torch.complex64, "complex64"), (torch.float32, None),
                                        (torch.bfloat16, None)])
def test_ids_of_a_wrong_dtype_are_offered_int_dtypes_only(dtype, name):
    x, idx, w, gu, dn = _moe_case(1)
    bad = idx.to(dtype)
    want = name and rf"an unsupported one \({name}\)" or str(dtype).replace("torch.", "")
    for call in (lambda: moe_forward(x, bad, w, gu, dn), lambda: sm.route(bad, 4)):
        with pytest.raises(TypeError, match=rf"^top_k_index: expected dtype int32 or int64, got {want}$"):
            call()


def test_activations_of_a_wrong_dtype_are_named_against_the_weights():
    x, idx, w, gu, dn = _moe_case(2)
    with pytest.raises(TypeError, match=r"^x: expected dtype float32 \(that of gate_up_values\), got float64$"):
        moe_forward(x.double(), idx, w, gu, dn)
    with pytest.raises(TypeError, match=r"^x: expected dtype float32, got an unsupported one \(int16\)$"):
        moe_forward(x.to(torch.int16), idx, w, gu, dn)


# ---- layout: the hint, and the shape first -------------------------------------------------------

def test_every_layout_error_says_call_contiguous():
    x, idx, w, gu, dn = _moe_case(3)
    T, K = idx.shape
    cases = {
        "x": lambda: moe_forward(x.t().contiguous().t(), idx, w, gu, dn),
        "top_k_index": lambda: moe_forward(x, idx.t().contiguous().t(), w, gu, dn),
        "top_k_weights": lambda: moe_forward(x, idx, w.t().contiguous().t(), gu, dn),
        "y": lambda: sm.combine(torch.randn(4, T * K).t(), sm.route(idx, 4).pos),
        "values": lambda: sm.unpack(sm.PackedWeight(gu.values.transpose(1, 2).contiguous().transpose(1, 2),
                                                    gu.meta, gu.idx, gu.fmt, gu.shape, gu.glu)),
    }
    for name, call in cases.items():
        with pytest.raises(ValueError, match=rf"^{name}: expected .*\(call \.contiguous\(\) first\)$"):
            call()


@pytest.mark.gpu
def test_gpu_layout_errors_say_what_fixes_them():
    x, idx, w, gu, dn = _moe_case(11)
    x, idx, w, gu, dn = x.cuda().bfloat16(), idx.cuda(), w.cuda(), gu.to("cuda"), dn.to("cuda")
    gu = sm.PackedWeight(gu.values.bfloat16(), gu.meta, gu.idx, gu.fmt, gu.shape, gu.glu)
    dn = sm.PackedWeight(dn.values.bfloat16(), dn.meta, dn.idx, dn.fmt, dn.shape, dn.glu)
    T, H = x.shape
    wide = torch.zeros(T, H + 2, dtype=x.dtype, device="cuda")
    wide[:, :H] = x
    with pytest.raises(ValueError, match=r"^x: expected a row stride that is a multiple of 8 elements on the GPU, "
                                         r"got 66 \(call \.contiguous\(\) first\)$"):
        moe_forward(wide[:, :H], idx, w, gu, dn)
    flat = torch.zeros(T * H + 1, dtype=x.dtype, device="cuda")
    with pytest.raises(ValueError, match=r"^x: expected a 16-byte aligned address on the GPU, got .* \(a fresh "
                                         r"tensor is: call \.clone\(\) first\)$"):
        moe_forward(flat[1:].view(T, H), idx, w, gu, dn)


def test_a_column_slice_of_the_weights_reports_k_not_contiguity():
    """A [T, 1] slice of top_k_weights: the count is wrong before the layout is."""
    x, idx, w, gu, dn = _moe_case(4)
    T, K = idx.shape
    wide = torch.rand(T, K + 3)
    with pytest.raises(ValueError, match=rf"^top_k_weights: expected {T * K} entries \(top_k_index's T\*K\), "
                                         rf"got shape \({T}, 1\)$"):
        moe_forward(x, idx, wide[:, :1], gu, dn)


# ---- device errors in samoyeds' words -----------------------------------------------------------------

def test_a_meta_tensor_gets_a_samoyeds_message_with_the_cause():
    x, idx, w, gu, dn = _moe_case(5)
    calls = {
        "x": lambda: moe_forward(x.to("meta"), idx, w, gu, dn),
        "top_k_weights": lambda: moe_forward(x, idx, w.to("meta"), gu, dn),
        "w": lambda: sm.pack(torch.randn(64, 64, device="meta")),
        "top_k_index": lambda: sm.route(idx.to("meta"), 4),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value).startswith(f"{name}: expected a tensor that exports through DLPack (on the CPU or "
                                       "a CUDA device), got one whose export failed: "), e.value
        assert "meta" in str(e.value) and e.value.__cause__ is not None


# ---- expert ids ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [-1, 5, 2**40])
def test_check_ids_raises_on_ids_outside_the_experts(bad):
    x, idx, w, gu, dn = _moe_case(6)
    E = 4
    idx[2, 1] = bad
    want = moe_forward(x, idx, w, gu, dn)          # default: a placeholder, silently (no host sync)
    assert torch.isfinite(want).all()
    with pytest.raises(ValueError, match=rf"^top_k_index: expected expert ids in \[0, {E}\) or the placeholder "
                                         rf"{E} \(check_ids=True\), got 1 outside, ids from {min(bad, 0)} to "
                                         rf"{max(bad, 3)}$"):
        moe_forward(x, idx, w, gu, dn, check_ids=True)


@pytest.mark.gpu
def test_check_ids_on_the_gpu():
    x, idx, w, gu, dn = _moe_case(12, H=64, I=64)
    gu = sm.PackedWeight(gu.values.bfloat16(), gu.meta, gu.idx, gu.fmt, gu.shape, gu.glu).to("cuda")
    dn = sm.PackedWeight(dn.values.bfloat16(), dn.meta, dn.idx, dn.fmt, dn.shape, dn.glu).to("cuda")
    x, idx, w = x.cuda().bfloat16(), idx.cuda(), w.cuda()
    idx[0, 0] = 4                                   # the placeholder: fine
    moe_forward(x, idx, w, gu, dn, check_ids=True)
    idx[0, 1] = -1
    moe_forward(x, idx, w, gu, dn)                  # default: no check, no sync
    with pytest.raises(ValueError, match=r"^top_k_index: expected expert ids in \[0, 4\) or the placeholder 4"):
        moe_forward(x, idx, w, gu, dn, check_ids=True)


def test_check_ids_accepts_the_placeholder():
    x, idx, w, gu, dn = _moe_case(7)
    E = 4
    idx[1, 0] = E
    got = moe_forward(x, idx, w, gu, dn, check_ids=True)
    w0 = w.clone()
    w0[1, 0] = 0
    idx0 = idx.clone()
    idx0[1, 0] = 0
    torch.testing.assert_close(got, moe_forward(x, idx0, w0, gu, dn), rtol=1e-5, atol=1e-5)


def test_check_ids_is_off_by_default_and_documented():
    import inspect
    sig = inspect.signature(moe_forward)
    assert sig.parameters["check_ids"].default is False
    assert "check_ids" in moe_forward.__doc__ and "placeholder" in moe_forward.__doc__


def test_hf_experts_keep_placeholders():
    """The Hugging Face path never checks ids: expert parallelism writes E for the experts
    of other ranks, and those pairs add nothing."""
    pytest.importorskip("transformers")
    from samoyeds.hf.families import Shape, build_model

    model = build_model("qwen3_moe", Shape(vocab=64, hidden=64, layers=1, experts=4, top_k=2, intermediate=32,
                                           heads=2, kv_heads=1, head_dim=32), seed=3)
    sm.patch_model(model, "samoyeds-1:2:64", progress=False)
    (mod,) = [m for m in model.modules() if getattr(m, "_samoyeds", None) is not None]
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(5, 64, generator=gen)
    idx = torch.tensor([[0, 4], [1, 2], [4, 4], [3, 0], [2, 1]])
    w = torch.rand(5, 2, generator=gen)
    with torch.no_grad():
        got = mod(x, idx, w)
        keep = idx < 4
        want = mod(x, torch.where(keep, idx, 0), torch.where(keep, w, 0))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- autograd: no warning, a gradient -----------------------------------------------------------------------

@pytest.fixture
def fresh_warning(monkeypatch):
    monkeypatch.setattr(_array, "_warned_no_backward", False)


def test_moe_forward_with_an_input_that_requires_grad_gives_a_gradient(fresh_warning):
    x, idx, w, gu, dn = _moe_case(9)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.no_grad():
            assert not moe_forward(x.requires_grad_(), idx, w, gu, dn).requires_grad
        y = moe_forward(x, idx, w, gu, dn)
        y.sum().backward()
    assert not seen, [str(s.message) for s in seen]
    assert y.requires_grad and x.grad is not None and x.grad.shape == x.shape


def test_a_low_level_op_warns_once_that_it_has_no_backward(fresh_warning):
    gate, up = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8)
    with pytest.warns(UserWarning, match=r"this low-level op has no backward.*moe_forward") as seen:
        out = sm.glu(gate, up)
        sm.glu(gate, up)
    assert len([w for w in seen if "no backward" in str(w.message)]) == 1
    assert not out.requires_grad


def test_the_torch_op_backward_gives_gradients(fresh_warning):
    from samoyeds.torch_ops import moe_forward_packed

    x, idx, w, gu, dn = _moe_case(10)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not moe_forward_packed(x, idx, w, gu, dn).requires_grad   # nothing requires grad
        y = moe_forward_packed(x.requires_grad_(), idx, w.requires_grad_(), gu, dn)
        y.sum().backward()
    assert not seen, [str(s.message) for s in seen]
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


# ---- reprs --------------------------------------------------------------------------------------------------

def test_packed_weight_repr_says_padded_to_tiles_only_when_padded():
    small = sm.pack(torch.randn(8, 8))
    r = repr(small)
    assert "padded to tiles from 72 B" in r and "of dense 256 B" in r, r
    big = sm.pack(torch.randn(2, 512, 512, dtype=torch.bfloat16))
    r = repr(big)
    assert "padded" not in r and big.nbytes == big.logical_nbytes, r
    assert re.search(r", \d+\.\d (KiB|MiB) = 28\.\d% of dense 1\.0 MiB\)$", r), r


def test_routing_repr_summarises_the_tensors():
    idx = torch.randint(0, 16, (1000, 4))
    r = repr(sm.route(idx, 16))
    assert r == ("Routing(num_experts=16, offsets=int32[17] cpu, token_ids=int32[4000] cpu, perm=int32[4000] cpu, "
                 "pos=int32[1000, 4] cpu)"), r


# ---- pickling -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["samoyeds-1:2:64", "2:4"])
def test_packed_weight_pickles_and_copies(fmt):
    pw = sm.pack(torch.randn(3, 64, 128, dtype=torch.bfloat16), fmt, glu=True)
    for back in (pickle.loads(pickle.dumps(pw)), copy.deepcopy(pw)):
        assert back.meta.dtype == torch.uint32 and back.fmt == pw.fmt and back.glu and back.shape == pw.shape
        assert torch.equal(sm.unpack(back), sm.unpack(pw))
    a = sm.pack(np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32), fmt)
    back = pickle.loads(pickle.dumps(a))
    assert back.meta.dtype == np.uint32 and np.array_equal(sm.unpack(back), sm.unpack(a))


@pytest.mark.parametrize("shared", [False, True])
def test_a_patched_model_pickles(shared, tmp_path):
    pytest.importorskip("transformers")
    from samoyeds.hf.families import Shape, build_model

    family = "deepseek_v2" if shared else "qwen3_moe"   # packed shared experts: a SamoyedsMLP
    model = build_model(family, Shape(vocab=64, hidden=64, layers=1, experts=4, top_k=2, intermediate=32,
                                      heads=2, kv_heads=1, head_dim=32), seed=4)
    sm.patch_model(model, "samoyeds-1:2:64", progress=False, shared_experts=shared)
    ids = torch.randint(3, 64, (1, 6))
    with torch.no_grad():
        want = model(ids).logits
        back = pickle.loads(pickle.dumps(model))
        assert torch.equal(back(ids).logits, want)
        again = copy.deepcopy(back)
        assert torch.equal(again(ids).logits, want)
    for m in (model, back, again):
        metas = [b for n, b in m.named_buffers() if n.endswith("_meta")]
        assert len(metas) >= 2 and all(b.dtype == torch.uint32 for b in metas)
    assert sm.is_patched(back) and sm.is_patched(again)
    # a fresh process unpickles it (the classes and the uint32 metadata found again)
    path = tmp_path / "model.pkl"
    path.write_bytes(pickle.dumps(model))
    code = ("import pickle, sys, torch, samoyeds; m = pickle.loads(open(sys.argv[1], 'rb').read()); "
            "print(samoyeds.is_patched(m), m(torch.tensor([[5, 6, 7]])).logits.shape)")
    proc = run_python(["-c", code, str(path)])
    assert proc.returncode == 0 and proc.stdout.split()[0] == "True", proc.stderr[-2000:]


# ---- notebooks' temporary folders ---------------------------------------------------------------------

def test_notebook_temp_folders_go_at_exit(tmp_path):
    """benchmarks/nbutil.py's temporary folders (re-runs, figures not asked for) are
    removed when the interpreter exits, and none is made in the system temp folder."""
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import nbutil\n"
            "d = nbutil.temp_dir(); open(d + '/x.json', 'w').write('{}'); print(d)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(_env(), TMPDIR=str(tmp_path)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    made = done.stdout.strip()
    assert made.startswith(str(tmp_path)) and os.path.basename(made).startswith("samoyeds-nb-")
    assert not os.path.exists(made) and not os.listdir(tmp_path)
