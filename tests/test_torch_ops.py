"""torch.ops.samoyeds.moe_forward: same result as samoyeds.moe.moe_forward and a
float64 oracle, passes torch.library.opcheck, and compiles with fullgraph=True."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import samoyeds as sm
from samoyeds.moe import moe_forward
from samoyeds.torch_ops import act_id, moe_forward_packed

from helpers import oracle_moe, random_topk, rel_err


def _case(T, H, I, E, K, fmt, act, dtype, pattern="uniform", bias=False, seed=None):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31 if seed is None else seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(dtype)
    idx = random_topk(T, K, E, pattern, gen)
    w = torch.rand(T, K, generator=gen)
    gu, dn = sm.pack(gate_up, fmt, glu=True), sm.pack(down, fmt)
    kw = dict(act=act)
    if bias:
        kw["gate_up_bias"] = torch.randn(E, 2 * I, generator=gen).to(dtype)
        kw["down_bias"] = torch.randn(E, H, generator=gen).to(dtype)
    return x, idx, w, gu, dn, kw


def _op_args(x, idx, w, gu, dn, act="swiglu", gate_up_bias=None, down_bias=None, alpha=1.702, limit=7.0):
    n, m, v = gu.fmt.c_args()
    return (x, idx, w, gu.values, gu.meta, gu.idx, gu.rows, gu.cols, dn.values, dn.meta, dn.idx, dn.rows, dn.cols,
            n, m, v, act_id(act), gate_up_bias, down_bias, alpha, limit)


CASES = [
    # T, H, I, E, K, fmt, act, bias, pattern
    (37, 128, 64, 8, 2, "samoyeds-1:2:128", "swiglu", False, "uniform"),
    (20, 256, 96, 4, 3, "samoyeds-1:2:64", "gptoss", True, "placeholder"),
    (16, 64, 32, 6, 2, "2:4", "swiglu", False, "skewed"),
    (0, 64, 32, 4, 2, "samoyeds-1:2:128", "swiglu", False, "uniform"),
]


@pytest.mark.parametrize("T,H,I,E,K,fmt,act,bias,pattern", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_matches_moe_forward_and_oracle(T, H, I, E, K, fmt, act, bias, pattern, dtype):
    x, idx, w, gu, dn, kw = _case(T, H, I, E, K, fmt, act, dtype, pattern, bias)
    got = torch.ops.samoyeds.moe_forward(*_op_args(x, idx, w, gu, dn, **kw))
    assert got.shape == (T, H) and got.dtype == dtype
    assert torch.equal(got, moe_forward(x, idx, w, gu, dn, **kw))
    assert torch.equal(moe_forward_packed(x, idx, w, gu, dn, **kw), got)
    if T:
        ref = oracle_moe(x, idx, w, gu, dn, **kw)
        # fp32: accumulation-order noise only; bf16: the output rounding (2^-8) dominates
        assert rel_err(got, ref) < (1e-6 if dtype == torch.float32 else 8e-3)


def test_op_validates_arguments():
    x, idx, w, gu, dn, kw = _case(8, 64, 32, 4, 2, "samoyeds-1:2:128", "swiglu", torch.float32, seed=1)
    with pytest.raises(ValueError, match="act"):
        moe_forward_packed(x, idx, w, gu, dn, act="gelu")
    with pytest.raises(ValueError, match="glu"):
        moe_forward_packed(x, idx, w, dn, dn)
    other = sm.pack(torch.randn(4, 64, 32), "2:4")
    with pytest.raises(ValueError, match="format"):
        moe_forward_packed(x, idx, w, gu, other)


@pytest.mark.parametrize("case", [0, 1, 2])
def test_opcheck(case):
    T, H, I, E, K, fmt, act, bias, pattern = CASES[case]
    x, idx, w, gu, dn, kw = _case(T, H, I, E, K, fmt, act, torch.float32, pattern, bias, seed=case)
    torch.library.opcheck(torch.ops.samoyeds.moe_forward.default, _op_args(x, idx, w, gu, dn, **kw))


def test_compile_fullgraph_default_backend():
    x, idx, w, gu, dn, kw = _case(24, 128, 64, 8, 2, "samoyeds-1:2:128", "swiglu", torch.float32, seed=7)

    def block(x, idx, w):
        h = F.rms_norm(x, (x.shape[-1],))
        return x + moe_forward_packed(h, idx, w, gu, dn) * 0.5

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    assert torch.allclose(compiled(x, idx, w), block(x, idx, w), rtol=1e-5, atol=1e-6)
    # another token count reuses or recompiles the graph, never breaks it
    x2, idx2, w2 = x[:5].clone(), idx[:5].clone(), w[:5].clone()
    assert torch.allclose(compiled(x2, idx2, w2), block(x2, idx2, w2), rtol=1e-5, atol=1e-6)


def test_fake_tensor_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, idx, w, gu, dn, kw = _case(9, 64, 32, 4, 2, "samoyeds-1:2:128", "swiglu", torch.bfloat16, seed=3)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx = mode.from_tensor(x)
        out = torch.ops.samoyeds.moe_forward(*_op_args(fx, idx, w, gu, dn))
    assert out.shape == (9, 64) and out.dtype == torch.bfloat16


def test_backward_gives_the_gradient_of_x():
    """(tests/test_train.py checks every gradient against a dense oracle.)"""
    x, idx, w, gu, dn, kw = _case(4, 64, 32, 4, 2, "samoyeds-1:2:128", "swiglu", torch.float32, seed=4)
    x.requires_grad_(True)
    y = moe_forward_packed(x, idx, w, gu, dn)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape and bool(torch.isfinite(x.grad).all())


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,I,E,K,fmt,act,bias,pattern", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_gpu(T, H, I, E, K, fmt, act, bias, pattern, dtype):
    x, idx, w, gu, dn, kw = _case(T, H, I, E, K, fmt, act, dtype, pattern, bias)
    cu = {k: v.cuda() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    cu["act"] = act
    got = moe_forward_packed(x.cuda(), idx.cuda(), w.cuda(), gu.to("cuda"), dn.to("cuda"), **cu)
    assert torch.equal(got, moe_forward(x.cuda(), idx.cuda(), w.cuda(), gu.to("cuda"), dn.to("cuda"), **cu))
    if T:
        ref = oracle_moe(x, idx, w, gu, dn, **kw)
        plain = rel_err(moe_forward(x, idx, w, gu, dn, **kw), ref)   # the C reference, same precision
        assert rel_err(got, ref) <= 2 * plain + 1e-6


@pytest.mark.gpu
def test_compile_fullgraph_gpu():
    x, idx, w, gu, dn, kw = _case(300, 256, 128, 8, 2, "samoyeds-1:2:128", "swiglu", torch.bfloat16, seed=5)
    x, idx, w, gu, dn = x.cuda(), idx.cuda(), w.cuda(), gu.to("cuda"), dn.to("cuda")

    def block(x, idx, w):
        return x + moe_forward_packed(F.rms_norm(x, (x.shape[-1],)), idx, w, gu, dn)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    assert torch.allclose(compiled(x, idx, w), block(x, idx, w), rtol=1e-2, atol=1e-2)
