"""The transposed packing's refresh after an optimizer step, two ways on the same weight:
the index-map gather (_C.format_gather through one int32 per place, what PackedWeight.
transposed() ran before) and _C.format_transpose_values (W's values and metadata read once,
no map).  Per model shape (both packed weights of a layer, bf16): ms, the bytes each moves
and the fraction of the device's copy rate that gives; both outputs compared bit for bit.

    python dev/lab/refresh_bench.py [--models mixtral-8x7b,qwen3-30b-a3b] [--out DIR]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import common  # noqa: E402

import samoyeds as sm  # noqa: E402
from samoyeds import _C  # noqa: E402
import bench_moe  # noqa: E402
from bench_train import dims  # noqa: E402


def index_map(pw, t):
    """int32 [places]: the flat index in pw.values of each place of t (its transposed packing),
    pw.values.numel() for a padding place; built as samoyeds built it before (two exact fp32
    halves of every value slot's index + 1, unpacked, transposed, packed under t's mask)."""
    E, R, C = pw.shape3
    nv = pw.values[0].numel()
    coord = torch.arange(1, nv + 1, device=pw.values.device, dtype=torch.int64).reshape(pw.values.shape[1:])
    src = []
    mask = sm.unpack(sm.PackedWeight(torch.ones_like(t.values, dtype=torch.float32), t.meta, None, t.fmt, t.shape,
                                     False)) != 0
    for e in range(E):
        parts = []
        for part in ((coord >> 12).float(), (coord & 4095).float()):
            d = sm.unpack(sm.PackedWeight(part[None].contiguous(), pw.meta[e:e + 1], None if pw.idx is None else
                                          pw.idx[e:e + 1], pw.fmt, (1, R, C), pw.glu))
            parts.append(sm.pack(d.transpose(1, 2).contiguous(), "2:4", mask=mask[e:e + 1]).values)
        s = (parts[0].long() << 12) + parts[1].long() - 1
        src.append(torch.where(s >= 0, s + e * nv, E * nv).reshape(-1))
    return torch.cat(src).to(torch.int32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mixtral-8x7b,qwen3-30b-a3b,olmoe,deepseek-v2-lite,gpt-oss-20b")
    ap.add_argument("--fmt", default="samoyeds-1:2:128")
    ap.add_argument("--out")
    args = ap.parse_args()
    copy = common.copy_rate_tb_s()
    rows = []
    print(f"device copy rate {copy:.2f} TB/s")
    print(f"{'model':18s} {'weight':8s} {'gather ms':>9s} {'kernel ms':>9s} {'x':>5s} {'map GB':>7s} "
          f"{'kernel GB':>9s} {'of copy':>7s}")
    for name in args.models.split(","):
        H, I, E, _ = dims(bench_moe._block(name, False)[1])
        for wname, R, C, glu in (("gate_up", 2 * I, H, True), ("down", H, I, False)):
            torch.manual_seed(0)
            pw = sm.pack(torch.randn(E, R, C, device="cuda", dtype=torch.bfloat16), args.fmt, glu=glu)
            t = pw.transposed()
            src = index_map(pw, t)
            n, m, v = pw.fmt.c_args()
            out_map = torch.empty_like(t.values)
            out_k = torch.full_like(t.values, float("nan"))

            def by_map():
                _C.format_gather(out_map.view(-1), pw.values, src)

            def by_kernel():
                _C.format_transpose_values(out_k, t.meta, pw.values, pw.meta, pw.idx, n, m, v, glu, R, C)

            tm = common.time_graph(by_map, budget_s=0.3)["ms"]
            tk = common.time_graph(by_kernel, budget_s=0.3)["ms"]
            torch.cuda.synchronize()
            same = torch.equal(out_map, out_k)
            eb = 2
            kbytes = (pw.values.numel() * eb + pw.meta.numel() * 4 + (pw.idx.numel() if pw.idx is not None else 0)
                      + out_k.numel() * eb + t.meta.numel() * 4)
            mbytes = pw.values.numel() * eb + src.numel() * 4 + out_map.numel() * eb
            row = {"model": name, "weight": wname, "E": E, "R": R, "C": C, "ms_gather": tm, "ms_kernel": tk,
                   "speedup": tm / tk, "gather_bytes": mbytes, "kernel_bytes": kbytes,
                   "kernel_frac_copy_rate": kbytes / (tk * 1e-3) / 1e12 / copy, "equal": same}
            rows.append(row)
            print(f"{name:18s} {wname:8s} {tm:9.3f} {tk:9.3f} {tm / tk:5.2f} {mbytes / 1e9:7.2f} {kbytes / 1e9:9.2f} "
                  f"{row['kernel_frac_copy_rate']:7.1%}  equal={same}")
            torch.cuda.empty_cache()
    if args.out:
        common.write_json(str(Path(common.gpu_dir(args.out)) / "refresh_bench.json"),
                          {"env": common.environment(), "copy_rate_tb_s": copy, "rows": rows})
    if not all(r["equal"] for r in rows):
        sys.exit("the two refreshes differ")


if __name__ == "__main__":
    main()
