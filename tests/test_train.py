"""Training through samoyeds' own backward (docs/TRAINING.md): the gradients of
``moe_forward`` against float64 autograd on the masked dense model, ``ssmm_dw`` against a
torch oracle, ``PackedWeight.transposed``, torch.compile, an optimizer on packed values.

CPU (the C reference) unless marked gpu; small shapes, the whole file in seconds.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import samoyeds as sm
from samoyeds.ops import ssmm_dw
from samoyeds.torch_ops import moe_forward_packed

# ---- the oracle: the masked dense model in float64 torch autograd ------------------------------------------


def dense_moe(x, ids, w, Wgu, Wdn, gub, dnb, act, alpha=1.702, limit=7.0):
    """sum_k w[t,k] * (act(x[t] @ Wgu_e^T + b) @ Wdn_e^T + b), ids outside [0, E) skipped."""
    E, I2, H = Wgu.shape
    I = I2 // 2
    out = torch.zeros(x.shape[0], H, dtype=x.dtype)
    for e in range(E):
        t, k = torch.nonzero(ids == e, as_tuple=True)
        if t.numel() == 0:
            continue
        p = x[t] @ Wgu[e].T + (gub[e] if gub is not None else 0)
        g, u = p[:, :I], p[:, I:]
        if act == "swiglu":
            h = F.silu(g) * u
        else:
            g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
            h = (u + 1) * g * torch.sigmoid(alpha * g)
        y = h @ Wdn[e].T + (dnb[e] if dnb is not None else 0)
        out = out.index_add(0, t, w[t, k, None] * y)
    return out


def slot_grad(dense: torch.Tensor, pw: sm.PackedWeight) -> torch.Tensor:
    """A dense [E, R, C] gradient at the value slots of pw, in its packed layout (float32)."""
    idx = None if pw.idx is None else pw.idx.cpu()
    ones = sm.PackedWeight(torch.ones(pw.values.shape), pw.meta.cpu(), idx, pw.fmt, pw.shape3, pw.glu)
    return sm.pack(dense.float().cpu(), pw.fmt, mask=sm.unpack(ones) != 0, glu=pw.glu).values


def make_case(T, K, E, H, I, fmt, dtype, bias, seed, ids=None, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    if ids is None:
        ids = torch.randint(-1, E + 2, (T, K), generator=gen)   # -1, E, E+1: placeholders
        ids[:, 0] = torch.randint(0, max(1, E - 1), (T,), generator=gen)  # expert E-1 often empty
    w = torch.rand(T, K, generator=gen)
    gu = sm.pack((torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).to(dtype), fmt, glu=True)
    dn = sm.pack((torch.randn(E, H, I, generator=gen) / I ** 0.5).to(dtype), fmt)
    gub = torch.randn(E, 2 * I, generator=gen).to(dtype) if bias else None
    dnb = torch.randn(E, H, generator=gen).to(dtype) if bias else None
    if device != "cpu":
        x, ids, w = x.to(device), ids.to(device), w.to(device)
        gu, dn = gu.to(device), dn.to(device)
        gub = gub.to(device) if bias else None
        dnb = dnb.to(device) if bias else None
    return x, ids, w, gu, dn, gub, dnb


def samoyeds_grads(x, ids, w, gu, dn, gub, dnb, act, go, alpha=1.702, limit=7.0, via="moe_forward"):
    """(out, {name: grad}) of samoyeds with every input a leaf requiring grad."""
    gu = sm.PackedWeight(torch.nn.Parameter(gu.values.clone()), gu.meta, gu.idx, gu.fmt, gu.shape, gu.glu)
    dn = sm.PackedWeight(torch.nn.Parameter(dn.values.clone()), dn.meta, dn.idx, dn.fmt, dn.shape, dn.glu)
    leaves = {"x": x.clone().requires_grad_(), "w": w.clone().requires_grad_(), "gu": gu.values, "dn": dn.values}
    if gub is not None:
        leaves["gub"] = gub.clone().requires_grad_()
        leaves["dnb"] = dnb.clone().requires_grad_()
    kw = dict(act=act, gate_up_bias=leaves.get("gub"), down_bias=leaves.get("dnb"), alpha=alpha, limit=limit)
    if via == "moe_forward":
        out = sm.moe_forward(leaves["x"], ids, leaves["w"], gu, dn, **kw)
    elif via == "no_preact":
        out = sm.moe_forward(leaves["x"], ids, leaves["w"], gu, dn, save_preact=False, **kw)
    elif via == "config":
        with sm.config(save_preact=False):
            out = sm.moe_forward(leaves["x"], ids, leaves["w"], gu, dn, **kw)
    elif via == "op_train":   # the training op itself (what torch.compile runs)
        n, m, v = gu.fmt.c_args()
        out = torch.ops.samoyeds.moe_forward_train(
            leaves["x"], ids, leaves["w"], gu.values, gu.meta, gu.idx, gu.rows, gu.cols, dn.values, dn.meta,
            dn.idx, dn.rows, dn.cols, n, m, v, sm.torch_ops.act_id(act), kw["gate_up_bias"], kw["down_bias"],
            alpha, limit)[0]
    else:   # the op itself: no saved pre-activation, the backward recomputes it
        n, m, v = gu.fmt.c_args()
        out = torch.ops.samoyeds.moe_forward(
            leaves["x"], ids, leaves["w"], gu.values, gu.meta, gu.idx, gu.rows, gu.cols, dn.values, dn.meta,
            dn.idx, dn.rows, dn.cols, n, m, v, sm.torch_ops.act_id(act), kw["gate_up_bias"], kw["down_bias"],
            alpha, limit)
    out.backward(go)
    return out, {k: t.grad for k, t in leaves.items()}


def oracle_grads(x, ids, w, gu, dn, gub, dnb, act, go, alpha=1.702, limit=7.0):
    d = lambda t: None if t is None else t.detach().double().cpu().requires_grad_()  # noqa: E731
    leaves = {"x": d(x), "w": d(w), "gu": d(sm.unpack(gu)), "dn": d(sm.unpack(dn))}
    if gub is not None:
        leaves["gub"], leaves["dnb"] = d(gub), d(dnb)
    out = dense_moe(leaves["x"], ids.cpu(), leaves["w"], leaves["gu"], leaves["dn"], leaves.get("gub"),
                    leaves.get("dnb"), act, alpha, limit)
    out.backward(go.double().cpu())
    g = {k: t.grad for k, t in leaves.items()}
    g["gu"], g["dn"] = slot_grad(g["gu"], gu), slot_grad(g["dn"], dn)
    return out, g


def assert_near(got, want, tol, name):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert bool(torch.isfinite(got).all()), name
    scale = want.abs().max().item() + 1e-12
    err = (got - want).abs().max().item()
    assert err <= tol * scale, f"{name}: max error {err:.3g} against a max of {scale:.3g} (tol {tol})"


# ---- moe_forward's gradients against the oracle ----------------------------------------------------------

GRAD_CASES = [  # fmt, act, bias, dtype
    ("samoyeds-1:2:128", "swiglu", False, torch.float32),
    ("samoyeds-1:2:128", "gptoss", True, torch.float32),
    ("samoyeds-1:4:64", "swiglu", True, torch.float32),
    ("samoyeds-1:4:64", "gptoss", False, torch.float32),
    ("2:4", "swiglu", True, torch.float32),            # no 2:4 transpose: the masked dense fallback
    ("2:4", "gptoss", True, torch.float32),
    ("samoyeds-2:3:64", "swiglu", True, torch.float32),  # n/m > 1/2: fallback too
    ("samoyeds-1:2:128", "swiglu", True, torch.bfloat16),
    ("samoyeds-1:4:64", "gptoss", True, torch.bfloat16),
    ("2:4", "swiglu", False, torch.bfloat16),
]


@pytest.mark.parametrize("fmt,act,bias,dtype", GRAD_CASES)
def test_gradients_match_the_masked_dense_model(fmt, act, bias, dtype):
    I = 24 if "2:3" in fmt else 20
    x, ids, w, gu, dn, gub, dnb = make_case(7, 3, 5, 72, I, fmt, dtype, bias, seed=len(fmt) + 7 * bias)
    # a small limit so that GPT-OSS's clamps cut some pre-activations
    alpha, limit = (1.3, 0.8) if act == "gptoss" else (1.702, 7.0)
    go = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out, got = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, act, go, alpha, limit)
    ref, want = oracle_grads(x, ids, w, gu, dn, gub, dnb, act, go, alpha, limit)
    tol = 2e-5 if dtype == torch.float32 else 4e-2
    assert_near(out, ref, tol, "out")
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == {"x": x, "w": w, "gu": gu.values, "dn": dn.values,
                                "gub": gub, "dnb": dnb}[k].dtype, k
        assert_near(got[k], want[k], tol, k)


def test_the_op_recomputes_the_pre_activation_to_the_same_gradients():
    x, ids, w, gu, dn, gub, dnb = make_case(9, 2, 4, 64, 32, "samoyeds-1:2:64", torch.float32, True, seed=3)
    go = torch.randn(x.shape)
    _, a = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, "swiglu", go)
    _, b = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, "swiglu", go, via="op")
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("act,bias", [("swiglu", True), ("gptoss", False)])
def test_eager_autograd_equals_the_ops_formula(act, bias):
    """Eager mode runs the ops' autograd formula without the dispatcher
    (torch_ops._MoeFunction): the same output and gradients, bit for bit, as the training
    op and the plain op (which recomputes the pre-activation)."""
    x, ids, w, gu, dn, gub, dnb = make_case(11, 3, 5, 64, 32, "samoyeds-1:2:64", torch.float32, bias, seed=13)
    go = torch.randn(x.shape)
    out, a = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, act, go)
    out_op, b = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, act, go, via="op_train")
    out_nop, c = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, act, go, via="no_preact")
    out_op2, d = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, act, go, via="op")
    assert torch.equal(out, out_op) and torch.equal(out_nop, out_op2)
    for k in a:
        assert a[k] is not None and torch.equal(a[k], b[k]), k
        assert torch.equal(c[k], d[k]), k


def test_eager_autograd_steps_aside_for_modes_and_subclasses():
    """Under a dispatch mode, a torch-function mode or torch.compile the op runs (its
    dispatcher entry is what they intercept); in plain eager mode it does not.  Double
    backward through the eager formula raises instead of giving a wrong second gradient."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    x, ids, w, gu, dn, _, _ = make_case(5, 2, 3, 64, 16, "samoyeds-1:2:128", torch.float32, False, seed=14)
    calls = []

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(str(func))
            return func(*args, **(kwargs or {}))

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    xg = x.clone().requires_grad_()
    assert type(sm.moe_forward(xg, ids, w, gu, dn).grad_fn).__name__ == "_MoeFunctionBackward"
    assert sm.torch_ops._direct((xg,))
    with Seen():
        y = sm.moe_forward(xg, ids, w, gu, dn)
    assert any("samoyeds.moe_forward_train" in c for c in calls), calls
    assert type(y.grad_fn).__name__ != "_MoeFunctionBackward"
    with Passing():
        assert not sm.torch_ops._direct((xg,))

    class Sub(torch.Tensor):
        pass

    assert not sm.torch_ops._direct((xg, torch.ones(1).as_subclass(Sub)))
    y = sm.moe_forward(xg, ids, w, gu, dn)
    (g,) = torch.autograd.grad(y.square().sum(), xg, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


@pytest.mark.parametrize("via", ["no_preact", "config"])
def test_save_preact_false_recomputes_to_the_same_gradients(via):
    x, ids, w, gu, dn, gub, dnb = make_case(9, 2, 4, 64, 32, "samoyeds-1:2:64", torch.float32, True, seed=4)
    go = torch.randn(x.shape)
    _, a = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, "swiglu", go)
    _, b = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, "swiglu", go, via=via)
    assert sm.get_config().save_preact   # the scope ended
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("save_preact", [True, False, "gate"])
def test_save_preact_decides_what_the_forward_keeps(save_preact):
    """The autograd graph holds the [T*K, 2I] pre-activation only with save_preact=True, its
    [T*K, I] gate half with "gate"."""
    T, K, E, H, I = 9, 2, 4, 64, 32
    x, ids, w, gu, dn, _, _ = make_case(T, K, E, H, I, "samoyeds-1:2:64", torch.float32, False, seed=6)
    gu = sm.PackedWeight(torch.nn.Parameter(gu.values.clone()), gu.meta, gu.idx, gu.fmt, gu.shape, gu.glu)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = sm.moe_forward(x.requires_grad_(), ids, w, gu, dn, save_preact=save_preact)
    assert ((T * K, 2 * I) in shapes) == (save_preact is True), shapes
    assert ((T * K, I) in shapes) == (save_preact == "gate"), shapes
    out.sum().backward()
    assert gu.values.grad is not None and x.grad is not None


def test_save_preact_must_be_a_bool():
    x, ids, w, gu, dn, _, _ = make_case(3, 2, 2, 64, 32, "samoyeds-1:2:64", torch.float32, False, seed=2)
    with pytest.raises(TypeError, match=r"^save_preact: expected None, a bool or 'gate', got 'no'"):
        sm.moe_forward(x, ids, w, gu, dn, save_preact="no")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fmt,act,bias", [("samoyeds-1:2:64", "swiglu", True), ("samoyeds-1:4:64", "gptoss", False),
                                          ("2:4", "swiglu", True)])
def test_save_preact_gate_recomputes_the_up_half_to_the_same_gradients(device, fmt, act, bias):
    """save_preact="gate": the up half recomputed on PackedWeight.up_half (the same products,
    fp32 sums in the same order on the C reference: the same gradients to the bit on the CPU;
    on the GPU another kernel's order, within the oracle's tolerance), placeholders included."""
    E = 4
    ids = torch.randint(0, E + 1, (21, 2), generator=torch.Generator().manual_seed(8))   # E: a placeholder
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    x, ids, w, gu, dn, gub, dnb = make_case(21, 2, E, 128, 64, fmt, dt, bias, seed=8, ids=ids, device=device)
    go = torch.randn(x.shape, device=device).to(dt)
    _, a = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, act, go)
    with sm.config(save_preact="gate"):
        _, b = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, act, go)
    assert sm.get_config().save_preact is True
    for k in a:
        if device == "cpu":
            assert torch.equal(a[k], b[k]), k
        else:
            assert_near(b[k], a[k], 2e-2, k)


def test_backward_is_deterministic():
    x, ids, w, gu, dn, gub, dnb = make_case(16, 4, 4, 64, 32, "samoyeds-1:2:128", torch.bfloat16, True, seed=5)
    go = torch.randn(x.shape).bfloat16()
    _, a = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, "gptoss", go)
    _, b = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, "gptoss", go)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_placeholder_ids_and_empty_experts_contribute_nothing():
    E = 4
    ids = torch.tensor([[0, E], [-1, 0], [E + 5, E], [0, 0]])
    x, ids, w, gu, dn, gub, dnb = make_case(4, 2, E, 64, 16, "samoyeds-1:2:128", torch.float32, True, 11, ids=ids)
    go = torch.randn(x.shape)
    _, got = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, "swiglu", go)
    _, want = oracle_grads(x, ids, w, gu, dn, gub, dnb, "swiglu", go)
    placeholder = (ids < 0) | (ids >= E)
    assert torch.equal(got["w"][placeholder], torch.zeros(int(placeholder.sum())))
    assert torch.equal(got["x"][2], torch.zeros(64))                   # token 2 routed nowhere
    for name in ("gu", "dn"):
        assert not got[name][1:].any(), name                            # experts 1-3 hold no rows
    assert not got["gub"][1:].any() and not got["dnb"][1:].any()
    for k in want:
        assert_near(got[k], want[k], 2e-5, k)


@pytest.mark.parametrize("bias", [False, True])
def test_zero_tokens(bias):
    x, ids, w, gu, dn, gub, dnb = make_case(0, 2, 3, 64, 16, "samoyeds-1:2:128", torch.float32, bias, seed=2)
    out, got = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, "swiglu", torch.zeros(0, 64))
    assert out.shape == (0, 64) and got["x"].shape == (0, 64) and got["w"].shape == (0, 2)
    for k in ("gu", "dn") + (("gub", "dnb") if bias else ()):
        assert got[k] is not None and not got[k].any(), k


def test_only_the_gradients_asked_for_are_computed():
    """Frozen experts (LoRA elsewhere): only x requires grad; the weights get none."""
    x, ids, w, gu, dn, gub, dnb = make_case(6, 2, 4, 64, 16, "samoyeds-1:2:128", torch.float32, True, seed=4)
    xg = x.clone().requires_grad_()
    out = sm.moe_forward(xg, ids, w, gu, dn, gate_up_bias=gub, down_bias=dnb)
    out.square().sum().backward()
    _, want = oracle_grads(x, ids, w, gu, dn, gub, dnb, "swiglu", 2 * out.detach())
    assert_near(xg.grad, want["x"], 2e-5, "x")
    assert gu.values.grad is None and not gu.values.requires_grad


def test_finite_differences_in_fp32():
    """The C reference has no float64: central differences in fp32 for x, the routing
    weights and the biases (gradcheck), a directional derivative for both packed values."""
    x, ids, w, gu, dn, gub, dnb = make_case(3, 2, 3, 64, 16, "samoyeds-1:2:64", torch.float32, True, seed=6)
    ids = torch.tensor([[0, 2], [1, 3], [2, 0]])

    def f(x_, w_, gub_, dnb_, act="gptoss"):
        return sm.moe_forward(x_, ids, w_, gu, dn, act=act, gate_up_bias=gub_, down_bias=dnb_, limit=1.0)

    inputs = tuple(t.clone().requires_grad_() for t in (x, w, gub, dnb))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Input #", UserWarning)   # (not float64: known, hence the tolerances)
        assert torch.autograd.gradcheck(f, inputs, eps=2e-3, atol=2e-2, rtol=2e-2, fast_mode=True)

    gen = torch.Generator().manual_seed(0)
    go = torch.randn(3, 64, generator=gen)
    for which in ("gu", "dn"):   # (SwiGLU: smooth, no clamp kink inside the step)
        pw = gu if which == "gu" else dn
        base = pw.values.clone()
        pw.values = torch.nn.Parameter(base.clone())
        (f(x, w, gub, dnb, "swiglu") * go).sum().backward()
        analytic_dir = torch.randn(base.shape, generator=gen)
        analytic = (pw.values.grad * analytic_dir).sum().item()
        eps = 2e-3
        with torch.no_grad():
            pw.values = base + eps * analytic_dir
            plus = (f(x, w, gub, dnb, "swiglu") * go).sum().item()
            pw.values = base - eps * analytic_dir
            minus = (f(x, w, gub, dnb, "swiglu") * go).sum().item()
        pw.values = base
        numeric = (plus - minus) / (2 * eps)
        assert abs(numeric - analytic) <= 2e-3 * (abs(analytic) + 1), (which, numeric, analytic)


# ---- torch.compile, optimizers ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_backward_matches_eager(backend):
    x, ids, w, gu, dn, gub, dnb = make_case(6, 2, 4, 64, 32, "samoyeds-1:2:128", torch.float32, True, seed=8)
    gu.values = torch.nn.Parameter(gu.values)
    dn.values = torch.nn.Parameter(dn.values)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    params = (xg, wg, gu.values, dn.values)

    def loss(x_, w_):
        return moe_forward_packed(x_, ids, w_, gu, dn, act="gptoss", gate_up_bias=gub, down_bias=dnb).square().sum()

    def grads(fn):
        for p in params:
            p.grad = None
        fn(xg, wg).backward()
        return [p.grad.clone() for p in params]

    torch._dynamo.reset()
    want = grads(loss)
    got = grads(torch.compile(loss, backend=backend, fullgraph=True))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_opcheck_the_training_ops():
    x, ids, w, gu, dn, gub, dnb = make_case(5, 2, 3, 64, 16, "samoyeds-1:2:128", torch.float32, True, seed=9)
    n, m, v = gu.fmt.c_args()
    args = (x.requires_grad_(), ids, w, gu.values, gu.meta, gu.idx, gu.rows, gu.cols, dn.values, dn.meta, dn.idx,
            dn.rows, dn.cols, n, m, v, 1, gub, dnb, 1.702, 7.0)
    torch.library.opcheck(torch.ops.samoyeds.moe_forward_train.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    bargs = (torch.randn(5, 64), *[a.detach() if isinstance(a, torch.Tensor) else a for a in args], None, None,
             sm.torch_ops.NEED_X | sm.torch_ops.NEED_DOWN | sm.torch_ops.NEED_GATE_UP_BIAS)
    torch.library.opcheck(torch.ops.samoyeds.moe_backward.default, bargs, test_utils=("test_schema", "test_faketensor"))


def test_adamw_steps_packed_parameters_and_the_transposed_cache_follows():
    x, ids, w, gu, dn, _, _ = make_case(16, 2, 4, 64, 32, "samoyeds-1:2:128", torch.float32, False, seed=10)
    gu.values = torch.nn.Parameter(gu.values)
    dn.values = torch.nn.Parameter(dn.values)
    target = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW([gu.values, dn.values], lr=3e-2, weight_decay=0.0)
    before_gu, before_mask = gu.values.detach().clone(), sm.unpack(gu) != 0
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = (sm.moe_forward(x, ids, w, gu, dn) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert not torch.equal(gu.values.detach(), before_gu)
    # the mask is fixed: no value leaves its slot, padding stays 0
    assert not ((sm.unpack(gu) != 0) & ~before_mask).any()
    for pw in (gu, dn):
        assert torch.equal(sm.unpack(pw.transposed()), sm.unpack(pw).transpose(1, 2))


# ---- PackedWeight.transposed ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,glu,R,C", [("samoyeds-1:2:128", True, 40, 200), ("samoyeds-1:4:64", False, 12, 136),
                                         ("samoyeds-2:4:64", False, 8, 96), ("samoyeds-1:8:32", True, 16, 64)])
def test_transposed_is_the_2_4_packing_of_the_transpose(fmt, glu, R, C):
    pw = sm.pack(torch.randn(3, R, C, dtype=torch.bfloat16), fmt, glu=glu)
    assert pw.transposable
    t = pw.transposed()
    assert t.fmt == sm.SparseFormat.parse("2:4") and t.shape == (3, C, R) and not t.glu
    dense = sm.unpack(pw)
    assert torch.equal(sm.unpack(t), dense.transpose(1, 2))
    # exactly what pack makes of the transpose (no kept value is 0 here)
    assert torch.equal(t.values, sm.pack(dense.transpose(1, 2).contiguous(), "2:4").values)
    assert pw.transposed() is t                      # cached
    with torch.no_grad():
        pw.values.mul_(-3)                           # in place: _version moves
    assert pw.transposed() is t and torch.equal(sm.unpack(t), sm.unpack(pw).transpose(1, 2))
    pw.values = pw.values.float()                    # a new tensor of another dtype
    assert pw.transposed().values.dtype == torch.float32
    assert torch.equal(sm.unpack(pw.transposed()), sm.unpack(pw).transpose(1, 2))


@pytest.mark.parametrize("layout", ["transposed", "unglued"])
@pytest.mark.parametrize("fmt,R,C", [("samoyeds-1:2:128", 40, 200), ("samoyeds-1:4:64", 24, 136),
                                     ("samoyeds-1:2:64", 16, 64)])
def test_refreshed_cache_equals_a_fresh_build(layout, fmt, R, C):
    """After in-place updates of the values (padding entries of the packed layout included,
    which no place reads), the cached relayout (refreshed by a gather) equals one built
    anew from the updated weight: every place, padding places 0, the metadata too."""
    pw = sm.pack(torch.randn(3, R, C, dtype=torch.bfloat16), fmt, glu=True)
    get = (lambda p: p.transposed()) if layout == "transposed" else (lambda p: p.unglued())
    cached = get(pw)
    for step in range(2):
        with torch.no_grad():
            pw.values.copy_(torch.randn_like(pw.values))    # every entry, padding included
        assert get(pw) is cached
        fresh = get(sm.PackedWeight(pw.values.clone(), pw.meta.clone(), None if pw.idx is None else pw.idx.clone(),
                                    pw.fmt, pw.shape, pw.glu))
        assert fresh is not cached
        assert torch.equal(cached.values, fresh.values)
        assert torch.equal(cached.meta, fresh.meta)
        dense = sm.unpack(pw)
        assert torch.equal(sm.unpack(cached), dense.transpose(1, 2) if layout == "transposed" else dense)
        # the places no value of the weight reaches hold 0
        want = sm.pack(dense.transpose(1, 2).contiguous(), "2:4", mask=sm.unpack(cached) != 0) \
            if layout == "transposed" else None
        if want is not None:
            assert torch.equal(cached.values, want.values)


@pytest.mark.parametrize("fmt,R", [("2:4", 8), ("samoyeds-3:4:64", 8), ("samoyeds-1:2:64", 6)])
def test_transposed_refuses_formats_whose_transpose_is_not_2_4(fmt, R):
    pw = sm.pack(torch.randn(R, 64), fmt)
    assert not pw.transposable
    with pytest.raises(ValueError, match=r"^fmt: expected a format whose transpose is 2:4"):
        pw.transposed()


# ---- ssmm_dw ---------------------------------------------------------------------------------------------------

def ssmm_dw_oracle(dy, x, pw, offsets, token_ids, scale):
    E, R, C = pw.shape3
    g = torch.zeros(E, R, C, dtype=torch.float64)
    off = offsets.tolist()
    for e in range(E):
        rows = torch.arange(off[e], off[e + 1])
        xt = x[token_ids[rows].long()] if token_ids is not None else x[rows]
        d = dy[rows].double() * (scale[rows].double()[:, None] if scale is not None else 1)
        g[e] = d.T @ xt.double()
    return slot_grad(g, pw)


@pytest.mark.parametrize("fmt,glu,R,C", [("samoyeds-1:2:128", True, 16, 200), ("samoyeds-1:4:64", False, 12, 136),
                                         ("2:4", False, 20, 64), ("samoyeds-1:2:64", True, 136, 72)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gathered", [False, True])
def test_ssmm_dw_matches_a_torch_oracle_and_writes_every_entry(fmt, glu, R, C, dtype, gathered):
    gen = torch.Generator().manual_seed(R + C)
    E, T, K = 4, 9, 2
    pw = sm.pack(torch.randn(E, R, C, generator=gen).to(dtype), fmt, glu=glu)
    ids = torch.randint(0, E + 1, (T, K), generator=gen)
    ids[ids == 2] = 1                                 # expert 2: no rows
    r = sm.route(ids, E)
    S = T * K
    routed = int(r.offsets[-1])
    dy = torch.randn(S, R, generator=gen).to(dtype)
    dy[routed:] = float("nan")                        # rows past offsets[E] are never read
    scale = torch.rand(S, generator=gen) if gathered else None
    if gathered:
        x, tok = torch.randn(T, C, generator=gen).to(dtype), r.token_ids
    else:
        x, tok = torch.randn(S, C, generator=gen).to(dtype), None
    out = torch.full(pw.values.shape, float("nan"), dtype=dtype)
    assert ssmm_dw(dy, x, pw, r.offsets, tok, scale, out=out) is out
    assert not out.isnan().any(), "every entry written"
    want = ssmm_dw_oracle(dy, x, pw, r.offsets, tok, scale)
    torch.testing.assert_close(out.float(), want, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-5 if dtype == torch.float32 else 2e-2)
    assert not out[2].any()
    again = ssmm_dw(dy, x, pw, r.offsets, tok, scale)
    assert torch.equal(again, out)


def test_ssmm_dw_reads_x_and_dy_with_a_row_stride():
    pw = sm.pack(torch.randn(2, 16, 64), "samoyeds-1:2:64", glu=True)
    off = torch.tensor([0, 3, 5], dtype=torch.int32)
    big_x, big_dy = torch.randn(5, 80), torch.randn(5, 24)
    got = ssmm_dw(big_dy[:, :16], big_x[:, :64], pw, off)
    want = ssmm_dw(big_dy[:, :16].contiguous(), big_x[:, :64].contiguous(), pw, off)
    assert torch.equal(got, want)


def _dw_args(**over):
    pw = sm.pack(torch.randn(2, 16, 64), "samoyeds-1:2:64", glu=True)
    a = dict(out=torch.empty(pw.values.shape), dy=torch.randn(4, 16), x=torch.randn(3, 64), meta=pw.meta,
             idx=pw.idx, offsets=torch.tensor([0, 2, 4], dtype=torch.int32),
             token_ids=torch.tensor([0, 1, 2, 0], dtype=torch.int32), rows=16, cols=64, n=1, m=2, v=64, glu=True)
    a.update(over)
    return a


@pytest.mark.parametrize("over,exc,pattern", [
    (dict(dy=torch.randn(4, 16, dtype=torch.float64)), TypeError, r"^dy: expected dtype float32 \(that of x\)"),
    (dict(x=torch.randn(3, 64, dtype=torch.float64)), TypeError, r"^x: expected dtype"),
    (dict(out=torch.empty(2, 64, 16)), ValueError, r"^out: expected shape \(2, 128, 64\)"),
    (dict(out=torch.empty(2, 64, 64, dtype=torch.bfloat16)), TypeError, r"^out: expected dtype float32"),
    (dict(dy=torch.randn(4, 18)), ValueError, r"^dy: expected shape \(4, 16\)"),
    (dict(x=torch.randn(3, 60)), ValueError, r"^x: expected shape \(3, 64\)"),
    (dict(offsets=torch.tensor([0, 2, 4])), TypeError, r"^offsets: expected dtype int32"),
    (dict(offsets=torch.tensor([0, 2], dtype=torch.int32)), ValueError, r"^offsets: expected shape \(3,\)"),
    (dict(offsets=torch.tensor([0, 3, 2], dtype=torch.int32)), ValueError, r"^ssmm_dw: offsets: offsets\[2\]"),
    (dict(offsets=torch.tensor([0, 2, 5], dtype=torch.int32)), ValueError, r"^ssmm_dw: offsets: offsets\[E\] = 5"),
    (dict(token_ids=torch.tensor([0, 1, 3, 0], dtype=torch.int32)), ValueError, r"^ssmm_dw: token_ids: token_ids\[2\]"),
    (dict(token_ids=torch.tensor([0, 1, 2], dtype=torch.int32)), ValueError, r"^token_ids: expected shape \(4,\)"),
    (dict(scale=torch.ones(4, dtype=torch.float64)), TypeError, r"^scale: expected dtype float32"),
    (dict(idx=None), TypeError, r"^idx: expected a tensor \(the format selects rows"),
    (dict(rows=15), ValueError, r"^rows: expected an even row count"),
    (dict(rows=-1), ValueError, r"^rows: expected 0 <= rows < 2\*\*31"),
    (dict(cols=62), ValueError, r"^cols: expected a column count that is a multiple of 4"),
    (dict(v=48), ValueError, r"^v: expected a positive multiple of 32"),
    (dict(n=3), ValueError, r"^n, m: expected 1 <= n <= m"),
    (dict(out="nope"), TypeError, r"^out: "),
    (dict(impl=4), ValueError, r"^impl: expected 0 \(the rule\), 1 \(the mma.sync kernel\), 2 .* or 3 .*got 4"),
    (dict(impl=-1), ValueError, r"^impl: expected .*got -1"),
])
def test_ssmm_dw_names_the_bad_argument(over, exc, pattern):
    a = _dw_args(**over)
    with pytest.raises(exc, match=pattern):
        sm._C.ssmm_dw(**a)


def test_ssmm_dw_wrapper_names_a_bad_impl():
    p = sm.pack(torch.randn(2, 16, 64), "samoyeds-1:2:64")
    with pytest.raises(ValueError, match=r"^impl: expected one of 'auto', 'mma', 'gather', 'copy', got 'fast'"):
        ssmm_dw(torch.randn(4, 16), torch.randn(3, 64), p, torch.tensor([0, 2, 4], dtype=torch.int32),
                torch.tensor([0, 1, 2, 0], dtype=torch.int32), impl="fast")


def test_ssmm_dw_refuses_an_output_that_overlaps_an_input():
    a = _dw_args()
    n = 2 * 128 * 64
    big = torch.randn(n + 128)
    a["out"] = big[:n].view(2, 128, 64)
    a["x"] = big[n - 64:n + 128].view(3, 64)
    with pytest.raises(ValueError, match=r"^out: expected an output that shares no memory with x"):
        sm._C.ssmm_dw(**a)


def test_ssmm_dw_wrapper_names_a_bad_weight():
    with pytest.raises(TypeError, match=r"^w: expected a PackedWeight"):
        ssmm_dw(torch.randn(2, 4), torch.randn(2, 4), torch.randn(4, 4), torch.zeros(2, dtype=torch.int32))


def test_moe_forward_with_grad_refuses_out():
    x, ids, w, gu, dn, _, _ = make_case(3, 2, 2, 64, 16, "samoyeds-1:2:128", torch.float32, False, seed=1)
    with pytest.raises(ValueError, match=r"^out: expected None when an input requires grad"):
        sm.moe_forward(x.requires_grad_(), ids, w, gu, dn, out=torch.empty(3, 64))


# ---- ssmm_dx: dX from the forward's packing ---------------------------------------------------------------------

def ssmm_dx_oracle(dy, pw, offsets, token_ids, scale, S):
    """float64 [S, C]: (dy[tok(s)] @ W_e) * scale[s] for the routed rows, 0 elsewhere."""
    E, R, C = pw.shape3
    dense = sm.unpack(pw.to("cpu")).double().reshape(E, R, C)
    out = torch.zeros(S, C, dtype=torch.float64)
    off = offsets.cpu().tolist()
    for e in range(E):
        rows = torch.arange(off[e], off[e + 1])
        if rows.numel() == 0:
            continue
        src = dy[token_ids.cpu()[rows].long()] if token_ids is not None else dy[rows]
        y = src.double().cpu() @ dense[e]
        out[rows] = y * (scale.cpu()[rows].double()[:, None] if scale is not None else 1)
    return out


DX_SHAPES = [  # fmt, glu, R, C
    ("samoyeds-1:2:128", True, 40, 200), ("samoyeds-1:4:64", False, 12, 136), ("2:4", False, 20, 64),
    ("samoyeds-1:2:64", True, 136, 72), ("2:4", True, 36, 44), ("samoyeds-2:3:64", False, 18, 72),
]


@pytest.mark.parametrize("fmt,glu,R,C", DX_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gathered", [False, True])
def test_ssmm_dx_matches_a_float64_oracle(fmt, glu, R, C, dtype, gathered):
    from samoyeds.ops import ssmm_dx
    gen = torch.Generator().manual_seed(R + C)
    E, T, K = 4, 9, 2
    pw = sm.pack(torch.randn(E, R, C, generator=gen).to(dtype), fmt, glu=glu)
    ids = torch.randint(0, E + 1, (T, K), generator=gen)      # E: placeholders
    ids[ids == 2] = 1                                         # expert 2: no rows
    r = sm.route(ids, E)
    S, routed = T * K, int(r.offsets[-1])
    scale = torch.rand(S, generator=gen) if gathered else None
    if gathered:   # dout read through the token ids (the down projection's dX)
        dy, tok = torch.randn(T, R, generator=gen).to(dtype), r.token_ids
    else:          # the sorted rows themselves (gate_up's dX); rows past offsets[E] never read
        dy, tok = torch.randn(S, R, generator=gen).to(dtype), None
        dy[routed:] = float("nan")
    out = torch.full((S, C), float("nan"), dtype=dtype)
    assert ssmm_dx(dy, pw, r.offsets, tok, scale, out=out) is out
    assert not out.isnan().any(), "every entry written"
    assert not out[routed:].any(), "rows past offsets[E] written as 0"
    want = ssmm_dx_oracle(dy, pw, r.offsets, tok, scale, S)
    torch.testing.assert_close(out.double(), want, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-5 if dtype == torch.float32 else 3e-2)
    assert torch.equal(ssmm_dx(dy, pw, r.offsets, tok, scale), out)


@pytest.mark.parametrize("fmt,glu,R,C", [s for s in DX_SHAPES if sm.SparseFormat.parse(s[0]).m >= 2
                                         and 2 * sm.SparseFormat.parse(s[0]).n <= sm.SparseFormat.parse(s[0]).m])
def test_ssmm_dx_equals_the_transposed_path(fmt, glu, R, C):
    from samoyeds import torch_ops as to
    gen = torch.Generator().manual_seed(7)
    E, T, K = 3, 11, 2
    pw = sm.pack(torch.randn(E, R, C, generator=gen), fmt, glu=glu)
    assert pw.transposable
    r = sm.route(torch.randint(-1, E + 1, (T, K), generator=gen), E)
    dy, scale = torch.randn(T, R, generator=gen), torch.rand(T * K, generator=gen)
    got = to._matmul_w(dy, pw, r.offsets, r.token_ids, scale, T * K)
    want = to._matmul_w(dy, pw, r.offsets, r.token_ids, scale, T * K, path="transposed")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"^path: expected one of"):
        to._matmul_w(dy, pw, r.offsets, r.token_ids, scale, T * K, path="dense")


def test_ssmm_dx_zero_tokens_and_rows_no_expert_owns():
    from samoyeds.ops import ssmm_dx
    pw = sm.pack(torch.randn(2, 16, 64), "samoyeds-1:2:64", glu=True)
    out = ssmm_dx(torch.randn(0, 16), pw, torch.zeros(3, dtype=torch.int32))
    assert out.shape == (0, 64)
    # offsets[0] > 0 and offsets[E] < S: the rows outside are 0, the others the oracle's
    off = torch.tensor([1, 3, 4], dtype=torch.int32)
    dy = torch.randn(6, 16)
    got = ssmm_dx(dy, pw, off, out=torch.full((6, 64), float("nan")))
    assert not got[0].any() and not got[4:].any()
    torch.testing.assert_close(got.double(), ssmm_dx_oracle(dy, pw, off, None, None, 6), rtol=1e-5, atol=1e-5)


def test_moe_backward_takes_either_dx_path():
    from samoyeds import torch_ops as to
    x, ids, w, gu, dn, gub, dnb = make_case(13, 2, 4, 64, 24, "samoyeds-1:2:128", torch.float32, True, seed=4)
    go = torch.randn(x.shape)
    n, m, v = gu.fmt.c_args()
    args = (go, x, ids, w, gu.values, gu.meta, gu.idx, gu.rows, gu.cols, dn.values, dn.meta, dn.idx, dn.rows,
            dn.cols, n, m, v, to.act_id("swiglu"), gub, dnb, 1.702, 7.0)
    a = to.moe_backward_eager(*args, dx_path="ssmm_dx")
    b = to.moe_backward_eager(*args, dx_path="transposed")
    c = to.moe_backward_eager(*args)
    for ga, gb, gc in zip(a, b, c):
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-5)
        assert torch.equal(ga, gc)   # on the CPU the default is ssmm_dx
    with pytest.raises(ValueError, match="^path: expected one of"):
        to.moe_backward_eager(*args, dx_path="fast")


def _dx_args(**over):
    pw = sm.pack(torch.randn(2, 16, 64), "samoyeds-1:2:64", glu=True)
    a = dict(out=torch.empty(4, 64), dy=torch.randn(3, 16), values=pw.values, meta=pw.meta, idx=pw.idx,
             offsets=torch.tensor([0, 2, 4], dtype=torch.int32),
             token_ids=torch.tensor([0, 1, 2, 0], dtype=torch.int32), rows=16, cols=64, n=1, m=2, v=64, glu=True)
    a.update(over)
    return a


@pytest.mark.parametrize("over,exc,pattern", [
    (dict(dy=torch.randn(3, 16, dtype=torch.float64)), TypeError, r"^dy: expected dtype float32"),
    (dict(out=torch.empty(4, 64, dtype=torch.bfloat16)), TypeError, r"^out: expected dtype float32"),
    (dict(out=torch.empty(4, 60)), ValueError, r"^out: expected shape \(4, 64\)"),
    (dict(dy=torch.randn(3, 18)), ValueError, r"^dy: expected shape \(3, 16\)"),
    (dict(offsets=torch.tensor([0, 2, 4])), TypeError, r"^offsets: expected dtype int32"),
    (dict(offsets=torch.tensor([0, 3, 2], dtype=torch.int32)), ValueError, r"^ssmm_dx: offsets: offsets\[2\]"),
    (dict(offsets=torch.tensor([0, 2, 5], dtype=torch.int32)), ValueError, r"^ssmm_dx: offsets: offsets\[E\] = 5"),
    (dict(token_ids=torch.tensor([0, 1, 3, 0], dtype=torch.int32)), ValueError,
     r"^ssmm_dx: token_ids: token_ids\[2\] = 3 is outside dy's 3 rows"),
    (dict(token_ids=torch.tensor([0, 1, 2], dtype=torch.int32)), ValueError, r"^token_ids: expected shape \(4,\)"),
    (dict(scale=torch.ones(4, dtype=torch.float64)), TypeError, r"^scale: expected dtype float32"),
    (dict(idx=None), TypeError, r"^idx: expected a tensor \(the format selects rows"),
    (dict(rows=15), ValueError, r"^rows: expected an even row count"),
    (dict(cols=62), ValueError, r"^cols: expected a column count that is a multiple of 4"),
    (dict(values="nope"), TypeError, r"^values: "),
])
def test_ssmm_dx_names_the_bad_argument(over, exc, pattern):
    a = _dx_args(**over)
    with pytest.raises(exc, match=pattern):
        sm._C.ssmm_dx(**a)


def test_ssmm_dx_refuses_an_output_that_overlaps_an_input():
    a = _dx_args()
    big = torch.randn(4 * 64 + 64)
    a["out"] = big[:4 * 64].view(4, 64)
    a["dy"] = big[4 * 64 - 16:4 * 64 + 32].view(3, 16)
    with pytest.raises(ValueError, match=r"^out: expected an output that shares no memory with dy"):
        sm._C.ssmm_dx(**a)


# ---- on the GPU (the CUDA kernels; ssmm_dw's from cuda/ssmm_dw.cu) -----------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fmt,act,bias", [("samoyeds-1:2:128", "swiglu", True), ("samoyeds-1:4:64", "gptoss", True),
                                          ("2:4", "swiglu", False)])
@pytest.mark.parametrize("device", ["cuda"])
def test_gpu_gradients_match_the_oracle(fmt, act, bias, device):
    x, ids, w, gu, dn, gub, dnb = make_case(37, 4, 8, 256, 128, fmt, torch.bfloat16, bias, seed=12, device=device)
    go = torch.randn(x.shape, device=device).bfloat16()
    # GPT-OSS's own limit (7): a clamp as small as the values here would flip on the bf16
    # rounding of the pre-activation against the float64 oracle's (a derivative jumping from
    # 1 to 0); the clamps' gradients are checked in fp32 on the CPU (the same torch code)
    _, got = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, act, go, limit=7.0)
    _, want = oracle_grads(x, ids, w, gu, dn, gub, dnb, act, go, limit=7.0)
    for k in want:
        assert got[k].device.type == "cuda", k
        assert_near(got[k], want[k], 4e-2, k)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,glu", [("samoyeds-1:2:128", True), ("samoyeds-1:4:64", False), ("2:4", False)])
@pytest.mark.parametrize("gathered", [False, True])
def test_gpu_ssmm_dw_matches_the_c_reference(fmt, glu, gathered):
    gen = torch.Generator().manual_seed(3)
    E, T, K, R, C = 8, 300, 4, 256, 512
    pw = sm.pack(torch.randn(E, R, C, generator=gen).bfloat16(), fmt, glu=glu)
    r = sm.route(torch.randint(0, E + 1, (T, K), generator=gen), E)
    S = T * K
    dy = torch.randn(S, R, generator=gen).bfloat16()
    x = torch.randn(T if gathered else S, C, generator=gen).bfloat16()
    tok = r.token_ids if gathered else None
    scale = torch.rand(S, generator=gen)
    want = ssmm_dw(dy, x, pw, r.offsets, tok, scale)
    out = torch.full(pw.values.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    ssmm_dw(dy.cuda(), x.cuda(), pw.to("cuda"), r.offsets.cuda(), None if tok is None else tok.cuda(), scale.cuda(),
            out=out)
    assert not out.isnan().any()
    # the kernel rounds dy * scale to bf16 before the tensor cores (the C reference keeps it in
    # fp32): up to one output ulp apart, so the bound is relative to the largest value
    got, want = out.cpu().double(), want.double()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= 2 ** -7, err


# ---- shared_mlp: a dense backward ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_shared_mlp_backward_matches_torch_autograd(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    x, gate, up, down = (torch.randn(*s, generator=gen).to(dtype) for s in ((2, 5, 64), (48, 64), (48, 64), (64, 48)))
    go = torch.randn(2, 5, 64, generator=gen).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (x, gate, up, down)]
    torch.ops.samoyeds.shared_mlp(*leaves).backward(go)
    ref = [t.detach().double().requires_grad_() for t in (x, gate, up, down)]
    F.linear(F.silu(F.linear(ref[0], ref[1])) * F.linear(ref[0], ref[2]), ref[3]).backward(go.double())
    for name, a, b in zip(("x", "gate", "up", "down"), leaves, ref):
        assert a.grad.dtype == dtype
        assert_near(a.grad, b.grad, tol, name)


# ---- the plain layout of a glu weight (the GPU's pre-activation) -----------------------------------------

@pytest.mark.parametrize("fmt,I", [("samoyeds-1:2:128", 40), ("samoyeds-1:4:64", 256), ("2:4", 96)])
def test_unglued_is_the_same_weight_in_the_plain_layout(fmt, I):
    pw = sm.pack(torch.randn(3, 2 * I, 136, dtype=torch.bfloat16), fmt, glu=True)
    u = pw.unglued()
    assert not u.glu and u.fmt == pw.fmt and u.shape == pw.shape
    assert torch.equal(sm.unpack(u), sm.unpack(pw))
    assert torch.equal(u.values, sm.pack(sm.unpack(pw), fmt).values)
    ids = torch.randint(0, 4, (5, 2))
    r = sm.route(ids, 3)
    x = torch.randn(5, 136, dtype=torch.bfloat16)
    assert torch.equal(sm.ssmm(x, u, r.offsets, r.token_ids)[:int(r.offsets[-1])],
                       sm.ssmm(x, pw, r.offsets, r.token_ids)[:int(r.offsets[-1])])
    with torch.no_grad():
        pw.values.add_(1)
    assert pw.unglued() is u and torch.equal(sm.unpack(u), sm.unpack(pw))
    with pytest.raises(ValueError, match=r"^glu: expected a weight packed with glu=True"):
        u.unglued()


@pytest.mark.parametrize("fmt,I", [("samoyeds-1:2:128", 64), ("2:4", 36), ("1:4:64", 72), ("samoyeds-1:2:32", 8)])
def test_up_half_is_the_up_rows_as_a_weight_of_their_own(fmt, I):
    """PackedWeight.up_half(): the up rows [E, I, C] packed plain, the same mask and values;
    an ssmm on it writes the up half of the pre-activation; refreshed after an in-place
    update; refused for a plain weight."""
    pw = sm.pack(torch.randn(3, 2 * I, 136, dtype=torch.bfloat16), fmt, glu=True)
    u = pw.up_half()
    assert not u.glu and u.fmt == pw.fmt and u.shape3 == (3, I, 136)
    assert torch.equal(sm.unpack(u), sm.unpack(pw)[:, I:])
    r = sm.route(torch.randint(0, 4, (5, 2)), 3)
    x = torch.randn(5, 136, dtype=torch.bfloat16)
    n = int(r.offsets[-1])
    assert torch.equal(sm.ssmm(x, u, r.offsets, r.token_ids)[:n],
                       sm.ssmm(x, pw.unglued(), r.offsets, r.token_ids)[:n, I:])
    with torch.no_grad():
        pw.values.mul_(-2)
    assert pw.up_half() is u and torch.equal(sm.unpack(u), sm.unpack(pw)[:, I:])
    with pytest.raises(ValueError, match=r"^glu: expected a weight packed with glu=True"):
        u.up_half()


@pytest.mark.parametrize("fmt", ["samoyeds-1:2:128", "2:4", "1:4:64"])
@pytest.mark.parametrize("act", ["swiglu", "gptoss"])
def test_ssmm_preact_is_the_plain_layouts_output(fmt, act):
    """ssmm(..., preact=P) with a gated act (what the training forward runs, one kernel):
    out unchanged, P = the pre-activation of the plain (unglued) layout, gate then up
    columns, bias added; rows past offsets[E] and of placeholder ids untouched."""
    gen = torch.Generator().manual_seed(3)
    E, I, H, T, K = 4, 40, 72, 9, 2
    pw = sm.pack(torch.randn(E, 2 * I, H, generator=gen), fmt, glu=True)
    x = torch.randn(T, H, generator=gen)
    r = sm.route(torch.randint(0, E + 1, (T, K), generator=gen), E)
    b = torch.randn(E, 2 * I, generator=gen)
    S = r.token_ids.shape[0]
    n = int(r.offsets[-1])
    out = sm.ssmm(x, pw, r.offsets, r.token_ids, act=act, bias=b)
    out2 = torch.full((S, I), float("nan"))
    pre = torch.full((S, 2 * I), float("nan"))
    sm.ssmm(x, pw, r.offsets, r.token_ids, out2, act=act, bias=b, preact=pre)
    assert torch.equal(out2[:n], out[:n]) and torch.isnan(out2[n:]).all()
    want = torch.full((S, 2 * I), float("nan"))
    sm.ssmm(x, pw.unglued(), r.offsets, r.token_ids, want, bias=b)
    assert_near(pre[:n], want[:n], 1e-6, "preact")
    assert torch.isnan(pre[n:]).all()
    with pytest.raises(ValueError, match=r"^preact: "):
        sm.ssmm(x, pw, r.offsets, r.token_ids, act="none", preact=pre)
    with pytest.raises(ValueError, match=r"^preact: "):
        sm.ssmm(x, pw, r.offsets, r.token_ids, act=act, preact=torch.zeros(S, I))

class _FakeCudaRows:
    """What _ssmm_dx_takes reads of a CUDA dy (shape, strides, address, dtype), on the CPU."""
    is_cuda = True
    dtype = torch.bfloat16

    def __init__(self, shape, stride, ptr=256):
        self.shape, self._stride, self._ptr = tuple(shape), tuple(stride), ptr

    def dim(self):
        return len(self.shape)

    def stride(self, d=None):
        return self._stride if d is None else self._stride[d]

    def data_ptr(self):
        return self._ptr


@pytest.mark.parametrize("shape,stride,ptr,takes", [
    ((3, 40), (40, 1), 256, True), ((3, 36), (40, 1), 256, True), ((3, 36), (36, 1), 256, False),
    ((1, 36), (36, 1), 256, False),   # one row: the binding takes its width (36) as the stride
    ((1, 36), (40, 1), 256, False), ((1, 40), (44, 1), 256, True), ((3, 40), (40, 1), 264, False),
])
def test_ssmm_dx_takes_what_the_binding_takes_on_the_gpu(shape, stride, ptr, takes):
    """The GPU gate of _matmul_w mirrors csrc/args.c's row stride (one row: its width), so a
    dy the binding would refuse falls back instead of raising."""
    from samoyeds import torch_ops as to
    pw = sm.pack(torch.randn(2, shape[1], 64), "samoyeds-1:2:128")
    assert to._ssmm_dx_takes(_FakeCudaRows(shape, stride, ptr), pw) is takes


# ---- the routing, made once per training step ------------------------------------------------

def test_backward_takes_the_forwards_routing(monkeypatch):
    """The training forward keeps its routing with top_k_index; the backward takes it rather
    than routing again, and its gradients equal a backward that routes itself.  ids changed in
    place between the two: autograd refuses the backward (the ids are saved); _route's own
    version check is tested below."""
    from samoyeds import torch_ops
    x, ids, w, gu, dn, _, _ = make_case(24, 2, 4, 64, 32, "samoyeds-1:2:128", torch.float32, False, seed=21)
    calls = []
    real = torch_ops.route
    monkeypatch.setattr(torch_ops, "route", lambda *a, **k: calls.append(1) or real(*a, **k))
    go = torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
    out, grads = samoyeds_grads(x, ids, w, gu, dn, None, None, "swiglu", go)
    assert len(calls) == 1                                  # the forward's alone
    torch_ops._ROUTES.clear()                               # a backward that routes itself
    calls.clear()
    out2, grads2 = samoyeds_grads(x, ids, w, gu, dn, None, None, "swiglu", go, via="no_preact")
    assert len(calls) == 1      # the backward's (moe_forward routes in samoyeds.moe and keeps nothing)
    for k in grads:
        torch.testing.assert_close(grads[k], grads2[k], rtol=1e-5, atol=1e-6)
    # the ids changed in place between forward and backward: routed anew
    calls.clear()
    xl = x.clone().requires_grad_()
    y = sm.moe_forward(xl, ids, w, gu, dn)
    with torch.no_grad():
        ids.copy_(torch.roll(ids, 1, 0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(go)                                      # autograd itself refuses it first
    assert len(calls) == 1


def test_kept_routing_is_dropped_when_the_ids_change():
    """_route returns the kept routing only for the same, unchanged tensor and expert count:
    after an in-place change (or for another E) it routes anew, and what it returns is the
    routing of the ids as they are."""
    from samoyeds import torch_ops
    ids = torch.randint(0, 6, (9, 2), generator=torch.Generator().manual_seed(3))
    kept = torch_ops._route(ids, 6, remember=True)
    assert torch_ops._route(ids, 6) is kept
    assert torch_ops._route(ids.clone(), 6) is not kept                # another tensor
    other = torch_ops._route(ids, 7)                                    # another expert count
    assert other is not kept and torch.equal(other.offsets, sm.route(ids, 7).offsets)
    ids.copy_(torch.roll(ids, 1, 0).flip(1))
    ids[0, 0] = 5
    fresh = torch_ops._route(ids, 6)
    assert fresh is not kept
    want = sm.route(ids, 6)
    for a in ("offsets", "token_ids", "perm", "pos"):
        assert torch.equal(getattr(fresh, a), getattr(want, a)), a


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fmt,act,bias", [("samoyeds-1:2:128", "swiglu", False), ("samoyeds-1:4:64", "gptoss", True)])
def test_dw_copy_by_the_glu_backward_gives_the_same_gradients(device, fmt, act, bias):
    """samoyeds.config(dw_copy="glu_backward"): on the GPU the GLU backward also writes the
    gate_up dW's copy of d(pre-activation) (glu_backward(out_t=), ssmm_dw(dy_t=)); every
    weight and input gradient the same bits as the default's, the routing weights' within
    fp32 summation order (another order of the row dot products); on the CPU nothing changes."""
    x, ids, w, gu, dn, gub, dnb = make_case(150, 4, 6, 256, 192, fmt, torch.bfloat16, bias, seed=21, device=device)
    go = torch.randn(x.shape, device=device).bfloat16()
    _, a = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, act, go)
    with sm.config(dw_copy="glu_backward"):
        _, b = samoyeds_grads(x, ids, w, gu, dn, gub, dnb, act, go)
    for k in a:
        if k == "w" and device == "cuda":
            torch.testing.assert_close(b[k].float(), a[k].float(), rtol=2e-2, atol=1e-2 * a[k].abs().max().item())
        else:
            assert torch.equal(a[k], b[k]), k
