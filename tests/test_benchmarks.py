"""The benchmark scripts' own logic on the CPU: the largest-batch search, model
depth fitting from real configs, the breakdown variants computing the same
function, one-process-per-job isolation, the suite's entry point, the ceilings
without dev/peak, and the generated README / docs/RESULTS.md."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)

import bench_memory  # noqa: E402
import lm  # noqa: E402
from helpers import run_python  # noqa: E402


def _fits_below(limit, fatal_at=None):
    calls = []

    def fits(n):
        calls.append(n)
        if fatal_at is not None and n >= fatal_at:
            return False, {"why": "RuntimeError: boom, ", "fatal": True}
        return n <= limit, ({"peak_gib": 1.0 + 0.5 * n} if n <= limit else {"why": "out of memory, "})
    return fits, calls


@pytest.mark.parametrize("limit", [0, 1, 2, 3, 7, 64, 100, 1000])
def test_search_finds_the_exact_limit(limit):
    fits, calls = _fits_below(limit)
    r = bench_memory.search_max(fits, cap=4096)
    assert r["max"] == limit and not r["capped"] and r["error"] is None
    assert r["first_failure"] == limit + 1
    assert len(calls) <= 2 * max(1, limit).bit_length() + 2


def test_search_with_a_prediction_probes_near_it():
    fits, calls = _fits_below(500)
    r = bench_memory.search_max(fits, cap=4096, predict=lambda probes: 510.0, tolerance=1 / 32)
    assert 500 - 500 // 32 <= r["max"] <= 500
    assert calls[:3] == [1, 2, 459] and len(calls) <= 8


def test_search_stops_at_the_cap_and_on_other_errors():
    fits, _ = _fits_below(1000)
    r = bench_memory.search_max(fits, cap=37)
    assert r["max"] == 37 and r["capped"]
    fits, calls = _fits_below(1000, fatal_at=16)
    r = bench_memory.search_max(fits, cap=4096)
    assert r["max"] == 8 and r["error"] == "RuntimeError: boom" and calls[-1] == 16


def test_token_cap():
    cfg = lm.config("mixtral-8x7b")
    assert bench_memory.token_cap(cfg, "grouped_mm", False)[0] == (2**31 - 1) // 2
    cap, why = bench_memory.token_cap(cfg, "samoyeds", False)
    assert cap == (2**32 - 1) // (2 * 14336) and "32-bit" in why
    assert bench_memory.token_cap(cfg, "samoyeds", True)[0] == (2**31 - 1) // 2


def test_real_configs_and_depth():
    for name, params in (("qwen3-30b-a3b", 30.5e9), ("olmoe-1b-7b", 6.9e9), ("deepseek-v2-lite", 15.7e9),
                         ("mixtral-8x7b", 46.7e9)):
        fixed, layers, count = lm.layer_bytes(lm.config(name), torch.bfloat16)
        assert abs(count - params) / params < 0.01
        assert len(layers) == lm.real_layers(name)
    cfg = lm.config("mixtral-8x7b")
    depth = lm.fit_depth(cfg, torch.bfloat16, 70 * 2**30)
    assert 20 <= depth < 32                                   # 93 GB dense do not fit
    assert lm.fit_depth(lm.config("qwen3-30b-a3b"), torch.bfloat16, 70 * 2**30) == 48


def test_layerwise_build_runs_the_hook_and_leaves_nothing_on_meta():
    seen = []
    model = lm.build("deepseek-v2-lite", "cpu", torch.float32, tiny=True, on_layer=lambda i, layer: seen.append(i))
    assert seen == [0, 1, 2]
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(3, 200, (1, 8))).logits).all()


def _run(args, **kw):
    """A script in its own process, importing the samoyeds these tests import (an installed one,
    or the tree built in place)."""
    if args[0] != "-c":  # (a script's own folder leads its path; -c code starts in a temporary folder)
        kw.setdefault("cwd", ROOT)
    return run_python(args, **kw)


def test_breakdown_variants_compute_the_same_layer(tmp_path):
    p = _run([os.path.join(BENCH, "bench_breakdown.py"), "--tiny", "--device", "cpu", "--out", str(tmp_path),
              "--models", "qwen3-30b-a3b"])
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads((tmp_path / "breakdown.json").read_text())
    m = d["cases"][0]["methods"]
    assert set(m) >= set(d["variants"]) | {"dense_grouped_mm", "dense_eager"}
    for name, r in m.items():
        assert r["rel_err_vs_e"] < 1e-5, (name, r)


def test_memory_jobs_in_their_own_process(tmp_path):
    p = _run([os.path.join(BENCH, "bench_memory.py"), "--tiny", "--device", "cpu", "--isolate", "yes",
              "--scopes", "layer", "--layer-models", "mixtral-8x7b", "--out", str(tmp_path)])
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads((tmp_path / "memory.json").read_text())
    (case,) = d["cases"]
    assert case["scope"] == "layer" and case["methods"]["samoyeds"]["max"] == 5
    assert case["methods"]["grouped_mm"]["first_failure"] == 6 and "--isolate yes" in d["env"]["command"]


def test_e2e_dynamic_and_static_cache(tmp_path):
    """bench_e2e --tiny on the CPU: decode rows for both KV caches and both methods; the static
    rows compiled (generate told to compile on the CPU, backend eager) with no graph break,
    their compile time apart from the timed calls, the same greedy tokens as grouped_mm; the
    report's table and headline name both caches."""
    import report

    p = _run([os.path.join(BENCH, "bench_e2e.py"), "--tiny", "--device", "cpu", "--models", "olmoe-1b-7b",
              "--prefill-batches", "1", "--decode-batches", "1,4", "--gpu-time", "--out", str(tmp_path)])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    d = json.loads((tmp_path / "e2e.json").read_text())
    assert d["settings"]["cache"] == ["dynamic", "static"] and d["settings"]["compile_backend"] == "eager"
    (case,) = d["cases"]
    for method in ("grouped_mm", "samoyeds"):
        rows = case["methods"][method]["decode"]
        assert [(r["cache"], r["batch"]) for r in rows] == [("dynamic", 1), ("dynamic", 4), ("static", 1),
                                                             ("static", 4)]
        for r in rows:
            assert "tokens_per_s" in r and r["prefill_tokens_per_s"] > 0, r
            assert "gpu_ms_per_step" not in r, r  # --gpu-time: the GPU's busy time, on a GPU only
            if r["cache"] == "static":
                assert r["graphs"] >= 1 and r["graph_breaks"] == 0 and r["compile_s"] >= 0, r
                assert r["fresh_cache_tokens_identical"], r
    for r in case["methods"]["samoyeds"]["decode"]:
        assert r["greedy_tokens_identical"] == "8/8" and r["speedup_vs_grouped_mm"] > 0
    table = report.e2e_table(d)
    assert table.count("static cache (compiled)") == 2 and table.count("decode, dynamic cache") == 2
    assert "decode-sta" in p.stdout and "decode-dyn" in p.stdout


def test_run_all(tmp_path):
    p = _run([os.path.join(BENCH, "run_all.py"), "--only", "sweep", "--tiny", "--device", "cpu",
              "--out", str(tmp_path)])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    s = json.loads((tmp_path / "run_all.json").read_text())
    assert [x["step"] for x in s["steps"]] == ["sweep"] and s["steps"][0]["rc"] == 0
    assert (tmp_path / "sweep.json").exists() and (tmp_path / "sweep.log").exists()
    p = _run([os.path.join(BENCH, "run_all.py"), "--only", "nope", "--out", str(tmp_path)])
    assert p.returncode != 0 and "unknown steps" in p.stderr


def test_moe_bench_times_every_method_in_turns(monkeypatch):
    """bench_moe on the CPU (toy shapes): every method timed in each of the ROUNDS turns,
    the three timings recorded (GPU time only on CUDA), the ratios from the medians, and
    the report's tables built from the result."""
    import bench_moe
    import report

    monkeypatch.setattr(bench_moe, "BUDGET_S", 0.01)
    rows = bench_moe.bench_model("olmoe", [1, 5], "samoyeds-1:2:128", ["grouped_mm", "samoyeds"], "cpu",
                                 torch.float32, tiny=True, seed=0)
    assert [r["T"] for r in rows] == [1, 5]
    for r in rows:
        g, s = r["methods"]["grouped_mm"], r["methods"]["samoyeds"]
        for m in (g, s):
            assert m["ms"] > 0 and m["ms_stream"] > 0 and m["ms_gpu"] is None
            assert m["calls"] >= 2 * bench_moe.ROUNDS  # at least two timed calls per turn
        assert s["speedup_vs_grouped_mm"] == pytest.approx(g["ms"] / s["ms"])
        assert s["speedup_stream_vs_grouped_mm"] == pytest.approx(g["ms_stream"] / s["ms_stream"])
        assert "speedup_gpu_vs_grouped_mm" not in s
        assert r["rel_err_vs_dense_masked"] < 1e-4  # fp32 on the CPU: the same masked weights
    table = report.moe_table({"cases": rows})
    assert table.count("\n") == 1 + len(rows)
    first = table.split("\n")[2]
    assert f"| {rows[0]['methods']['samoyeds']['speedup_vs_grouped_mm']:.2f}x |" in first
    assert "| -x |" in first  # no GPU time on the CPU: shown as missing, not as a number


def test_layer_trace_table():
    """report.layer_trace_table (the lab's layer_trace.json, dev/lab/layer_trace.py): the shares
    and the ratio come from the kernel groups."""
    import report

    case = {"model": "olmoe", "T": 4096, "methods": {
        "grouped_mm": {"total_us": 2000.0, "groups_us": {"expert matmuls": 800.0, "elementwise / reductions": 1200.0}},
        "samoyeds": {"total_us": 800.0, "groups_us": {"expert matmuls": 700.0, "combine": 60.0, "routing": 40.0}}}}
    table = report.layer_trace_table({"cases": [case]})
    assert "| olmoe | 4096 | 2000 us | 40% | 800 us | 88% | combine 60 us, routing 40 us | 2.50x |" in table


def test_ws_tile_rule_and_stream_bytes():
    """benchmarks/common.py's mirror of the tile rule (docs/KERNELS.md, "Selection") on the shapes
    it was set from, samoyeds.config(tile=...) overriding it, and ws_stream_bytes counting the
    stages of that tile: one per (expert's token tile, row tile, 64 columns)."""
    import common
    import samoyeds as sm
    # (storage rows, S, E, rows by TMA, SMs) -> token count of the tile (0: 128 x 128)
    assert common.ws_tall_tile(2048, 8192, 8, False, 132) == 64    # gathered rows (gate_up): 256 x 64
    assert common.ws_tall_tile(2048, 8192, 8, True, 132) == 96     # Mixtral down at T = 4096: long tiles
    assert common.ws_tall_tile(1024, 32768, 128, True, 132) == 96  # Qwen3 down at T = 4096: 256 per expert
    assert common.ws_tall_tile(1024, 8192, 128, True, 132) == 64   # Qwen3 down at T = 1024: 64 per expert
    assert common.ws_tall_tile(1152, 32768, 8, True, 132) == 0     # MiniCPM down: 256-row tiles overhang
    assert common.ws_tall_tile(2048, 512, 8, True, 132) == 0       # Mixtral down at T = 256: too few items
    for tile, want in (("128x128", 0), ("256x64", 64), ("256x96", 96)):
        with sm.config(tile=tile):
            assert common.ws_tall_tile(2048, 8192, 8, False, 132) == want
    assert common.ws_tall_tile(2048, 8192, 8, False, 132) == 64  # the override ends with the block
    assert [common.ws_tile_name(1, 0), common.ws_tile_name(2, 0), common.ws_tile_name(2, 96)] == \
        ["256x128", "128x128", "256x96"]
    counts = [100, 0, 200]  # token tiles of 96: 2 + 0 + 3; of 128: 1 + 0 + 2
    stage96, stage128 = (common.WS_TILE[k]["stage_bytes"] for k in ("256x96", "128x128"))
    assert common.ws_stream_bytes(2, 512, 4096, counts, 96) == 5 * 2 * 64 * stage96
    assert common.ws_stream_bytes(2, 512, 4096, counts) == 3 * 4 * 64 * stage128


def test_tile_forms_are_probe_kinds():
    """Every warp-specialised tile names the wgmma.sp form its consumers issue, a kind the
    issue-rate probe (dev/peak) measures, with N = the tile's tokens."""
    import common
    assert set(common.WS_TILE_FORM) == set(common.WS_TILE)
    kinds = set(common.TENSOR_CORE_KINDS)
    peak, _ = common.peak_module()
    if peak is not None:
        kinds = set(peak.TENSOR_CORE_KINDS)
    for tile, kind in common.WS_TILE_FORM.items():
        assert kind in kinds, (tile, kind)
        assert kind.startswith("wgmma_sp_ss")
        parts = kind.split("_n")
        assert (int(parts[1]) if len(parts) == 2 else 128) == int(tile.split("x")[1]), (tile, kind)


def test_ceilings_recorded_as_null_without_the_probes(monkeypatch, tmp_path):
    """Without dev/peak (or without nvcc / a GPU) the issue-rate and fill-rate ceilings are
    recorded as null, every key present, with the reason; nothing raises."""
    import common
    monkeypatch.setattr(common, "PEAK_DIR", str(tmp_path / "no-peak"))
    monkeypatch.delitem(sys.modules, "peak", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not p.endswith(os.path.join("dev", "peak"))])
    peak, why = common.peak_module()
    assert peak is None and "dev/peak" in why
    tc = common.tensor_core_rates()
    assert all(tc[f"{k}_tflops"] is None for k in common.TENSOR_CORE_KINDS) and "dev/peak" in tc["tensor_core_note"]
    fill = common.shared_fill_rates()
    assert all(fill[f"fill_{k}_tb_s"] is None for k in common.FILL_KINDS) and fill["fill_note"]
    line = common.ceilings_line({"dense_bf16_tflops": 700.0, "copy_tb_s": 3.0, **tc, **fill})
    assert "wgmma_sp -" in line and "700 TFLOP/s" in line


def test_kept_benchmarks_set_no_switches():
    """The benchmarks users run choose kernels with impl= and samoyeds.config(...), never with
    SAMOYEDS_* environment variables (benchmark-harness variables aside, and SAMOYEDS_PDL, the one
    the package reads, which bench_decode sets only for a build from before samoyeds.config)."""
    harness = {"SAMOYEDS_PDL", "SAMOYEDS_COMMIT", "SAMOYEDS_NVCC_FLAGS", "SAMOYEDS_NOTEBOOK_SMOKE", "SAMOYEDS_RESULTS",
               "SAMOYEDS_CUDA_ARCHS", "SAMOYEDS_BUILD_JOBS", "SAMOYEDS_SANITIZE_TOOL"}
    import re
    for f in sorted(os.listdir(BENCH)):
        if not f.endswith((".py", ".sh")) or f == "sanitize_cases.py":
            continue
        text = open(os.path.join(BENCH, f)).read()
        used = set(re.findall(r"SAMOYEDS_[A-Z_]+", text)) - harness
        assert not used, (f, used)
        assert "tensor_core_rate(" not in text.replace("peak.tensor_core_rate(", ""), f
        assert "_C.TENSOR_CORE_KINDS" not in text and "samoyeds.routing" not in text, f


def test_decode_table_back_to_back_columns():
    """report.decode_table: with and without the back-to-back timings every row of both tables
    has as many cells as its header, and the back-to-back figures land in their columns."""
    import bench_decode
    import report

    assert bench_decode.stream_copies(1) == bench_decode.MAX_COPIES
    assert bench_decode.stream_copies(10 * bench_decode.STREAM_BYTES) == 2
    assert bench_decode.stream_copies(bench_decode.STREAM_BYTES // 4) == 4
    assert bench_decode.stream_copies(bench_decode.STREAM_BYTES // 4 - 1) == 5  # at least STREAM_BYTES in all
    proj = dict(model="m", proj="down", T=16, S=128, E=64, routed_experts=50, bytes=70e6, decode_ms=0.04,
                decode_tb_s=1.75, frac_of_copy=0.72, copy_same_bytes_ms=0.03, frac_of_copy_same_bytes=0.75,
                ms={"decode": 0.04, "mma_sp": 0.08, "wgmma_sp": 0.036})
    block = dict(model="m", proj="block", T=16, ms={"auto": 0.1, "auto/serial": 0.105, "decode": 0.1,
                                                    "mma_sp": 0.2, "wgmma_sp": 0.12})
    b2b_proj = dict(proj, stream_copies=4, stream_ms={"decode": 0.035, "wgmma_sp": 0.034}, decode_stream_ms=0.035,
                    decode_stream_tb_s=2.0, frac_of_copy_stream=0.823, frac_of_copy_same_bytes_stream=0.781)
    b2b_block = dict(block, bytes=210e6, frac_of_copy=0.86, stream_copies=2, auto_stream_ms=0.0987,
                     frac_of_copy_stream=0.874, stream_ms={"auto": 0.0987, "wgmma_sp": 0.118})
    for rows, extra in (([proj, block], 0), ([b2b_proj, b2b_block], 4)):
        tables = report.decode_table({"rows": rows}).split("\n\n")
        assert len(tables) == 2
        for t in tables:
            lines = t.split("\n")
            assert len(lines) == 3
            assert len({line.count("|") for line in lines}) == 1, t
        assert tables[0].split("\n")[0].count("|") == 13 + extra
        assert tables[1].split("\n")[0].count("|") == 9 + extra
    tables = report.decode_table({"rows": [b2b_proj, b2b_block]}).split("\n\n")
    assert "| 0.035 ms | 2.00 | 82% | 78% |" in tables[0]
    assert "| 210.0 | 86% | 0.099 ms | 87% |" in tables[1]


README_COMMANDS = ('pip install torch==2.13.0 ".[hf]" && samoyeds demo',
                   'pip install torch==2.13.0 ".[test]" && pytest tests -q')


def test_readme_and_results_are_generated_from_the_json():
    """README.md's results block and docs/RESULTS.md are what report.py makes from the committed
    JSON (run `python benchmarks/report.py --write` after a results change); the README stays a
    few screens with at most 12 result rows and the two set-up commands, each in its own block."""
    import report

    assert report.write(check=True) == [], "stale: run python benchmarks/report.py --write"
    readme = open(report.README).read()
    assert len(readme.splitlines()) <= 250
    block = readme[readme.index(report.BEGIN):readme.index(report.END)]
    rows = [ln for ln in block.splitlines() if ln.startswith("| ") and not ln.startswith("| what")]
    assert 0 < len(rows) <= 14
    for cmd in README_COMMANDS:
        assert f"```bash\n{cmd}\n```" in readme, cmd


def test_report_block_replacement():
    """_replace_block rewrites only what lies between the markers, and refuses a text without them."""
    import report

    text = f"a\n{report.BEGIN}\nold\n{report.END}\nb\n"
    assert report._replace_block(text, "new") == f"a\n{report.BEGIN}\nnew\n{report.END}\nb\n"
    with pytest.raises(ValueError, match="results"):
        report._replace_block("no markers", "new")


def test_docs_name_files_that_exist():
    """Every path under benchmarks/, dev/lab/, docs/ and examples/ that the README and docs/ name
    (scripts, results, figures, docs) exists: nothing points at a script or a results file that
    moved. (Source paths under cuda/, csrc/, samoyeds/ are the other helpers' to keep.)"""
    import glob
    import re
    docs = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                recursive=True))
    pat = re.compile(r"(?<![\w/.-])((?:\.\./)*(?:benchmarks|dev/lab|docs|examples)/"
                     r"[\w./-]*\.(?:py|sh|json|txt|md|png|ipynb))")
    missing = []
    for d in docs:
        for m in pat.finditer(open(d).read()):
            rel = m.group(1)
            cands = [os.path.normpath(os.path.join(os.path.dirname(d), rel)), os.path.join(ROOT, rel.lstrip("./"))]
            if not any(os.path.exists(c) for c in cands):
                missing.append((os.path.relpath(d, ROOT), rel))
    assert not missing, missing


def test_readme_snippets_run():
    """The README's Python blocks (the API in ten lines, a Hugging Face model in five) run as
    written, here on the CPU (the C reference), in a process of their own."""
    import re
    readme = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert [len(b.strip().splitlines()) for b in blocks] == [10, 5]
    for b in blocks:
        p = _run(["-c", b], timeout=600)
        assert p.returncode == 0, (b, p.stderr[-2000:])


def test_load_plan_spreads_shards_and_refuses_what_does_not_fit(monkeypatch, tmp_path):
    """bench_load's storage plan: shards fill the folders in order (one filesystem counted once,
    memory-backed folders no further than the memory available less the reserve); too little
    room in all stops it before anything is written, saying what it needs and found."""
    import collections
    import bench_load

    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
    Usage = collections.namedtuple("Usage", "total used free")
    free = {str(a): 10 * 2**30, str(b): 10 * 2**30, str(c): 100 * 2**30}
    monkeypatch.setattr(bench_load.shutil, "disk_usage", lambda p: Usage(0, 0, free[str(p)]))
    monkeypatch.setattr(bench_load, "fs_id", lambda p: {str(a): 1, str(b): 1, str(c): 2}[str(p)])
    monkeypatch.setattr(bench_load, "is_ram_fs", lambda p: str(p) == str(c))
    monkeypatch.setattr(bench_load, "mem_available", lambda: 30 * 2**30)
    sizes = [4 * 2**30] * 6
    usable, placement = bench_load.plan_storage(sizes, [str(a), str(b), str(c)], 2**30, 10 * 2**30)
    assert [u["root"] for u in usable] == [str(a), str(c)]          # b shares a's filesystem
    assert usable[1]["capacity"] == 20 * 2**30 and usable[1]["ram"]  # memory 30 GiB less the reserve
    assert placement == [0, 0, 1, 1, 1, 1]
    with pytest.raises(SystemExit, match=r"needs 32\.0 GiB .*--layers N"):
        bench_load.plan_storage(sizes + [4 * 2**30] * 2, [str(a), str(c)], 2**30, 10 * 2**30)


def test_load_packs_a_sharded_hub_checkpoint(monkeypatch, tmp_path):
    """bench_load --tiny on the CPU, in process: the Hub-layout checkpoint (Mixtral's per-expert
    w1/w2/w3) spread over two folders (shards linked into the first) loads packed, gives finite
    logits and tokens, and equals the dense load packed by patch_model; the folders are removed;
    the report's table shows the row."""
    import bench_load
    import report

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()

    def plan(sizes, roots, margin, reserve):
        return ([{"root": str(a), "capacity": 1 << 40, "ram": False}, {"root": str(b), "capacity": 1 << 40,
                                                                        "ram": True}],
                [i % 2 for i in range(len(sizes))])
    monkeypatch.setattr(bench_load, "plan_storage", plan)
    seen = {}
    real_load = bench_load.load

    def spy(path, *args, **kw):
        seen.setdefault("files", sorted(os.listdir(path)))
        seen.setdefault("links", sorted(f for f in os.listdir(path) if os.path.islink(os.path.join(path, f))))
        with open(os.path.join(path, "model.safetensors.index.json")) as fh:
            seen.setdefault("keys", set(json.load(fh)["weight_map"]))
        return real_load(path, *args, **kw)
    monkeypatch.setattr(bench_load, "load", spy)
    args = bench_load.parse_args(["--tiny", "--device", "cpu", "--model", "mixtral-8x7b"])
    try:
        r = bench_load.run(args)
    finally:
        bench_load._cleanup()
    assert not os.listdir(a) and not os.listdir(b)
    assert seen["links"] == ["model-00002-of-00003.safetensors"] and "config.json" in seen["files"]
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in seen["keys"]
    assert not any("gate_up_proj" in k for k in seen["keys"])
    assert r["patched"] and r["sanity"]["logits_finite"] and len(r["sanity"]["tokens"]) == 4
    assert r["dense"]["packed_logits_equal_patch_model"], r["dense"]
    assert r["expert_bytes_packed"] < r["dense_bytes"]
    r.update(seconds=1.0)
    table = report.load_table({"cases": [r]})
    assert "mixtral-8x7b | 2/2" in table and "finite logits, 4 tokens" in table


def test_e2e_update_merges_by_model(tmp_path):
    """bench_e2e --update: the models run now replace their cases in e2e.json, the others stay in
    their place, and "runs" records each run (newest first) for the provenance line."""
    import bench_e2e
    import report

    path = tmp_path / "e2e.json"
    old = {"env": {"commit": "aaa", "device": "X"}, "settings": {"cache": ["dynamic"]},
           "cases": [{"model": "a", "v": 1}, {"model": "b", "v": 1}, {"model": "c", "v": 1}]}
    path.write_text(json.dumps(old))
    new = {"env": {"commit": "bbb", "device": "X"}, "settings": {"cache": ["dynamic", "static"]},
           "cases": [{"model": "b", "v": 2}, {"model": "d", "v": 2}]}
    m = bench_e2e.merge_results(str(path), new)
    assert [(c["model"], c["v"]) for c in m["cases"]] == [("a", 1), ("b", 2), ("c", 1), ("d", 2)]
    assert [r["commit"] for r in m["runs"]] == ["bbb", "aaa"] and m["runs"][0]["models"] == ["b", "d"]
    assert m["env"]["commit"] == "bbb" and "commit aaa" in report.provenance(m)
    assert bench_e2e.merge_results(str(tmp_path / "none.json"), new) is new
