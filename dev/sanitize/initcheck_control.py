"""Control for compute-sanitizer initcheck (issue 44): no samoyeds code at all.

cuBLAS writes a matmul's output (F.linear) and a plain torch elementwise kernel reads it,
at the shapes of the shared-expert MLP in benchmarks/sanitize_cases.py.  If initcheck
reports "uninitialized global memory read" in the torch kernel here too, its reports on
our kernels reading cuBLAS outputs are the same false positive (writes initcheck does not
see, e.g. the bulk tensor stores of cuBLAS's Hopper epilogues), not a read of unwritten memory.

    compute-sanitizer --tool initcheck python3 dev/sanitize/initcheck_control.py
"""
import torch
from torch.nn import functional as F

gen = torch.Generator().manual_seed(0)
for T, H, I in [(1, 320, 96), (40, 320, 96), (1001, 2048, 1408)]:
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    w = torch.randn(2 * I, H, generator=gen).to(torch.bfloat16).cuda()
    y = F.linear(x, w)              # cuBLAS
    z = F.silu(y[:, :I]) * y[:, I:]  # torch elementwise kernels read cuBLAS's output
    torch.cuda.synchronize()
    print(T, H, I, float(z.float().abs().sum()))
