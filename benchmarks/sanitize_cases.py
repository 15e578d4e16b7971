"""A representative subset of every CUDA kernel, small enough to run under
compute-sanitizer (memcheck, racecheck): odd shapes, tails, empty experts,
every epilogue, both dtypes, every matmul kernel (mma.sp, wgmma.sp, the decode
split-K kernel, the dense decode kernel) and every row-group size (M = 1, 2, 4); a patched
transformers block on two streams; and the shared-memory fill-rate
kernels (every way, on a few SMs, one and several stages) under memcheck: each
measurement calibrates its launches to ~10 ms, which racecheck stretches past the step's
time limit, and nothing reads what those kernels write to shared memory but their
mbarriers."""
import itertools
import os
import sys
from pathlib import Path

import torch

import samoyeds as sm
from common import wgmma_runs  # noqa: E402  (benchmarks/common.py)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dev" / "peak"))
import peak  # noqa: E402  (dev/peak: the fill-rate probes, built with nvcc on first use)


def transpose_cases(gen: torch.Generator) -> None:
    """The transposed packing's refresh alone: ``python benchmarks/sanitize_cases.py transpose``."""
    # GLU and plain, slices narrower and wider than a tile, row tails, 2- and 4-byte values, W^T
    # rows past the last 128-row tile, then malformed idx and meta
    from samoyeds import _C
    for fmt, glu, R, C, dt in [("samoyeds-1:2:128", True, 264, 200, torch.bfloat16),
                               ("1:4:64", False, 136, 584, torch.float32),
                               ("samoyeds-1:2:32", True, 40, 164, torch.float16)]:
        print("case format_transpose_values", fmt, glu, R, C, dt, flush=True)
        p = sm.pack(torch.randn(3, R, C, generator=gen).to(dt).cuda(), fmt, glu=glu)
        t = p.transposed()
        n, m, v = p.fmt.c_args()
        out = torch.empty_like(t.values)
        _C.format_transpose_values(out, t.meta, p.values, p.meta, p.idx, n, m, v, glu, R, C)
        bad_idx = torch.randint(0, 256, p.idx.shape, generator=gen, dtype=torch.uint8).cuda()
        bad_meta = torch.randint(0, 2**31, p.meta.shape, generator=gen, dtype=torch.int32).cuda().view(torch.uint32)
        _C.format_transpose_values(out, t.meta, p.values, bad_meta, bad_idx, n, m, v, glu, R, C)


def train_cases(gen: torch.Generator) -> None:
    """The training kernels (issue 40) alone: ``python benchmarks/sanitize_cases.py train``."""
    from samoyeds import _C
    # the packed weight gradient (ssmm_dw): every row-group size, slices of 64 (four A tiles per
    # CTA), 128 and 192 (slices straddling a CTA's columns), plain and GLU layouts, rows per half
    # not a multiple of 8 (dy read by elements), token ids and routing scales, empty experts,
    # a row block of 64 storage rows, column tails, rows past offsets[E] never read
    from samoyeds.ops import ssmm_dw
    for fmt, glu, R, C, T in [("samoyeds-1:2:128", True, 272, 200, 77), ("1:4:64", False, 136, 584, 40),
                              ("samoyeds-1:2:64", True, 40, 264, 33), ("2:4", False, 96, 128, 50),
                              ("2:4", True, 200, 72, 9), ("samoyeds-1:2:192", False, 144, 456, 61)]:
        print("case ssmm_dw", fmt, glu, R, C, T, flush=True)
        E, K = 5, 2
        p = sm.pack(torch.randn(E, R, C, generator=gen).to(torch.bfloat16).cuda(), fmt, glu=glu)
        r = sm.route(torch.randint(0, E + 1, (T, K), generator=gen).cuda(), E)  # E: placeholder id
        dy = torch.randn(T * K, R, generator=gen).to(torch.bfloat16).cuda()
        sc = torch.rand(T * K, generator=gen).cuda()
        ssmm_dw(dy, torch.randn(T, C, generator=gen).to(torch.bfloat16).cuda(), p, r.offsets, r.token_ids)
        ssmm_dw(dy, torch.randn(T * K, C, generator=gen).to(torch.bfloat16).cuda(), p, r.offsets, None, sc)
    # both ssmm_dw kernels (impl: the wgmma one of ssmm_dw_wgmma.cu is what "auto"
    # runs on sm_90; "mma" forces the mma.sync one): several 256-row and 128-column blocks with
    # tails (rp = 320 / 640, C = 392), two G tiles per stage (V = 192, 320: halves in one slice or
    # two), 1:4 gathers, k-loops past the ring (more than 4 k-tiles), fp16, dy rows by elements
    # (the wgmma kernel's two producers, "gather" and "copy", where it runs)
    for impl in ("auto", "mma") + (("gather", "copy") if wgmma_runs() else ()):
        for fmt, glu, R, C, T, dt in [("samoyeds-1:2:192", True, 1152, 392, 700, torch.bfloat16),
                                      ("samoyeds-1:4:320", False, 1280, 392, 300, torch.float16),
                                      ("samoyeds-1:2:128", False, 640, 264, 90, torch.bfloat16),
                                      ("2:4", True, 136, 200, 400, torch.float16)]:
            E, K = 3, 2
            p = sm.pack(torch.randn(E, R, C, generator=gen).to(dt).cuda(), fmt, glu=glu)
            r = sm.route(torch.randint(0, E + 1, (T, K), generator=gen).cuda(), E)
            dy = torch.randn(T * K, R, generator=gen).to(dt).cuda()
            sc = torch.rand(T * K, generator=gen).cuda()
            ssmm_dw(dy, torch.randn(T, C, generator=gen).to(dt).cuda(), p, r.offsets, r.token_ids, impl=impl)
            ssmm_dw(dy, torch.randn(T * K, C, generator=gen).to(dt).cuda(), p, r.offsets, None, sc, impl=impl)
            # dy by token id (the down projection's output gradient), ids outside dy read as zero rows
            ids = r.token_ids.clone()
            ids[:3] = torch.tensor([T + 5, -1, T - 1], dtype=torch.int32)
            ssmm_dw(dy[:T], torch.randn(T * K, C, generator=gen).to(dt).cuda(), p, r.offsets, None, sc, impl=impl,
                    dy_token_ids=ids)
    # dX from the forward's packing (ssmm_dx): every row-group size, slices of 64 (two A tiles
    # per CTA), 128 and 192 (a CTA's halves in one slice or two), plain and GLU layouts, rows per
    # half not a multiple of 8 (dy read by elements), token ids and scales, empty experts, a
    # 64-storage-row weight, column tails, placeholders (rows past offsets[E] zeroed, never read),
    # an invalid token id (a zero row), T = 0, k-loops of many tiles, fp16; both kernels (the
    # wgmma one of ssmm_dx_wgmma.cu, what "auto" runs on sm_90, and the mma.sync one)
    from samoyeds.ops import ssmm_dx
    dx_impls = ("mma",) + (("wgmma",) if wgmma_runs() else ())
    for impl, (fmt, glu, R, C, T, dt) in itertools.product(dx_impls, [
                                  ("samoyeds-1:2:128", True, 272, 200, 77, torch.bfloat16),
                                  ("1:4:64", False, 136, 584, 40, torch.bfloat16),
                                  ("samoyeds-1:2:64", True, 40, 264, 33, torch.float16),
                                  ("2:4", False, 96, 128, 50, torch.bfloat16),
                                  ("2:4", True, 200, 72, 9, torch.float16),
                                  ("samoyeds-1:2:192", False, 1152, 456, 300, torch.bfloat16),
                                  ("samoyeds-1:2:128", False, 128, 128, 0, torch.bfloat16)]):
        print("case ssmm_dx", impl, fmt, glu, R, C, T, flush=True)
        E, K = 5, 2
        p = sm.pack(torch.randn(E, R, C, generator=gen).to(dt).cuda(), fmt, glu=glu)
        ids = torch.randint(0, E + 1, (T, K), generator=gen)
        ids[ids == 2] = 1                                                     # expert 2: no rows
        r = sm.route(ids.cuda(), E)                                           # E: placeholder id
        sc = torch.rand(T * K, generator=gen).cuda()
        ssmm_dx(torch.randn(T, R, generator=gen).to(dt).cuda(), p, r.offsets, r.token_ids, impl=impl)
        ssmm_dx(torch.randn(T * K, R, generator=gen).to(dt).cuda(), p, r.offsets, None, sc, impl=impl)
        if T > 0:
            bad = r.token_ids.clone()
            bad[0] = T + 5                                                    # read as a zero row
            ssmm_dx(torch.randn(T, R, generator=gen).to(dt).cuda(), p, r.offsets, bad, sc, impl=impl)
    transpose_cases(gen)
    # the unrouted rows zeroed by bytes (rows of 10 bytes 26 apart, then whole rows of 26 bytes;
    # the layer backward below runs the 16-byte path), offsets[E] inside S, at S and past it
    print("case moe_zero_unrouted", flush=True)
    base = torch.randn(40, 13, generator=gen).to(torch.bfloat16).cuda()
    for routed in (7, 40, 99):
        off = torch.tensor([0, min(routed, 40), routed], dtype=torch.int32, device="cuda")
        _C.moe_zero_unrouted(base[:, :5], off)
        _C.moe_zero_unrouted(base, off)
    # the backward of the whole layer (issue 40): the transposed packings, dX by ssmm on them,
    # ssmm_dw for both packed weights, the routing weights' and the biases' gradients
    for fmt, act in (("samoyeds-1:2:128", "swiglu"), ("1:4:64", "gptoss"), ("2:4", "swiglu")):
        print("case layer backward", fmt, act, flush=True)
        T, K, E, H, I = 333, 2, 5, 128, 136
        gu = sm.pack(torch.randn(E, 2 * I, H, generator=gen).to(torch.bfloat16).cuda(), fmt, glu=True)
        dn = sm.pack(torch.randn(E, H, I, generator=gen).to(torch.bfloat16).cuda(), fmt)
        gu.values, dn.values = torch.nn.Parameter(gu.values), torch.nn.Parameter(dn.values)
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda().requires_grad_()
        w = torch.rand(T, K, generator=gen).cuda().requires_grad_()
        idx = torch.randint(0, E + 1, (T, K), generator=gen).cuda()
        gub = torch.randn(E, 2 * I, generator=gen).cuda().requires_grad_()
        sm.moe_forward(x, idx, w, gu, dn, act=act, gate_up_bias=gub).float().square().sum().backward()
        # the same with the GLU backward writing ssmm_dw's copy (glu_backward_t_kernel, ssmm_dw's
        # dy_t) where ssmm_dw takes it, and with only the gate half kept (the up half recomputed)
        for fields in ({"dw_copy": "glu_backward"}, {"save_preact": "gate"}):
            print("case layer backward", fmt, act, fields, flush=True)
            with sm.config(**fields):
                sm.moe_forward(x, idx, w, gu, dn, act=act, gate_up_bias=gub).float().square().sum().backward()
    # glu_backward's out_t alone: I split over CTAs (row dot products as partials), 16-byte and
    # element-wise rows, offsets[0] > 0 (rows before it by the other kernel), a placeholder tail
    from samoyeds.ops import dy_t_shape, glu_backward
    for S, I, off in ((700, 768, [0, 200, 200, 650]), (130, 13, [9, 60, 100]), (64, 200, [0, 0, 64])):
        print("case glu_backward out_t", S, I, flush=True)
        pre = torch.randn(S, 2 * I, generator=gen).to(torch.bfloat16).cuda()
        dh = torch.randn(S, I, generator=gen).to(torch.bfloat16).cuda()
        offs = torch.tensor(off, dtype=torch.int32, device="cuda")
        out_t = torch.empty(dy_t_shape(2 * I, S, len(off) - 1), dtype=torch.bfloat16, device="cuda")
        glu_backward(dh, pre, scale=torch.rand(S, generator=gen).cuda(), offsets=offs, out_t=out_t,
                     hdot=torch.empty(S, device="cuda"))
    torch.cuda.synchronize()


def main(cublas: bool = True) -> None:
    """Every case; ``cublas=False`` (argument ``ours``) leaves out the one whose kernels read
    cuBLAS's outputs (unpruned shared experts: F.linear, then samoyeds.glu), for initcheck,
    which reports those reads as uninitialised with no samoyeds code involved
    (dev/sanitize/initcheck_control.py)."""
    gen = torch.Generator().manual_seed(0)
    # on sm_90 "auto" runs the wgmma.sp kernel for 2:4 and 1:2:128, mma.sp for the others
    for fmt, act, dtype, impl in [("samoyeds-1:2:128", "swiglu", torch.bfloat16, "auto"),
                                  ("2:4", "none", torch.float16, "auto"),
                                  ("samoyeds-1:2:128", "gptoss", torch.bfloat16, "mma_sp"),
                                  ("1:4:64", "gptoss", torch.bfloat16, "auto"),
                                  ("samoyeds-1:2:64", "none", torch.bfloat16, "auto"),
                                  # decode: token passes of 8..32 rows, warps' K ranges, row selection
                                  ("samoyeds-1:2:128", "swiglu", torch.bfloat16, "decode"),
                                  ("1:4:64", "none", torch.float16, "decode"),
                                  ("2:4", "gptoss", torch.bfloat16, "decode")]:
        print("case ssmm", fmt, act, impl, flush=True)
        T, K, E, H, I = 77, 2, 5, 200, 136
        x = torch.randn(T, H, generator=gen).to(dtype).cuda()
        glu = act != "none"
        R = 2 * I if glu else I
        w = torch.randn(E, R, H, generator=gen).to(dtype).cuda()
        p = sm.pack(w, fmt, glu=glu)
        sm.unpack(p)
        idx = torch.randint(0, E + 1, (T, K), generator=gen).cuda()  # E: placeholder id
        r = sm.route(idx, E)
        sc = sm.gather_weights(torch.rand(T, K, generator=gen).cuda(), r)
        bias = torch.randn(E, R, generator=gen).to(dtype).cuda()
        y = sm.ssmm(x, p, r.offsets, r.token_ids, act=act, bias=bias, scale=sc, impl=impl)
        sm.combine(y, r.pos) if not glu else None
    # the wgmma.sp kernel with more work items than the grid holds and experts with odd
    # token-tile counts
    if torch.cuda.get_device_capability() == (9, 0):
        for fmt in ("2:4", "samoyeds-1:2:128"):
            T, K, E, H, I = 1500, 2, 3, 256, 640
            x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
            w = torch.randn(E, 2 * I, H, generator=gen).to(torch.bfloat16).cuda()
            p = sm.pack(w, fmt, glu=True)
            r = sm.route(torch.randint(0, E, (T, K), generator=gen).cuda(), E)
            sc = sm.gather_weights(torch.rand(T, K, generator=gen).cuda(), r)
            sm.ssmm(x, p, r.offsets, r.token_ids, act="swiglu", scale=sc, impl="wgmma_sp")
        # the token rows by TMA (x read without a row map, as a down projection reads its
        # intermediate rows; "tma": an error unless that path runs): columns past C, rows past
        # offsets[E] and past the last expert's last tile
        with sm.config(token_rows="tma"):
            for fmt in ("2:4", "samoyeds-1:2:128"):
                T, K, E, H, I = 1001, 3, 4, 256, 200
                w = torch.randn(E, H, I, generator=gen).to(torch.bfloat16).cuda()
                p = sm.pack(w, fmt)
                r = sm.route(torch.randint(0, E + 1, (T, K), generator=gen).cuda(), E)
                x = torch.randn(T * K, I, generator=gen).to(torch.bfloat16).cuda()
                sc = sm.gather_weights(torch.rand(T, K, generator=gen).cuda(), r)
                sm.ssmm(x, p, r.offsets, None, scale=sc, impl="wgmma_sp")
        # the 1:2:V tiles of 256 rows x 64 and x 96 tokens, token rows by TMA and gathered,
        # gated (a last item of one gate/up chunk pair) and not
        for tile, rows, act in [("256x64", "tma", "none"), ("256x64", "gather", "swiglu"),
                                ("256x96", "tma", "none"), ("256x96", "gather", "swiglu")]:
            T, K, E, H, I = 1001, 3, 4, 320, 320  # 384 storage rows (glu): 1.5 tiles of 256
            glu = act != "none"
            w = torch.randn(E, 2 * I if glu else I, H, generator=gen).to(torch.bfloat16).cuda()
            p = sm.pack(w, "samoyeds-1:2:128", glu=glu)
            r = sm.route(torch.randint(0, E + 1, (T, K), generator=gen).cuda(), E)
            sc = sm.gather_weights(torch.rand(T, K, generator=gen).cuda(), r)
            with sm.config(tile=tile, token_rows=rows):
                if rows == "tma":
                    x = torch.randn(T * K, H, generator=gen).to(torch.bfloat16).cuda()
                    sm.ssmm(x, p, r.offsets, None, scale=sc, impl="wgmma_sp")
                else:
                    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
                    sm.ssmm(x, p, r.offsets, r.token_ids, act=act, scale=sc, impl="wgmma_sp")
    # the decode kernel's CTA shapes (few CTAs; many at up to 8 rows per expert; many above)
    # and token passes of 8, 16 and 32 (chosen from S and E), several passes, uneven K ranges
    for T, K, E, I in [(40, 2, 6, 136), (10, 2, 6, 136), (4, 1, 6, 136), (24, 8, 64, 256), (36, 8, 32, 320)]:
        H = 200
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
        p = sm.pack(torch.randn(E, 2 * I, H, generator=gen).to(torch.bfloat16).cuda(), "samoyeds-1:2:128",
                    glu=True)
        r = sm.route(torch.randint(0, E + 1, (T, K), generator=gen).cuda(), E)
        sm.ssmm(x, p, r.offsets, r.token_ids, act="swiglu", impl="decode")
    # routing of more pairs than one CTA takes (counts, scan, rows in blocks)
    r = sm.route(torch.randint(0, 9, (3001, 2), generator=gen).cuda(), 8)
    sm.gather_weights(torch.rand(3001, 2, generator=gen).cuda(), r)
    # the whole forward in one call (buffers carved from one workspace): decode-sized, empty,
    # and large enough for the multi-block routing and the wgmma.sp kernel
    for T in (5, 0, 2100):
        K, E, H, I = 2, 6, 128, 136
        gu = sm.pack(torch.randn(E, 2 * I, H, generator=gen).to(torch.bfloat16).cuda(), "samoyeds-1:2:128",
                     glu=True)
        dn = sm.pack(torch.randn(E, H, I, generator=gen).to(torch.bfloat16).cuda(), "samoyeds-1:2:128")
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
        idx = torch.randint(0, E + 1, (T, K), generator=gen).cuda()
        for mode in ("auto", "always"):   # gate_up's rows by index, and from the copy of x's rows
            with sm.config(x_copy=mode):
                sm.moe_forward(x, idx, torch.rand(T, K, generator=gen).cuda(), gu, dn, act="gptoss",
                               gate_up_bias=torch.randn(E, 2 * I, generator=gen).cuda(),
                               down_bias=torch.randn(E, H, generator=gen).to(torch.bfloat16).cuda())
    # split-K of the wgmma.sp kernel (forced: partial sums, the second kernel, the workspace) in
    # every splittable tile, and the pre-activation output of every kernel (gated launches)
    if torch.cuda.get_device_capability() == (9, 0):
        print("case split-K", flush=True)
        for fmt, tile, act in [("2:4", "auto", "none"), ("samoyeds-1:2:128", "128x128", "swiglu"),
                               ("samoyeds-1:2:128", "256x64", "gptoss")]:
            T, K, E, C, I = 130, 2, 3, 1600, 136
            glu = act != "none"
            p = sm.pack(torch.randn(E, 2 * I if glu else I, C, generator=gen).to(torch.bfloat16).cuda(), fmt, glu=glu)
            r = sm.route(torch.randint(0, E + 1, (T, K), generator=gen).cuda(), E)
            x = torch.randn(T, C, generator=gen).to(torch.bfloat16).cuda()
            with sm.config(split_k=3, tile=tile):
                sm.ssmm(x, p, r.offsets, r.token_ids, act=act, bias=torch.randn(E, p.shape3[1], generator=gen).cuda(),
                        impl="wgmma_sp")
    print("case preact", flush=True)
    for impl, fmt in [("auto", "samoyeds-1:2:128"), ("auto", "2:4"), ("mma_sp", "1:4:64"), ("decode", "samoyeds-1:2:128")]:
        T, K, E, H, I = (300 if impl != "decode" else 7), 2, 4, 264, 200
        p = sm.pack(torch.randn(E, 2 * I, H, generator=gen).to(torch.bfloat16).cuda(), fmt, glu=True)
        r = sm.route(torch.randint(0, E + 1, (T, K), generator=gen).cuda(), E)
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
        pre = torch.zeros(T * K, 2 * I, dtype=torch.bfloat16, device="cuda")
        sm.ssmm(x, p, r.offsets, r.token_ids, act="swiglu", bias=torch.randn(E, 2 * I, generator=gen).cuda(),
                impl=impl, preact=pre)
    print("case train", flush=True)
    train_cases(gen)
    print("case rest", flush=True)
    # dense weights at a few tokens: every token-tile width, one and several token passes, row
    # and column tails, every activation, the down projection's early weight reads
    for T, R, C, act in [(1, 17, 72, "swiglu"), (9, 33, 200, "none"), (20, 40, 136, "gptoss"), (70, 50, 264, "swiglu")]:
        x = torch.randn(T, C, generator=gen).to(torch.bfloat16).cuda()
        g, u = (torch.randn(R, C, generator=gen).to(torch.bfloat16).cuda() for _ in range(2))
        h = sm.dense_decode(x, g, u if act != "none" else None, act=act)
        if R % 8 == 0:
            sm.dense_decode(h, torch.randn(24, R, generator=gen).to(torch.bfloat16).cuda(), weights_ready=True)
    # the router: every logits kernel configuration (split-K below 512 tokens, tiles from 512,
    # choosing in the tile kernel up to 128 experts), tails of tokens, experts and columns,
    # groups, a bias; the selection kernel (keys, segments of lanes) after the tiles above 128
    # experts
    for T, E, H, k, ng in [(1, 60, 72, 6, 4), (13, 33, 136, 3, 1), (40, 128, 264, 8, 8), (1100, 96, 40, 2, 1),
                           (700, 20, 72, 4, 4), (600, 300, 40, 8, 4)]:
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
        w = torch.randn(E, H, generator=gen).to(torch.bfloat16).cuda()
        sm.router(x, w, k, n_group=ng, topk_group=max(1, ng // 2), logits_dtype="float32", renorm=True)
        sm.router(x, w, k, bias=torch.randn(E, generator=gen).cuda(), mode="topk_softmax")
        sm.router(x, w, k, mode="sigmoid_topk", n_group=ng, topk_group=max(1, ng // 2), renorm=True,
                  choice_bias=torch.randn(E, generator=gen).cuda(), logits_dtype="float32")
    # the gated activation: 16-byte pieces and single elements, column slices of wider rows
    for T, I in [(3, 24), (5, 13), (40, 1416)]:
        wide = torch.randn(T, 2 * I + 8, generator=gen).to(torch.bfloat16).cuda()
        sm.glu(wide[:, :I], wide[:, I + 8:], act="swiglu")
        sm.glu(wide[:, :I].contiguous(), wide[:, I:2 * I].contiguous(), act="gptoss")
    # a patched transformers MoE block with shared experts (the block alone: the model's
    # attention kernels are not ours), on two streams (routed path and shared MLP, unpruned and
    # packed), above and at decode sizes
    try:
        from samoyeds.hf.families import Shape, build_model
    except ImportError:  # transformers absent
        build_model = None
    if build_model is not None:
        shape = Shape(vocab=64, hidden=128, layers=1, experts=8, top_k=2, intermediate=64, heads=4, kv_heads=2,
                      head_dim=32, init_std=0.1)
        for packed in ((False, True) if cublas else (True,)):
            model = build_model("deepseek_v2", shape, seed=3)
            sm.patch_model(model, "samoyeds-1:2:128", progress=False, shared_experts=packed,
                           shared_stream_min_rows=1)
            model.to(device="cuda", dtype=torch.bfloat16)
            block = next(m for m in model.modules() if getattr(type(m), "_samoyeds_block", False))
            with torch.no_grad():
                for length in (3, 40):
                    block(torch.randn(2, length, shape.hidden, generator=gen).to(torch.bfloat16).cuda())
    # the fill-rate kernels (sm_90a): rings of one stage and of several, clusters for multicast
    if (torch.cuda.get_device_capability() == (9, 0) and peak.available()
            and os.environ.get("SAMOYEDS_SANITIZE_TOOL", "memcheck") == "memcheck"):
        for kind in peak.FILL_KINDS:
            for stages in (1, 3):
                peak.shared_fill_rate(kind, ctas=4, stages=stages)
    # hostile inputs (issue 44): ssmm on the GPU does not check the packed arrays (a host sync per
    # call), so row indices out of range or out of order and invalid 2:4 codes must stay inside the
    # arrays; unpack refuses them; ids at the int32 extremes; empty and single-row problems
    for fmt, glu in (("3:8:32", True), ("samoyeds-1:2:128", False), ("2:4", True)):
        print("case hostile", fmt, flush=True)
        E, I, H, T = 3, 96, 128, 37
        R = 2 * I if glu else I
        p = sm.pack(torch.randn(E, R, H, generator=gen).to(torch.bfloat16).cuda(), fmt, glu=glu)
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
        r = sm.route(torch.randint(0, E, (T, 2), generator=gen).cuda(), E)
        for what in ("range", "order", "code"):
            idx = None if p.idx is None else p.idx.clone()
            meta = p.meta.clone()
            if what == "range" and idx is not None:
                idx[:, :, ::7] = 255
            elif what == "order" and idx is not None:
                idx[:, :, 0::2], idx[:, :, 1::2] = p.idx[:, :, 1::2], p.idx[:, :, 0::2]
            else:
                meta.view(torch.int32)[..., ::3] |= 0x0F0F0F0F
            bad = sm.PackedWeight(p.values, meta, idx, p.fmt, p.shape, p.glu)
            for impl in ("auto", "mma_sp", "decode"):
                try:
                    sm.ssmm(x, bad, r.offsets, r.token_ids, act="swiglu" if glu else "none", impl=impl)
                except (ValueError, NotImplementedError):  # (3:8:32: no GPU kernel runs n > 1)
                    pass
            try:
                sm.unpack(bad)
            except ValueError:
                pass
    for ids in (torch.tensor([[-2**31, 2**31 - 1], [0, 5]], dtype=torch.int32),
                torch.tensor([[2**62, -1]], dtype=torch.int64), torch.empty(0, 2, dtype=torch.int64)):
        r = sm.route(ids.cuda(), 6)
        sm.gather_weights(torch.rand(ids.shape).cuda(), r)
    torch.cuda.synchronize()
    print("sanitize cases done")


if __name__ == "__main__":
    if sys.argv[1:] == ["transpose"]:
        transpose_cases(torch.Generator().manual_seed(0))
        print("sanitize cases done (transpose)")
    elif sys.argv[1:] == ["train"]:
        train_cases(torch.Generator().manual_seed(0))
        print("sanitize cases done (train)")
    else:
        main(cublas=sys.argv[1:] != ["ours"])
