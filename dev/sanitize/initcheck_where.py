"""Which tensor does initcheck's report point into?  Run the layer-backward cases of
sanitize_cases.train_cases one by one with the caching allocator off
(PYTORCH_NO_CUDA_MEMORY_CACHING=1), printing every packed array's address range."""
import sys
import torch
import samoyeds as sm

def rng(name, t):
    if t is not None:
        print(f"{name:28s} {t.data_ptr():#x} .. {t.data_ptr() + t.numel() * t.element_size():#x} {tuple(t.shape)}", flush=True)

gen = torch.Generator().manual_seed(0)
for fmt, act in (("samoyeds-1:2:128", "swiglu"), ("1:4:64", "gptoss"), ("2:4", "swiglu")):
    T, K, E, H, I = 333, 2, 5, 128, 136
    gu = sm.pack(torch.randn(E, 2 * I, H, generator=gen).to(torch.bfloat16).cuda(), fmt, glu=True)
    dn = sm.pack(torch.randn(E, H, I, generator=gen).to(torch.bfloat16).cuda(), fmt)
    gu.values, dn.values = torch.nn.Parameter(gu.values), torch.nn.Parameter(dn.values)
    print("case", fmt, flush=True)
    for n, p in (("gu", gu), ("dn", dn)):
        rng(n + ".values", p.values); rng(n + ".meta", p.meta); rng(n + ".idx", p.idx)
    for n, p in (("gu", gu), ("dn", dn)):
        for lay in ("transposed", "unglued"):
            try:
                q = getattr(p, lay)()
            except Exception as e:  # noqa: BLE001
                print(n, lay, "->", type(e).__name__); continue
            rng(f"{n}.{lay}.values", q.values); rng(f"{n}.{lay}.meta", q.meta); rng(f"{n}.{lay}.idx", q.idx)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda().requires_grad_()
    w = torch.rand(T, K, generator=gen).cuda().requires_grad_()
    idx = torch.randint(0, E + 1, (T, K), generator=gen).cuda()
    gub = torch.randn(E, 2 * I, generator=gen).cuda().requires_grad_()
    print("forward", flush=True); torch.cuda.synchronize()
    y = sm.moe_forward(x, idx, w, gu, dn, act=act, gate_up_bias=gub)
    torch.cuda.synchronize(); print("backward", flush=True)
    y.float().square().sum().backward()
    torch.cuda.synchronize(); print("done", fmt, flush=True)
