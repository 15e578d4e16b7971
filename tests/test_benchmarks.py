"""The benchmark scripts' own logic on the CPU: the largest-batch search, model
depth fitting from real configs, the breakdown variants computing the same
function, one-process-per-job isolation, and the suite's entry point."""
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
    return subprocess.run([sys.executable] + args, capture_output=True, text=True, cwd=ROOT, **kw)


def test_breakdown_variants_compute_the_same_layer(tmp_path):
    p = _run([os.path.join(BENCH, "bench_breakdown.py"), "--tiny", "--device", "cpu", "--out", str(tmp_path),
              "--models", "qwen3-30b-a3b"])
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads((tmp_path / "breakdown.json").read_text())
    m = d["cases"][0]["methods"]
    assert set(m) >= set(d["variants"]) | {"dense_grouped_mm", "dense_eager"}
    for name, r in m.items():
        assert r["rel_err_vs_e"] < 1e-5, (name, r)


def test_dense_decode_benchmark_smoke(tmp_path):
    """bench_dense_decode.py's CPU smoke run: the C reference and the torch MLP on the same toy
    weights agree with the float64 MLP, and the JSON holds every token count."""
    p = _run([os.path.join(BENCH, "bench_dense_decode.py"), "--tiny", "--device", "cpu", "--out", str(tmp_path),
              "--tokens", "1,3,17"])
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads((tmp_path / "dense_decode.json").read_text())
    assert [r["T"] for r in d["rows"]] == [1, 3, 17]
    for r in d["rows"]:
        assert r["rel_err_vs_fp64"] < 1e-5 and r["ms"]["dense_decode"] > 0 and r["frac_of_copy"] is None, r


def test_router_benchmark_smoke(tmp_path):
    """bench_router.py's CPU smoke run: each toy router is patched, the C reference chooses the
    experts the module's own forward chooses, and the JSON holds every token count."""
    p = _run([os.path.join(BENCH, "bench_router.py"), "--tiny", "--device", "cpu", "--out", str(tmp_path),
              "--tokens", "1,37"])
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads((tmp_path / "router.json").read_text())
    assert [(r["model"], r["T"]) for r in d["rows"]] == [
        (m, t) for m in ("tiny-deepseek", "tiny-gpt-oss", "tiny-deepseek-v3") for t in (1, 37)]
    for r in d["rows"]:
        assert r["patched"] and r["rows_choosing_differently"] == 0 and r["max_abs_logit_diff"] < 1e-2, r
        assert r["ms"]["samoyeds"] > 0 and r["frac_of_copy"] is None, r


def test_router_benchmark_counts_ties():
    """bench_router's tie rule: a token that takes other experts is a tie where the values it
    chooses by are equal within bfloat16 rounding, or, for a group-limited router, where the
    groups it takes differently score equal within that rounding; not otherwise."""
    import bench_router
    from samoyeds.hf import RouterSpec

    flat = RouterSpec(2, mode="softmax_topk")
    key = torch.tensor([3.0, 1.0, 1.0 + 2 ** -10, -2.0])
    assert bench_router._tie(key, torch.tensor([0, 1]), torch.tensor([0, 2]), flat)
    assert not bench_router._tie(key, torch.tensor([0, 3]), torch.tensor([0, 2]), flat)
    grouped = RouterSpec(2, mode="softmax_topk", n_group=4, topk_group=2)  # 8 experts, groups of 2
    key = torch.tensor([4.0, -9.0, 2.0, -9.0, 2.0, 0.5, -9.0, -9.0])
    # groups 1 and 2 tie for the second place (their best expert 2.0): experts 2 (2.0) and 5
    # (0.5) differ in value, but the groups they come from tie
    assert bench_router._tie(key, torch.tensor([0, 2]), torch.tensor([0, 5]), grouped)
    assert not bench_router._tie(key, torch.tensor([0, 2]), torch.tensor([0, 5]), flat)
    key[4] = 1.0  # group 2 now below group 1: taking it is not a tie
    assert not bench_router._tie(key, torch.tensor([0, 4]), torch.tensor([0, 2]), grouped)
    assert not bench_router._tie(key, torch.tensor([0, 4]), torch.tensor([0, 2]), None)


def test_shared_mlp_benchmark_smoke(tmp_path):
    """bench_shared_mlp.py's CPU smoke run: the torch MLP and the path with samoyeds.glu agree
    with the float64 MLP."""
    p = _run([os.path.join(BENCH, "bench_shared_mlp.py"), "--tiny", "--device", "cpu", "--out", str(tmp_path)])
    assert p.returncode == 0, p.stderr[-2000:]
    (r,) = json.loads((tmp_path / "shared_mlp.json").read_text())["rows"]
    assert r["T"] == 40 and max(r["rel_err_vs_fp64"].values()) < 1e-5 and r["ms"]["samoyeds"] > 0, r


def test_shared_stream_probe_smoke(tmp_path):
    """probe_shared_stream.py's CPU smoke run: the patched toy DeepSeek-V2 block has its block
    class swapped, both settings give the same output, and the JSON holds every token count."""
    p = _run([os.path.join(BENCH, "probe_shared_stream.py"), "--tiny", "--device", "cpu", "--out", str(tmp_path),
              "--tokens", "1,5"])
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads((tmp_path / "probe_shared_stream.json").read_text())
    assert [r["T"] for r in d["rows"]] == [1, 5]
    for r in d["rows"]:
        assert r["bit_identical"] and r["swapped_blocks"] and r["ms"]["two_streams"] > 0, r


def test_memory_jobs_in_their_own_process(tmp_path):
    p = _run([os.path.join(BENCH, "bench_memory.py"), "--tiny", "--device", "cpu", "--isolate", "yes",
              "--scopes", "layer", "--layer-models", "mixtral-8x7b", "--out", str(tmp_path)])
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads((tmp_path / "memory.json").read_text())
    (case,) = d["cases"]
    assert case["scope"] == "layer" and case["methods"]["samoyeds"]["max"] == 5
    assert case["methods"]["grouped_mm"]["first_failure"] == 6 and "--isolate yes" in d["env"]["command"]


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


def test_layer_trace_groups_kernels_and_builds_its_table(monkeypatch):
    """layer_trace: the kernel names a CUDA trace holds land in the right groups, a CPU
    trace of a toy block records both methods' ops per call, and the report's table and
    headline share come from the groups."""
    import layer_trace
    import report

    names = {
        "void sam::(anonymous namespace)::ssmm_ws_kernel<__nv_bfloat16, WsCfg<2, false, 1, false, true>>": "expert matmuls",
        "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversal": "expert matmuls",
        "nvjet_sm90_tst_176x128_64x5_1x2_h_bz_TNN": "gemm (router / shared experts)",
        "sam::(anonymous namespace)::route_kernel(void const*, sam_dtype, long, long, int, int*)": "routing",
        "void sam::(anonymous namespace)::combine_kernel_v8<__nv_bfloat16, __nv_bfloat16>(...)": "combine",
        "void at::native::sbtopk::gatherTopK<c10::BFloat16, unsigned int, 2, false>(...)": "router top-k / softmax",
        "void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int)": "gather / index",
        "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>": "elementwise / reductions",
        "Memcpy DtoD (Device -> Device)": "other",
    }
    for name, group in names.items():
        assert layer_trace.group_of(name) == group, name
    rows = layer_trace.trace_model("olmoe", [5], "samoyeds-1:2:128", "cpu", torch.float32, tiny=True, seed=0)
    assert len(rows) == 1 and rows[0]["T"] == 5 and not rows[0]["shared_experts_packed"]
    for m in rows[0]["methods"].values():
        assert m["total_us"] > 0 and m["top_kernels_us"]
        assert sum(m["groups_us"].values()) == pytest.approx(m["total_us"])
    # --shared-experts: DeepSeek-V2-Lite's shared MLP is packed too in the traced samoyeds block
    patched = []

    def spy(model, *a, **kw):
        out = real_patch(model, *a, **kw)
        patched.append(any(type(m).__name__ == "SamoyedsMLP" for m in model.modules()))
        return out

    real_patch = layer_trace.sm.patch_model
    monkeypatch.setattr(layer_trace.sm, "patch_model", spy)
    r = layer_trace.trace_model("deepseek-v2-lite", [5], "samoyeds-1:2:128", "cpu", torch.float32, tiny=True,
                                seed=0, shared=True)[0]
    assert r["shared_experts_packed"] is True and patched == [True]
    assert r["methods"]["samoyeds"]["total_us"] > 0
    # a GPU-like result: the table's shares and ratio come from the groups
    case = {"model": "olmoe", "T": 4096, "methods": {
        "grouped_mm": {"total_us": 2000.0, "groups_us": {"expert matmuls": 800.0, "elementwise / reductions": 1200.0}},
        "samoyeds": {"total_us": 800.0, "groups_us": {"expert matmuls": 700.0, "combine": 60.0, "routing": 40.0}}}}
    table = report.layer_trace_table({"cases": [case]})
    assert "| olmoe | 4096 | 2000 us | 40% | 800 us | 88% | combine 60 us, routing 40 us | 2.50x |" in table


def test_stress_block_smoke():
    """stress_block.py's CPU smoke run: every burst of back-to-back forwards of the patched toy
    block finishes and is reported, and the setting it ran under is named."""
    p = _run([os.path.join(BENCH, "stress_block.py"), "--tiny", "--device", "cpu", "--model", "gpt-oss-20b",
              "--tokens", "16", "--bursts", "2", "--calls", "3"])
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[0].startswith("gpt-oss-20b T=16 samoyeds-1:2:128:"), lines
    assert [ln.split(":")[0] for ln in lines[1:]] == ["burst 0", "burst 1"], lines


def test_ws_tile_rule_and_stream_bytes(monkeypatch):
    """benchmarks/common.py's mirror of ws_tall_tile (cuda/ssmm.cu) on the shapes its rule was set
    from, SAMOYEDS_WS_TILE overriding it, and ws_stream_bytes counting the stages of that tile:
    one per (expert's token tile, row tile, 64 columns)."""
    import common
    monkeypatch.delenv("SAMOYEDS_WS_TILE", raising=False)
    # (storage rows, S, E, rows by TMA, SMs) -> token count of the tile (0: 128 x 128)
    assert common.ws_tall_tile(2048, 8192, 8, False, 132) == 64    # gathered rows (gate_up): 256 x 64
    assert common.ws_tall_tile(2048, 8192, 8, True, 132) == 96     # Mixtral down at T = 4096: long tiles
    assert common.ws_tall_tile(1024, 32768, 128, True, 132) == 96  # Qwen3 down at T = 4096: 256 per expert
    assert common.ws_tall_tile(1024, 8192, 128, True, 132) == 64   # Qwen3 down at T = 1024: 64 per expert
    assert common.ws_tall_tile(1152, 32768, 8, True, 132) == 0     # MiniCPM down: 256-row tiles overhang
    assert common.ws_tall_tile(2048, 512, 8, True, 132) == 0       # Mixtral down at T = 256: too few items
    for env, want in (("0", 0), ("1", 64), ("2", 96)):
        monkeypatch.setenv("SAMOYEDS_WS_TILE", env)
        assert common.ws_tall_tile(2048, 8192, 8, False, 132) == want
    assert [common.ws_tile_name(1, 0), common.ws_tile_name(2, 0), common.ws_tile_name(2, 96)] == \
        ["256x128", "128x128", "256x96"]
    counts = [100, 0, 200]  # token tiles of 96: 2 + 0 + 3; of 128: 1 + 0 + 2
    stage96, stage128 = (common.WS_TILE[k]["stage_bytes"] for k in ("256x96", "128x128"))
    assert common.ws_stream_bytes(2, 512, 4096, counts, 96) == 5 * 2 * 64 * stage96
    assert common.ws_stream_bytes(2, 512, 4096, counts) == 3 * 4 * 64 * stage128


def test_tile_forms_and_their_operand_bytes():
    """Every warp-specialised tile names the wgmma.sp form (a tensor_core_rate kind) its
    consumers issue, and tc_forms.py's operand bytes per dense-equivalent flop follow the
    instruction shapes: B (N x K bf16) in every form, the packed A tile (64 x K/2) only where
    it is read from shared memory."""
    import common
    import tc_forms
    from samoyeds import _C
    assert set(common.WS_TILE_FORM) == set(common.WS_TILE)
    for tile, kind in common.WS_TILE_FORM.items():
        assert kind in _C.TENSOR_CORE_KINDS
        n, a_shared, sparse = tc_forms.WGMMA_FORMS[kind]
        assert a_shared and sparse and n == int(tile.split("x")[1]), (tile, kind)
    assert set(tc_forms.WGMMA_FORMS) <= set(_C.TENSOR_CORE_KINDS)
    bpf = tc_forms.operand_bytes_per_flop
    assert bpf("mma") is None and bpf("mma_sp") is None  # operands in registers
    assert bpf("wgmma") == bpf("wgmma_sp") == bpf("wgmma_sp_n64") == 1 / 64
    for kind, n in (("wgmma_sp_ss", 128), ("wgmma_sp_ss_n96", 96), ("wgmma_sp_ss_n64", 64)):
        assert bpf(kind) == pytest.approx(1 / 64 + 1 / (2 * n)), kind


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
