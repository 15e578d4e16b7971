"""samoyeds.patch_model under transformers' expert parallelism (EP = 2).

Each family's tiny model is saved to a temporary folder; ``torch.distributed.run``
launches two ranks of tests/ep_worker.py, which load it with
``DistributedConfig(tp_size=2, ep_size=2)`` (experts sharded on the expert dim, attention
tensor-parallel where the model's plan says so), patch it and write their logits and
greedy tokens.  This process loads the same folder without a distributed config, patches
it and compares: the logits within rounding of the two ranks' partial sums, the greedy
tokens equal.  Each rank must hold packed buffers for its own half of the experts only,
and unpatch_model must give it DTensors again; patched again with masks for the whole
model (``masks=``, not magnitude), each rank must cut them to its own experts.

CPU: gloo, fp32 (tolerance 1e-4 on logits of magnitude ~4; the packed model differs from
the dense one by O(1), so a rank running dense or wrong experts fails).  GPU: NCCL, bf16
(tolerance 4 ulps of a logit of 4), marked gpu, needs two GPUs.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import samoyeds  # noqa: E402
from samoyeds.hf.families import Shape, build_model  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import run_python  # noqa: E402
from ep_worker import prompts, whole_masks  # noqa: E402

transformers.logging.set_verbosity_error()

# Experts dominate the logits at init_std=0.1, so an error in them cannot hide.
SHAPE = Shape(vocab=128, hidden=128, layers=2, experts=8, top_k=2, intermediate=64, heads=4, kv_heads=2,
              head_dim=32, init_std=0.1)
# DeepSeek-V3: its tp_plan shards the shared experts and the dense layer's MLP (and not MLA)
FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")
WORLD = 2
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ep_worker.py")
TIMEOUT_S = 600
#: Least change of the logits that another set of kept weights makes (see check).
MOVED = 0.5


def ep_unavailable() -> str:
    """Why transformers' expert parallelism cannot run here ('' when it can)."""
    if not torch.distributed.is_available():
        return "torch was built without torch.distributed"
    try:
        from transformers import DistributedConfig  # noqa: F401
        from transformers.distributed.expert_parallel import AllReduceEP  # noqa: F401
    except ImportError as e:
        return f"this transformers has no expert-parallel plan ({e})"
    try:
        import accelerate  # noqa: F401
    except ImportError:
        # from_pretrained(distributed_config=...) sets a device_map, which it refuses without accelerate
        return "transformers' distributed from_pretrained needs accelerate (pip install accelerate)"
    return ""


def launch(tmp_path, dtype: str, ep_impl: str = "auto", families=FAMILIES) -> dict:
    """Saves each family's model, runs the two ranks, returns {family: (dir, [rank outputs])}."""
    dirs = {}
    for i, fam in enumerate(families):
        d = tmp_path / fam
        build_model(fam, SHAPE, seed=100 + i).save_pretrained(d)
        dirs[fam] = str(d)
    out = tmp_path / "out"
    out.mkdir()
    # NVLink multicast off on GPUs (the device docs); no effect on gloo
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", NCCL_NVLS_ENABLE="0")
    if dtype == "fp32":   # the gloo test: CPU ranks also on a machine with GPUs
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = ["-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
           "--standalone", WORKER, str(out), dtype, ep_impl, *dirs.values()]
    proc = run_python(cmd, env=env, timeout=TIMEOUT_S)
    cmd = [sys.executable] + cmd
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return {fam: (d, [torch.load(out / f"{fam}.rank{r}.pt") for r in range(WORLD)]) for fam, d in dirs.items()}


def reference(model_dir: str, dtype, device: str):
    """One process, no distributed config: patched logits and greedy tokens, the
    unpatched (masked dense) logits and the original model's logits."""
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    model = getattr(transformers, cfg.architectures[0]).from_pretrained(model_dir, dtype=dtype).to(device).eval()
    ids = prompts(cfg.vocab_size, torch.device(device))
    with torch.no_grad():
        original = model(ids).logits.float().cpu()
        samoyeds.patch_model(model, progress=False)
        logits = model(ids).logits.float().cpu()
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        tokens = gen.sequences.cpu()
        scores = torch.stack([s.float().cpu() for s in gen.scores], 1)   # [B, steps, vocab]
        samoyeds.unpatch_model(model)
        dense = model(ids).logits.float().cpu()
        masks = whole_masks(model)
        masked = None
        if masks:
            samoyeds.patch_model(model, progress=False, masks=masks)
            masked = model(ids).logits.float().cpu()
    return logits, (tokens, scores), dense, original, masked


def same_greedy(ep: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor, atol: float) -> str:
    """'' when the EP rank's greedy tokens equal one process's, or differ only from a step
    where one process's logits had the rank's token within ``atol`` of its own (a near tie
    that the ranks' other rounding order may flip; the rows can only differ after it)."""
    if ep.shape != ref.shape:
        return f"shapes {tuple(ep.shape)} vs {tuple(ref.shape)}"
    start = ref.shape[1] - scores.shape[1]
    for b in range(ref.shape[0]):
        differ = (ep[b] != ref[b]).nonzero()
        if len(differ) == 0:
            continue
        pos = int(differ[0])
        if pos < start:
            return f"row {b}: the prompt differs at {pos}"
        s = scores[b, pos - start]
        gap = float(s[ref[b, pos]] - s[ep[b, pos]])
        if gap > atol:
            return f"row {b}, step {pos - start}: token {int(ep[b, pos])} where one process's logit gap is {gap:.3g}"
    return ""


def check(results: dict, dtype, device: str, atol: float) -> None:
    E, W = SHAPE.experts, WORLD
    for fam, (model_dir, ranks) in results.items():
        logits, tokens, dense, original, masked = reference(model_dir, dtype, device)
        # packing moves the logits by 1.9-3.9 (fp32, seeds 100-102): an EP rank running the
        # dense weights could not pass
        assert (original - logits).abs().max() > MOVED, fam
        moe_layers = SHAPE.layers - (1 if fam == "deepseek_v3" else 0)   # its layer 0 is dense
        for r, o in enumerate(ranks):
            held = o["held"]
            assert held["num_experts"] == [E // W] * moe_layers, (fam, r, held)
            assert held["packed_experts"] == [E // W] * moe_layers, (fam, r, held)
            assert all(s[0] == E // W for s in held["gate_up_values"]), (fam, r, held)
            assert held["localized"] == moe_layers and held["dtensor_after_unpatch"], (fam, r, held)
            assert held["dtensor_after_failed_patch"], (fam, r, held)
            if fam == "deepseek_v3":
                # shared experts sharded by the plan: refused for packing, left transformers' own
                assert held["shared"] == moe_layers and held["shared_sharded"], (fam, r, held)
                assert held["shared_refused"] is True and not held["shared_swapped"], (fam, r, held)
            diff = (o["logits"] - logits).abs().max().item()
            print(f"{fam} rank {r}: EP-{W} logits - one process's: max |diff| {diff:.3g}")
            assert diff <= atol, f"{fam} rank {r}: EP-{W} logits differ from one process by {diff:.3g}"
            diff = (o["dense_logits"] - dense).abs().max().item()
            assert diff <= atol, f"{fam} rank {r}: unpatched EP-{W} logits differ by {diff:.3g}"
            why = same_greedy(o["tokens"], *tokens, atol)
            assert not why, f"{fam} rank {r}: greedy tokens differ beyond a near tie: {why}"
            assert (masked is None) == (o["masked_logits"] is None), fam
            if masked is not None:   # whole-model masks, cut by each rank
                assert (masked - logits).abs().max() > MOVED, fam   # 1.0-1.4 in fp32
                diff = (o["masked_logits"] - masked).abs().max().item()
                assert diff <= atol, f"{fam} rank {r}: EP-{W} logits with masks= differ by {diff:.3g}"


@pytest.mark.parametrize("ep_impl", ["auto", "all_to_all"])
def test_ep2_cpu_gloo(tmp_path, ep_impl):
    """auto: AllReduceEP (the inference default: placeholder ids, all-reduce); all_to_all:
    AllToAllEP (each rank's rows sent to the experts' ranks, local ids, unit weights)."""
    why = ep_unavailable()
    if why:
        pytest.skip(why)
    check(launch(tmp_path, "fp32", ep_impl), torch.float32, "cpu", atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("ep_impl", ["auto", "all_to_all"])
def test_ep2_gpu_nccl(tmp_path, ep_impl):
    why = ep_unavailable()
    if why:
        pytest.skip(why)
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs, found {torch.cuda.device_count()}")
    # bf16: one ulp of a logit of size 4 is 0.031; the ranks' partial sums, the all-reduce and
    # the tensor-parallel attention round in other orders than one GPU does
    results = launch(tmp_path, "bf16", ep_impl)
    for _, ranks in results.values():
        assert all(o["device"].startswith("cuda") for o in ranks)
    check(results, torch.bfloat16, "cuda", atol=0.125)


def test_bench_ep_tiny_cpu(tmp_path):
    """benchmarks/bench_ep.py --tiny --device cpu: EP = 1 and 2 (gloo) for samoyeds,
    grouped_mm and the no-MoE bound, every cell measured (decode with both caches; the
    static one compiles the step), each EP-2 rank holding half the experts, and the bound
    ratios present.  (EP sizes initialise their shards differently: no token comparison.)"""
    import json

    why = ep_unavailable()
    if why:
        pytest.skip(why)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [os.path.join(root, "benchmarks", "bench_ep.py"), "--tiny", "--device", "cpu",
           "--models", "mixtral-8x7b", "--ep", "1", "2", "--reps", "1", "--strict", "--out", str(tmp_path)]
    proc = run_python(cmd, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-8000:]
    with open(tmp_path / "ep.json") as fh:
        res = json.load(fh)
    assert res["command"] and res["commit"] and res["device_kind"] == "cpu"
    rows = {(r["ep"], r["impl"]): r for r in res["rows"]}
    assert set(rows) == {(ep, impl) for ep in (1, 2) for impl in ("samoyeds", "grouped_mm", "no_moe")}
    for key, r in rows.items():
        assert "error" not in r, (key, r["error"])
        assert len(r["weights_gib_per_rank"]) == key[0]
        cells = r["prefill"] + r["decode"]
        assert len(cells) == 6 and all(c.get("tokens_per_s", 0) > 0 for c in cells), (key, cells)
        assert sorted(c["cache"] for c in r["decode"]) == ["dynamic"] * 2 + ["static"] * 2, key
    for impl in ("samoyeds", "grouped_mm"):
        one, two = rows[(1, impl)]["experts_gib_per_rank"], rows[(2, impl)]["experts_gib_per_rank"]
        assert two == [one[0] / 2] * 2, (impl, one, two)
        static = [c["tokens"] for ep in (1, 2) for c in rows[(ep, impl)]["decode"] if c["cache"] == "static"]
        assert [len(t) for t in static] == [5] * 4, (impl, static)   # decode-steps 4: N + 1 new tokens
    assert {r["ratio"] for r in res["ratios"]} == {"samoyeds_over_grouped_mm", "no_moe_over_grouped_mm",
                                                   "ep2_over_ep1", "ep2_over_ep1_bound"}
    bound = [r for r in res["ratios"] if r["ratio"] == "ep2_over_ep1_bound"]
    assert len(bound) == 6 and all(r["impl"] == "samoyeds" and r["value"] > 0 for r in bound), bound


def test_same_greedy_allows_only_near_ties():
    ref = torch.tensor([[5, 6, 1, 2, 3]])
    scores = torch.zeros(1, 3, 8)
    scores[0, 0, 1], scores[0, 0, 4] = 2.0, 1.95     # step 0: token 1, token 4 a near tie
    scores[0, 1, 2], scores[0, 1, 7] = 2.0, 1.0      # step 1: token 2 by a clear margin
    assert same_greedy(ref, ref, scores, 0.125) == ""
    assert same_greedy(torch.tensor([[5, 6, 4, 0, 0]]), ref, scores, 0.125) == ""
    assert "gap is 1" in same_greedy(torch.tensor([[5, 6, 1, 7, 0]]), ref, scores, 0.125)
    assert "prompt differs" in same_greedy(torch.tensor([[5, 0, 1, 2, 3]]), ref, scores, 0.125)
    assert "gap is 0.05" in same_greedy(torch.tensor([[5, 6, 4, 0, 0]]), ref, scores, 0.01)
