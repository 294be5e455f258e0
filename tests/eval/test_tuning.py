"""Frontier/tuner plumbing: accuracy budget, choice, resumable parallel-safe store, preset file round trip."""
import json
import os
import subprocess
import sys

import pytest

import aloepri
from aloepri.eval.tuning import Criterion, ResultStore, choose


def _result(top1, kl, ttrsr):
    return {"fidelity": {"top1_agreement": top1, "mean_kl": kl}, "max_ttrsr": ttrsr, "params": {}}


def test_choose_takes_the_most_private_admissible_setting():
    results = [_result(0.99, 0.01, 0.95), _result(0.92, 0.08, 0.40), _result(0.60, 0.9, 0.01), _result(0.93, 0.07, 0.40)]
    assert choose(results, Criterion(min_top1=0.9)) is results[3]  # 0.40 beats 0.95; tie -> higher top-1
    assert choose(results, Criterion(max_kl=0.05)) is results[0]
    assert choose(results, Criterion(max_kl=1.0)) is results[2]
    assert choose(results, Criterion(min_top1=0.999)) is None


def test_store_claims_are_exclusive_and_resumable(tmp_path):
    store = ResultStore(tmp_path / "r.json")
    assert store.claim("a", {"label": "x"})
    # a live other process holding the claim keeps it; a dead one loses it
    data = json.loads((tmp_path / "r.json").read_text())
    data["a"]["pid"] = os.getppid()
    (tmp_path / "r.json").write_text(json.dumps(data))
    assert not store.claim("a", {})
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    data["a"]["pid"] = int(proc.stdout)  # exited
    (tmp_path / "r.json").write_text(json.dumps(data))
    assert store.claim("a", {})
    store.put("a", {"value": 1})
    assert not store.claim("a", {})  # done: never recomputed
    assert store.load()["a"] == {"value": 1, "status": "done"}


def test_store_survives_concurrent_writers(tmp_path):
    code = ("import sys; from aloepri.eval.tuning import ResultStore; s = ResultStore(sys.argv[1]); "
            "[s.put(f'{sys.argv[2]}{i}', {'i': i}) for i in range(30)]")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "r.json"), p]) for p in "xy"]
    assert all(p.wait() == 0 for p in procs)
    assert len(ResultStore(tmp_path / "r.json").load()) == 60  # no lost update


def test_tuned_preset_file_is_accepted_by_obfuscate(tmp_path):
    preset = {"params": aloepri.resolve_params("noisy", alpha_e=0.3).to_dict(), "criterion": "top-1 >= 0.5",
              "measured": {"max_ttrsr": 0.1}}
    (tmp_path / "p.json").write_text(json.dumps(preset))
    assert aloepri.resolve_params(preset_file=tmp_path / "p.json").alpha_e == 0.3


def test_tune_needs_an_accuracy_budget(capsys):
    from aloepri.cli import main

    assert main(["tune", "x.gguf", "--out", "p.json"]) == 2
    assert "accuracy budget" in capsys.readouterr().err


def test_parse_candidates_fixed_equal_and_errors():
    from aloepri.eval.tuning import default_candidates, parse_candidates

    base = aloepri.resolve_params("noisy")
    assert [(p.alpha_e, p.alpha_h) for p in parse_candidates(base, "0.1,0.3", "equal")] == [(0.1, 0.1), (0.3, 0.3)]
    assert [(p.alpha_e, p.alpha_h) for p in parse_candidates(base, "0.2", "0.05")] == [(0.2, 0.05)]
    assert parse_candidates(base, "0.2", None)[0].alpha_h == base.alpha_h
    for bad in [("x", None), ("", None), ("0.1", "lots")]:
        with pytest.raises(ValueError):
            parse_candidates(base, *bad)
    # the default ladder includes equal-noise points: with alpha_h small the head side leaks (docs/accuracy.md)
    assert any(p.alpha_e == p.alpha_h >= 0.5 for p in default_candidates(base))


def test_tune_end_to_end_on_smollm2(tmp_path, capsys):
    """Smoke run of the real tuner: two settings of SmolLM2, fidelity and two attacks on each obfuscated output.

    No noise (alpha 0) is Gate-IA's positive control (it recovers every prompt token); equal noise 0.5 costs
    accuracy (top-1 ~0.2-0.5) but lowers Gate-IA (~0.75 on 30 prompts). With a loose accuracy budget the tuner
    must pick the noisier setting, with a tight one the noise-free one."""
    from conftest import smollm2_or_skip

    from aloepri.cli import main

    src = smollm2_or_skip()
    args = ["tune", str(src), "--alpha-e", "0.0,0.5", "--alpha-h", "equal", "--attacks", "gate-ia,nn",
            "--budget", "ci", "--prompts", "4", "--private-prompts", "4", "--results", str(tmp_path / "r.json")]
    assert main(args + ["--min-top1", "0.05", "--out", str(tmp_path / "loose.json")]) == 0
    loose = json.loads((tmp_path / "loose.json").read_text())
    rows = {r["params"].split()[0]: r for r in loose["candidates"]}
    clean, noisy = rows["alpha_e=0.0"], rows["alpha_e=0.5"]
    assert clean["max_ttrsr"] >= 0.9  # the attack works on the weak setting...
    assert noisy["max_ttrsr"] < clean["max_ttrsr"]  # ...and the noise measurably lowers it
    assert clean["top1"] > noisy["top1"] >= 0.05
    assert loose["params"]["alpha_e"] == 0.5 and loose["measured"]["max_ttrsr"] == noisy["max_ttrsr"]
    # a tight budget excludes the noisy setting; the results file is reused (nothing recomputed)
    assert main(args + ["--min-top1", str(round((clean["top1"] + noisy["top1"]) / 2, 3)),
                        "--out", str(tmp_path / "tight.json")]) == 0
    assert json.loads((tmp_path / "tight.json").read_text())["params"]["alpha_e"] == 0.0
    assert "[tune]" not in capsys.readouterr().out.split("wrote", 1)[1]  # second run evaluated nothing
    assert aloepri.resolve_params(preset_file=tmp_path / "loose.json").alpha_h == 0.5
