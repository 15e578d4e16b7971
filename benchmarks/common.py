"""Shared benchmark machinery: model shapes, timing by CUDA-graph replay with
CUDA events, hardware ceilings measured in the same run, and the results file
format (command, commit, date, device, versions)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass(frozen=True)
class MoEShape:
    name: str
    hidden: int      # H
    inter: int       # I (per expert)
    experts: int     # E
    top_k: int       # K


# The paper's models, then today's fine-grained ones.
SHAPES: Dict[str, MoEShape] = {s.name: s for s in [
    MoEShape("mixtral-8x7b", 4096, 14336, 8, 2),
    MoEShape("mixtral-8x22b", 6144, 16384, 8, 2),
    MoEShape("minicpm-moe", 2304, 5760, 8, 2),
    MoEShape("openmoe-34b", 3072, 12288, 32, 2),
    MoEShape("deepseek-moe-16b", 2048, 1408, 64, 6),
    MoEShape("qwen1.5-moe", 2048, 1408, 60, 4),
    MoEShape("qwen3-30b-a3b", 2048, 768, 128, 8),
    MoEShape("olmoe", 2048, 1024, 64, 8),
    MoEShape("gpt-oss-20b", 2880, 2880, 32, 4),
]}


def git_commit() -> str:
    """The commit the results come from: $SAMOYEDS_COMMIT when the caller names it (a copy
    of the tree on another machine may carry a stale .git), else git's HEAD (+ "-dirty")."""
    if os.environ.get("SAMOYEDS_COMMIT", "unknown") != "unknown":
        return os.environ["SAMOYEDS_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("SAMOYEDS_COMMIT", "unknown")


def wgmma_runs() -> bool:
    """Whether the sm_90a kernels (ssmm's wgmma.sp, ssmm_dw's wgmma) run here: an sm_90
    device and a build that holds sm_90a code."""
    import samoyeds
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and "sm_90a" in str(samoyeds.build_info().get("cuda_archs", "")))


def environment() -> dict:
    import samoyeds
    env = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "samoyeds": samoyeds.build_info(),
        "nvcc_flags": os.environ.get("SAMOYEDS_NVCC_FLAGS"),  # A/B builds (dev/lab/ab_builds.sh)
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, sm_count=p.multi_processor_count, memory_gb=round(p.total_memory / 2**30, 1),
                   capability=f"{p.major}.{p.minor}")
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.strip()
            env["nvidia_smi"] = smi
        except OSError:
            pass
    try:
        import transformers
        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def gpu_dir(out: Optional[str]) -> str:
    """benchmarks/results/<gpu>/ (or --out when given)."""
    if out:
        os.makedirs(out, exist_ok=True)
        return out
    name = torch.cuda.get_device_name(0).lower() if torch.cuda.is_available() else "cpu"
    key = "h200" if "h200" in name else "h100" if "h100" in name else name.replace(" ", "_")
    d = os.path.join(HERE, "results", key)
    os.makedirs(d, exist_ok=True)
    return d


def _finite(x):
    """NaN and infinities as null (strict JSON)."""
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as fh:
        json.dump(_finite(payload), fh, indent=1, sort_keys=False, allow_nan=False)
    print(f"wrote {path}")


def time_graph(fn: Callable[[], None], *, inner: int = 1, min_reps: int = 10, budget_s: float = 0.25,
               warmup: int = 2) -> dict:
    """Median time (ms) of one call of fn, from CUDA-graph replays timed with
    CUDA events.  fn may run `inner` rotated copies; the result is per copy."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside capture: lazy initialisation, algorithm search
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    end.synchronize()
    first = start.elapsed_time(end)
    reps = max(min_reps, min(200, int(budget_s * 1e3 / max(first, 1e-3))))
    times: List[float] = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    times.sort()
    del g
    return {"ms": times[len(times) // 2], "min_ms": times[0], "max_ms": times[-1], "reps": reps}


def copy_rate_tb_s() -> float:
    """Device-to-device copy bandwidth of 2 GiB (read + write counted), TB/s."""
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src.random_(0, 255)
    t_cp = time_graph(lambda: dst.copy_(src), budget_s=0.5)["ms"]
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 2 * 2**30 / (t_cp * 1e-3) / 1e12


def measure_ceilings() -> dict:
    """Dense bf16 matmul rate (8192^3, random data), device copy bandwidth, and
    the issue rate of each tensor-core instruction form and the shared-memory fill rates
    (dev/peak/peak.py; None, with a note, where it cannot run here)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    t_mm = time_graph(lambda: torch.mm(a, b, out=c), budget_s=0.5)["ms"]
    del a, b, c
    ceil = {
        "dense_bf16_tflops": 2 * n ** 3 / (t_mm * 1e-3) / 1e12,
        "copy_tb_s": copy_rate_tb_s(),
    }
    ceil.update(tensor_core_rates())
    ceil.update(shared_fill_rates())
    return ceil


PEAK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dev", "peak")
# the kinds recorded when dev/peak cannot run (the keys stay in the JSON, as null)
TENSOR_CORE_KINDS = ("mma", "mma_sp", "wgmma", "wgmma_sp", "wgmma_sp_n64", "wgmma_sp_ss", "wgmma_sp_ss_n96",
                     "wgmma_sp_ss_n64")
FILL_KINDS = ("tma", "cp_async", "cp_async_gather", "tma_and_gather", "tma_multicast", "tma_rows")


def peak_module():
    """(dev/peak/peak.py imported, None) or (None, the reason it is unavailable): the issue-rate
    and fill-rate probes are not part of the package; they build with nvcc on first use."""
    if PEAK_DIR not in sys.path:
        sys.path.insert(0, PEAK_DIR)
    try:
        import peak
    except Exception as exc:  # noqa: BLE001 -- no dev/peak in this tree, or it fails to import
        return None, f"dev/peak/peak.py not importable: {error_text(exc)}"
    try:
        if not peak.available():
            return None, "dev/peak unavailable here (no nvcc or no GPU)"
    except Exception as exc:  # noqa: BLE001
        return None, f"dev/peak: {error_text(exc)}"
    return peak, None


def require_peak(script: str):
    """dev/peak/peak.py for a script that measures nothing else; exits naming why not."""
    peak, why = peak_module()
    if peak is None:
        raise SystemExit(f"{script}: {why}")
    return peak


def tensor_core_rates(device: Optional[int] = None) -> Dict[str, Optional[float]]:
    """{"<kind>_tflops": rate} for every tensor-core instruction form (dev/peak/peak.py's
    tensor_core_rate, dense-equivalent TFLOP/s); None where it cannot run here (a wgmma kind
    off sm_90, no nvcc, no dev/peak), with the reason under "tensor_core_note"."""
    peak, why = peak_module()
    kinds = tuple(peak.TENSOR_CORE_KINDS) if peak else TENSOR_CORE_KINDS
    out: Dict[str, Optional[float]] = {f"{k}_tflops": None for k in kinds}
    if peak is None:
        print(f"tensor-core rates: not measured ({why})", file=sys.stderr)
        out["tensor_core_note"] = why
        return out
    device = torch.cuda.current_device() if device is None else device
    torch.cuda.synchronize(device)
    for kind in kinds:
        try:
            out[f"{kind}_tflops"] = peak.tensor_core_rate(kind, device)
        except (NotImplementedError, RuntimeError, OSError) as exc:
            print(f"tensor-core rate {kind}: not measured ({error_text(exc)})", file=sys.stderr)
    return out


def shared_fill_rates(device: Optional[int] = None) -> Dict[str, Optional[float]]:
    """{"fill_<kind>_tb_s", "fill_<kind>_b_per_clk_sm", "fill_<kind>_sm_mhz"} for every way
    of filling shared memory from L2 (dev/peak/peak.py's shared_fill_rate); None where it
    cannot run here (off sm_90, no nvcc, no dev/peak), with the reason under "fill_note"."""
    peak, why = peak_module()
    kinds = tuple(peak.FILL_KINDS) if peak else FILL_KINDS
    out: Dict[str, Optional[float]] = {}
    if peak is None:
        print(f"shared-memory fill rates: not measured ({why})", file=sys.stderr)
        out["fill_note"] = why
    else:
        device = torch.cuda.current_device() if device is None else device
        torch.cuda.synchronize(device)
    for kind in kinds:
        r = {}
        if peak is not None:
            try:
                r = peak.shared_fill_rate(kind, device)
            except (NotImplementedError, RuntimeError, OSError) as exc:
                print(f"shared-memory fill rate {kind}: not measured ({error_text(exc)})", file=sys.stderr)
        out[f"fill_{kind}_tb_s"] = r.get("tb_per_s")
        out[f"fill_{kind}_b_per_clk_sm"] = r.get("bytes_per_clock_per_sm")
        out[f"fill_{kind}_sm_mhz"] = r.get("sm_clock_mhz")
    return out


# Bytes of one k-tile stage of the warp-specialised wgmma.sp kernel (docs/KERNELS.md, "Tiles"):
# packed values + tokens + metadata (+ row-selection indices for 1:M:V), by tile (storage rows x
# tokens; 2:4 runs 256 x 128, 1:2:V one of the other three).
WS_TILE = {"256x128": {"rows": 256, "tokens": 128, "stage_bytes": 16384 + 16384 + 2048},
           "128x128": {"rows": 128, "tokens": 128, "stage_bytes": 8192 + 16384 + 1024 + 128},
           "256x64": {"rows": 256, "tokens": 64, "stage_bytes": 16384 + 8192 + 2048 + 256},
           "256x96": {"rows": 256, "tokens": 96, "stage_bytes": 16384 + 12288 + 2048 + 256}}


def ws_tile_name(m: int, tall: int) -> str:
    """The WS_TILE key of the tile that runs: `m` the format's M (1 for 2:4), `tall` the token
    count ws_tall_tile gives 1:2:V (0 for 128 x 128)."""
    return "256x128" if m == 1 else f"256x{tall}" if tall else "128x128"


# The wgmma.sp form each tile's consumers issue (dev/peak tensor_core_rate kinds): the packed
# values read from shared memory, N = the tile's tokens
WS_TILE_FORM = {"256x128": "wgmma_sp_ss", "128x128": "wgmma_sp_ss", "256x96": "wgmma_sp_ss_n96",
                "256x64": "wgmma_sp_ss_n64"}


def _config_tile() -> str:
    """samoyeds.get_config().tile ("auto" where the package has no config)."""
    import samoyeds as sm
    get = getattr(sm, "get_config", None)
    return get().tile if get else "auto"


def ws_tall_tile(storage_rows: int, S: int, E: int, tokens_by_tma: bool, sm_count: int) -> int:
    """The token count of 1:2:V's tile of 256 rows (64 or 96), 0 for 128 x 128: the rule of
    ws_tall_tile in cuda/ssmm.cu (gathered token rows: 64; rows by TMA: 96 from 256 rows per
    routed expert where it pads no more than 128 x 128 and its items fill the SMs, else 64
    where it pads at least 3 % less work than 128 x 128 and its items fill the SMs),
    samoyeds.config(tile=...) overriding it."""
    tile = _config_tile()
    if tile != "auto":
        return {"256x96": 96, "256x64": 64}.get(tile, 0)
    if not tokens_by_tma:
        return 64
    routed = min(E, S)
    rt_tall, rt_128 = -(-storage_rows // 256), -(-storage_rows // 128)
    work_tall = rt_tall * 256.0 * (S + 32.0 * routed)
    work_128 = rt_128 * 128.0 * (S + 64.0 * routed)
    work_96 = rt_tall * 256.0 * (S + 48.0 * routed)
    if S >= 256.0 * routed and work_96 <= work_128 and rt_tall * (S / 96.0 + routed / 2.0) >= sm_count:
        return 96
    return 64 if work_tall < 0.97 * work_128 and rt_tall * (S / 64.0 + routed / 2.0) >= sm_count else 0


def ws_stream_bytes(m: int, storage_rows: int, cols: int, counts, tall: int = 0) -> int:
    """Bytes the warp-specialised wgmma.sp kernel streams from L2 into shared memory for
    one projection: every work item (expert, row tile, token tile) loads one stage per
    64 columns.  `m` the format's M (1 for 2:4), `counts` the routed rows per expert,
    `tall`: the token count of 1:2:V's tile of 256 rows (ws_tall_tile), 0 for 128 x 128."""
    t = WS_TILE[ws_tile_name(m, tall)]
    row_tiles = -(-storage_rows // t["rows"])
    k_tiles = -(-cols // 64)
    items = sum(-(-c // t["tokens"]) for c in counts) * row_tiles
    return items * k_tiles * t["stage_bytes"]


def ceilings_line(ceil: dict) -> str:
    """The one-line summary of measure_ceilings() the scripts print."""
    def rate(k):
        v = ceil.get(f"{k}_tflops")
        return f"{v:.0f}" if v is not None and v == v else "-"
    kinds = [k[:-len("_tflops")] for k in ceil if k.endswith("_tflops") and k != "dense_bf16_tflops"]
    rates = ", ".join(f"{k} {rate(k)}" for k in kinds)

    def fill(k):
        tb, pc = ceil.get(f"fill_{k}_tb_s"), ceil.get(f"fill_{k}_b_per_clk_sm")
        return f"{tb:.2f} / {pc:.1f}" if tb is not None and pc is not None else "-"
    fills = ", ".join(f"{k} {fill(k)}" for k in FILL_KINDS if f"fill_{k}_tb_s" in ceil)
    return (f"ceilings: dense bf16 {ceil['dense_bf16_tflops']:.0f} TFLOP/s, copy {ceil['copy_tb_s']:.2f} TB/s; "
            f"tensor-core issue rate (dense-equivalent TFLOP/s): {rates}; shared-memory fill "
            f"(TB/s, B/clk/SM): {fills}")


# --- shared by the scripts that also run on the CPU (--tiny --device cpu) -----------------------

def add_run_args(ap, tiny_help: str = "small shapes: a quick CPU check of the script") -> None:
    """--device, --tiny, --out, --seed."""
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help=tiny_help)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/<gpu>; "
                                                "with --tiny nothing is written unless --out is given)")
    ap.add_argument("--seed", type=int, default=0)


def setup_run(args) -> None:
    """A --tiny CPU run uses one thread: the toy matmuls gain nothing from more, and
    spinning OpenMP threads on a busy machine make them 100x slower."""
    if args.device == "cpu" and args.tiny:
        torch.set_num_threads(1)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA GPU")


def result_path(args, name: str) -> Optional[str]:
    """Where a script writes its JSON: --out, else benchmarks/results/<gpu>/ (None for a
    --tiny run without --out)."""
    if args.tiny and not args.out:
        return None
    return os.path.join(gpu_dir(args.out), name)


def default_dtype(device: str) -> "torch.dtype":
    """bf16 on the GPU (the kernels' dtype); fp32 on the CPU (the C reference)."""
    return torch.bfloat16 if device == "cuda" else torch.float32


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def call_times(fn: Callable[[], object], device: str, *, budget_s: float = 0.3, min_iters: int = 3,
               max_iters: int = 50, warmup: int = 2) -> List[float]:
    """Milliseconds of single calls of fn() without graph capture, each started from an idle
    GPU (host work and launches included; after `warmup` untimed calls): CUDA events on a
    GPU, the wall clock on the CPU; min_iters, then more until budget_s or max_iters."""
    import time
    for _ in range(warmup):
        fn()
    sync(device)
    times: List[float] = []
    t_end = time.perf_counter() + budget_s
    while len(times) < min_iters or (len(times) < max_iters and time.perf_counter() < t_end):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def back_to_back_ms(fn: Callable[[], object], device: str, n: int) -> float:
    """Mean milliseconds per call of n calls of fn() enqueued back to back, one synchronisation
    at the end (after one untimed call): the next call's host work overlaps this one's GPU
    work, as in a model's forward or a training loop.  CUDA events on a GPU, the wall clock
    on the CPU."""
    import time
    if device != "cuda":
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) * 1e3 / n
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def time_ms(fn: Callable[[], object], device: str, *, budget_s: float = 0.3, min_iters: int = 3,
            max_iters: int = 50, warmup: int = 2) -> dict:
    """Median milliseconds of fn() without graph capture (host work and launches
    included): CUDA events on a GPU, the wall clock on the CPU."""
    times = sorted(call_times(fn, device, budget_s=budget_s, min_iters=min_iters, max_iters=max_iters,
                              warmup=warmup))
    return {"ms": times[len(times) // 2], "min_ms": times[0], "max_ms": times[-1], "reps": len(times)}


def peak_mib(fn: Callable[[], object], device: str) -> float:
    """Peak GPU memory of one fn() call above what was allocated before (NaN on the CPU)."""
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def is_oom(exc: BaseException) -> bool:
    """An allocation failure (torch's allocator, cuBLAS workspaces, the driver)."""
    if isinstance(exc, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)):
        return True
    msg = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in msg or "CUBLAS_STATUS_ALLOC_FAILED" in msg)


def free_memory(device: str) -> None:
    """Releases what unreachable tensors hold (reference cycles included) back to the device."""
    if device == "cuda":
        import gc
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def add_job_args(ap, unit: str) -> None:
    """--isolate (one process per `unit`; auto: on the GPU) and the hidden --job / --job-out with
    which run_isolated starts the process of one job."""
    import argparse
    ap.add_argument("--isolate", default="auto", choices=["auto", "yes", "no"],
                    help=f"one process per {unit} (auto: on the GPU)")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--job-out", help=argparse.SUPPRESS)


def isolating(args) -> bool:
    """Whether each job runs in a process of its own (add_job_args' --isolate)."""
    return args.isolate == "yes" or (args.isolate == "auto" and args.device == "cuda")


def run_isolated(script: str, job: dict, extra_args: List[str]) -> dict:
    """Runs ``script --job JSON --job-out FILE extra_args`` in a fresh process and
    returns what it wrote to FILE.  A crash (a sticky CUDA error, a segfault)
    ends that process only; it comes back as ``{"error": ...}``."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "job.json")
        cmd = [sys.executable, script, "--job", json.dumps(job), "--job-out", out] + list(extra_args)
        p = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
        if p.stderr:
            sys.stderr.write(p.stderr)
        if p.returncode == 0 and os.path.exists(out):
            with open(out) as fh:
                return json.load(fh)
        tail = " | ".join(p.stderr.strip().splitlines()[-4:]) if p.stderr else ""
        return {"error": f"job process exited with status {p.returncode}: {tail[-600:]}"}
