"""The experiment system (benchmarks/): registry, typed settings, results store, runner, and the stored results."""
from __future__ import annotations

import json
import multiprocessing
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.lib import ResultStore, SettingsMismatchError, all_experiments
from benchmarks.lib.fields import parse_assignments
from benchmarks.lib.store import RESULTS
from benchmarks.lib.variants import parse_variant

REPO = Path(__file__).resolve().parents[2]


def test_every_experiment_is_well_formed_and_reports_its_stored_results():
    experiments = all_experiments()
    assert experiments, "no experiment registered"
    for exp in experiments.values():
        assert exp.configs and exp.summary, exp.name
        for cfg in (*exp.config_names, *exp.legacy_configs):
            store = exp.store(cfg)
            if store.path.exists():
                text = exp.report(store)
                assert isinstance(text, str) and text.strip(), (exp.name, cfg)


def test_every_results_file_belongs_to_an_experiment_config():
    experiments = all_experiments()
    known = {(e.name, c) for e in experiments.values() for c in (*e.config_names, *e.legacy_configs)}
    stray = []
    for path in RESULTS.rglob("*.json"):
        rel = path.relative_to(RESULTS)
        if len(rel.parts) != 2:
            stray.append(str(rel))
            continue
        data = json.loads(path.read_text())
        assert data["runs"], f"{rel}: no provenance"
        assert all("argv" in r or r.get("legacy") and r.get("command") for r in data["runs"]), rel
        saved_as = all("--save-as" in r.get("argv", []) and path.stem in r["argv"] for r in data["runs"])
        if (rel.parts[0], path.stem) not in known and not (rel.parts[0] in experiments and saved_as):
            stray.append(str(rel))
    assert not stray, f"results outside results/<experiment>/<config>.json of a registered config: {stray}"


def test_no_sys_path_manipulation_or_code_in_strings_in_benchmarks():
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "benchmarks").rglob("*.py")
                 if re.search(r"sys\.path\.(insert|append)|\"-c\",", p.read_text())]
    assert not offenders, offenders


def test_variants_parse_by_field_type():
    label, p = parse_variant("fish=default:noise_shape=fisher,alpha_e=0.1,h=64")
    assert label == "fish" and p.noise_shape == "fisher" and p.alpha_e == 0.1 and p.h == 64
    assert isinstance(p.h, int)
    label, p = parse_variant("exact:outlier_dims=0")
    assert label == "exact:outlier_dims=0" and p.outlier_dims == 0
    with pytest.raises(ValueError, match="h must be an integer"):
        parse_variant("x=default:h=1.5")
    with pytest.raises(ValueError, match="unknown field"):
        parse_variant("x=default:no_such=1")


@dataclass(frozen=True)
class _Settings:
    models: tuple[str, ...] = ("smollm2",)
    n: int = 1
    flag: bool = False
    rate: float | None = None


def test_settings_assignments_are_typed():
    got = parse_assignments(_Settings, ["models=a,b", "n=3", "flag=true", "rate=none"])
    assert got == {"models": ("a", "b"), "n": 3, "flag": True, "rate": None}
    with pytest.raises(ValueError, match="true or false"):
        parse_assignments(_Settings, ["flag=maybe"])


def _writer(root: str, worker: int) -> None:
    store = ResultStore("exp", "cfg", {"a": 1}, root=Path(root))
    store.begin(argv=["w", str(worker)])
    for i in range(10):
        store.put(f"{worker}-{i}", {"v": i})


def test_store_merges_concurrent_writers_and_records_provenance(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    data = ResultStore("exp", "cfg", root=tmp_path).load()
    assert len(data["entries"]) == 30 and len(data["runs"]) == 3
    run = data["runs"][0]
    assert {"argv", "commit", "versions", "machine", "started", "settings"} <= set(run)
    assert not list((tmp_path / "exp").glob("*.tmp"))


def test_store_refuses_results_of_other_settings(tmp_path):
    ResultStore("exp", "cfg", {"a": 1}, root=tmp_path).begin()
    with pytest.raises(SettingsMismatchError, match="a: 1 -> 2"):
        ResultStore("exp", "cfg", {"a": 2}, root=tmp_path).begin()
    fresh = ResultStore("exp", "cfg", {"a": 2}, root=tmp_path)
    fresh.begin(fresh=True)
    assert fresh.load()["settings"] == {"a": 2} and len(fresh.load()["runs"]) == 1


def test_a_run_that_fails_before_storing_anything_leaves_no_file(tmp_path):
    store = ResultStore("exp", "cfg", {"a": 1}, root=tmp_path)
    store.begin()
    store.abandon()
    assert not store.path.exists()
    kept = ResultStore("exp", "cfg", {"a": 1}, root=tmp_path)
    kept.begin()
    kept.put("k", {"v": 1})
    again = ResultStore("exp", "cfg", {"a": 1}, root=tmp_path)
    again.begin()
    again.abandon()
    assert len(again.load()["runs"]) == 1 and again.has("k")


def test_target_cache_key_follows_parameters_and_seed(tmp_path):
    import aloepri
    from benchmarks.lib.targets import cache_key

    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    base = cache_key(src, aloepri.resolve_params("default"), 1)
    assert base == cache_key(src, aloepri.resolve_params("default"), 1)
    assert base != cache_key(src, aloepri.resolve_params("noisy"), 1)
    assert base != cache_key(src, aloepri.resolve_params("default", outlier_dims=0), 1)
    assert base != cache_key(src, aloepri.resolve_params("default"), 2)
    import torch

    factors = torch.ones(2, 3000)
    changed = factors.clone()
    changed[1, 1500] = 2.0  # beyond what a tensor's repr prints
    assert cache_key(src, aloepri.resolve_params("default"), 1, noise_factors=(factors,)) != \
        cache_key(src, aloepri.resolve_params("default"), 1, noise_factors=(changed,))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_runner_lists_and_refuses_bad_input_in_one_line():
    out = _cli("list")
    assert out.returncode == 0 and "privacy_budget" in out.stdout
    for args, msg in [(("run", "no_such"), "no experiment"),
                      (("run", "privacy_budget", "--set", "threads=2"), "--save-as"),
                      (("run", "privacy_budget", "--set", "threads=x", "--save-as", "t"), "integer"),
                      (("run", "privacy_budget", "--config", "nope"), "no config")]:
        r = _cli(*args)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)


def test_obfuscation_perf_child_measures_a_tiny_model(tmp_path):
    """The perf child (experiment obfuscation_perf) observes today's pipeline: it once rotted into an AttributeError
    when the pipeline was split. A tiny model and 64 x 64 probes keep this quick; no timing is asserted, only that
    every field is produced and every second of the wall time has a phase."""
    from aloepri.testing.tiny import build_tiny
    from benchmarks.experiments.obfuscation_perf import run_model

    src = build_tiny("llama", tmp_path / "tiny")
    r = run_model(str(src), "noisy", threads=1, probe_every=1, probe_size=64)
    phases = r["phase_seconds"]
    assert set(phases) == {"plan", "read_dequantize", "key_generation", "vocab_products_noise", "layer_products",
                           "write", "finish", "other"}
    assert all(v >= 0 for k, v in phases.items() if k != "other"), phases
    assert abs(phases["other"]) <= 0.05 + 0.05 * r["wall_seconds"], phases  # only the timer's own overhead
    assert set(r["block_seconds"]) == {"embedding", "head", "layer 0", "layer 1"}
    # two probes before, one before the embedding, one before the head, one per layer (probe_every 1), two after
    assert len(r["roofline_probe_gflops"]) == 2 + 1 + 1 + 2 + 2 and len(r["float32_probe_gflops"]) == 4
    assert r["flops"] > 0 and r["output_bytes"] > 0 and r["peak_rss_mib"] >= r["baseline_rss_mib"] > 0
    for field in ("gflops_achieved", "fraction_of_roofline", "fraction_of_idle_roofline",
                  "fraction_of_float32_roofline", "cpu_utilisation"):
        assert r[field] > 0, field
    assert r["product_dtype"] == "torch.float64" and len(r["loadavg_1min"]) == 2  # float64 source: float64 output


def test_scale_and_key_children_run_on_a_tiny_model(tmp_path):
    """The scale_shapes and key_setup children on a tiny model and a small width: every field the experiments
    read is there, the lossless equivalence holds, and the key child reports the secrets' digests."""
    from aloepri.testing.tiny import build_tiny
    from benchmarks.experiments import key_setup, scale_shapes

    src = build_tiny("llama", tmp_path / "src")
    t = scale_shapes._run_child("timing", [str(src), str(tmp_path / "t"), json.dumps(scale_shapes.NOISY), "1", "-"],
                                1, tmp_path / "t.log")
    assert t["flops"] > 0 and len(t["float32_probe_gflops"]) == 4 and t["block_seconds"] and t["peak_rss_kib"] > 0
    e = scale_shapes._run_child("equivalence", [str(src), str(tmp_path / "e"), json.dumps(scale_shapes.LOSSLESS), "1"],
                                1, tmp_path / "e.log")
    assert e["relative_error"] < 1e-4 and e["top1_agreement"] == 1.0
    k = key_setup._run_child(REPO / "src", 256, 1, "-", "-")
    assert {"B", "B_inv", "Z", "P", "Q", "perm", "kappa"} <= set(k["sha256_16"]) and k["key_seconds"] > 0
    assert k["sha256_16"] == key_setup._run_child(REPO / "src", 256, 1, "1", "-")["sha256_16"]  # one worker: same bits


def test_command_child_splits_a_verify_into_loading_and_compute(tmp_path):
    """The command_times child runs the real CLI and times its loaders: a tiny model's verify has both models'
    loads counted, and no more loading than wall time."""
    import aloepri
    from aloepri.testing.tiny import build_tiny

    src = build_tiny("llama", tmp_path / "tiny")
    aloepri.obfuscate(src, tmp_path / "out", tmp_path / "key.json", aloepri.resolve_params("default"), seed=3,
                      allow_weak_seed=True, progress=False)
    out = tmp_path / "child.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.lib.command_child", str(out), "--", "verify", str(src),
                           str(tmp_path / "out"), "--key", str(tmp_path / "key.json"), "--no-tokenizer", "--prompts",
                           "2", "--greedy-tokens", "2", "--quiet"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert [what for what, _ in r["loads"]] == ["plaintext model", "obfuscated model"]
    assert 0 < r["load_seconds"] <= r["seconds"] and r["exit_code"] == 0 and r["peak_rss_mib"] > 0
    assert r["cpu_seconds"] > 0


def test_verify_memory_children_give_equal_numbers_on_a_tiny_model(tmp_path):
    """The verify_memory experiment's children: `aloepri verify` (one model at a time) and both models side by side
    give the same numbers, each with its own peak RSS."""
    import aloepri
    from aloepri.testing.tiny import build_tiny
    from benchmarks.experiments.verify_memory import run_child

    src = build_tiny("llama", tmp_path / "src")
    aloepri.obfuscate(src, tmp_path / "server", tmp_path / "key.json", aloepri.resolve_params("noisy"), seed=3,
                      allow_weak_seed=True, progress=False)
    runs = {mode: run_child([sys.executable, "-m", "benchmarks.lib.verify_child", mode, str(src),
                             str(tmp_path / "server"), str(tmp_path / "key.json"), "2", "3", "1"], 8.0, 1)
            for mode in ("verify", "both")}
    both, verify = runs["both"]["result"], runs["verify"]["result"]
    # verify adds its verdict and reference beside the same numbers
    assert {k: verify[k] for k in both} == both and verify["prompts"] == 2 and verify["verdict"] == "lossy"
    assert all(r["peak_rss_mib"] >= r["imports_rss_mib"] > 0 and r["seconds"] > 0 for r in runs.values())


def test_device_attack_synthetic_plan_runs_on_the_cpu_with_tiny_sizes(tiny_dir, tmp_path):
    """The prepared GPU command (device_attack, synthetic plan: no download, no tokenizer) on the CPU with a tiny
    model: the obfuscation is equivalent on the device and the behavioural attack runs per probe batch. The
    synthetic shape itself is written by the same code path (write_synthetic_checkpoint, tested elsewhere)."""
    import dataclasses

    from benchmarks.experiments import device_attack

    settings = dataclasses.replace(device_attack.CONFIGS["synthetic-cpu"], model=str(tiny_dir("llama")),
                                   preset="exact", batches=("default", "5"), threads=1)
    store = ResultStore("device_attack", "tiny", dataclasses.asdict(settings), root=tmp_path)
    store.begin()
    device_attack.run(settings, store)
    entries = store.entries()
    assert set(entries) == {"cpu/equivalence", "cpu/default/behavioural", "cpu/5/behavioural"}
    eq = entries["cpu/equivalence"]
    assert eq["top1_agreement"] == 1.0 and eq["relative_error"] < 1e-4 and eq["obfuscate_seconds"] > 0
    assert all(entries[k]["ttrsr"] > 0.5 and entries[k]["ran_on"] == "cpu" for k in entries if "behavioural" in k)
    assert "behavioural, batch 5" in device_attack.report(store)


def test_scale_trend_fit_and_points():
    """scale_trend's least-squares fit recovers a line, its prediction interval widens with the distance from the
    measured sizes, and a model's point is read from llamacpp_quantized's entries only when all of it is there."""
    import math

    from benchmarks.experiments import scale_trend

    xs = [math.log10(p) for p in (1e8, 5e8, 1.5e9)]
    exact = scale_trend.fit(xs, [0.5 - 0.1 * x for x in xs])
    assert abs(exact["slope_per_decade"] + 0.1) < 1e-12 and abs(exact["8B"]["high"] - exact["8B"]["low"]) < 1e-9
    noisy = scale_trend.fit(xs, [0.3, 0.2, 0.22])
    for size in ("8B", "14B"):
        assert noisy[size]["low"] < noisy[size]["fit"] < noisy[size]["high"]
    assert (noisy["14B"]["high"] - noisy["14B"]["low"]) > (noisy["8B"]["high"] - noisy["8B"]["low"])
    entries = {"fidelity/noisy:q8_0": {"top1": 0.9, "kl": 0.1, "type": "q8_0"},
               "attacks/noisy": {"attacks": {"vma": {"ttrsr": 0.8}}},
               "humaneval/plaintext:q8_0/HumanEval/0": {"passed": True},
               "humaneval/plaintext:q8_0/HumanEval/8": {"passed": True},
               "humaneval/noisy:q8_0/HumanEval/0": {"passed": False}}
    p = scale_trend.point(entries, "noisy", "q8_0", "vma")
    assert p == {"top1": 0.9, "kl": 0.1, "ttrsr": 0.8, "served_type": "q8_0", "humaneval_problems": 1,
                 "humaneval_plain": 1.0, "humaneval_obfuscated": 0.0}
    no_humaneval = {k: v for k, v in entries.items() if not k.startswith("humaneval/")}
    assert "humaneval_plain" not in scale_trend.point(no_humaneval, "noisy", "q8_0", "vma")
    assert scale_trend.point({k: v for k, v in entries.items() if k != "attacks/noisy"}, "noisy", "q8_0", "vma") is None


def test_llamacpp_quantized_preset_specs_with_overrides():
    """``PRESET+FIELD=NUMBER`` names a point of a noise sweep; every config's presets parse, and a bad one is
    one UsageError."""
    import aloepri

    from benchmarks.experiments.llamacpp_quantized import CONFIGS, _split, target_params
    from benchmarks.lib.variants import preset_params
    from benchmarks.lib import UsageError

    p = preset_params("noisy+alpha_e=0.5+alpha_h=0.1")
    assert (p.alpha_e, p.alpha_h, p.outlier_dims) == (0.5, 0.1, aloepri.resolve_params("noisy").outlier_dims)
    assert target_params("paper@7") == aloepri.resolve_params("paper").to_dict()
    assert preset_params("default+outlier_dims=8").outlier_dims == 8
    for s in CONFIGS.values():
        for spec in (*s.fidelity, *s.humaneval):
            preset = _split(spec)[0]
            if preset != "plaintext":
                target_params(preset)
        for preset in s.attacks:
            target_params(preset)
    for bad in ("noisy+alpha_e", "noisy+alpha_e=x"):
        with pytest.raises(UsageError):
            preset_params(bad)


def test_attack_engines_only_env_chooses_entries_and_refuses_unknown_ones(monkeypatch):
    """ALOEPRI_BENCH_ONLY picks a preset's engines or one PRESET/ENGINE of the config; anything else is one
    UsageError, and without it every entry of the config is run."""
    from benchmarks.experiments.attack_engines import CONFIGS, ONLY_ENV, _entries_now
    from benchmarks.lib import UsageError

    s = CONFIGS["smollm2"]
    monkeypatch.delenv(ONLY_ENV, raising=False)
    assert _entries_now(s) == [(p, e) for p in s.presets for e in s.engines]
    monkeypatch.setenv(ONLY_ENV, "paper/torch, noisy")
    assert _entries_now(s) == [("noisy", e) for e in s.engines] + [("paper", "torch")]
    for bad in ("exact", "paper/vllm", "noisy/"):
        monkeypatch.setenv(ONLY_ENV, bad)
        with pytest.raises(UsageError):
            _entries_now(s)
