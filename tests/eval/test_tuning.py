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
    # the noisier candidate goes first; on the clean one Gate-IA's 100% fixes its max, so nn is skipped
    assert noisy["attacks_run"] == ["gate-ia", "nn"] and clean["max_ttrsr"] == 1.0
    assert clean["attacks_run"] == ["gate-ia"] and "100%" in clean["stopped"]
    assert loose["params"]["alpha_e"] == 0.5 and loose["measured"]["max_ttrsr"] == noisy["max_ttrsr"]
    # a tight budget excludes the noisy setting; the results file is reused (nothing recomputed)
    assert main(args + ["--min-top1", str(round((clean["top1"] + noisy["top1"]) / 2, 3)),
                        "--out", str(tmp_path / "tight.json")]) == 0
    assert json.loads((tmp_path / "tight.json").read_text())["params"]["alpha_e"] == 0.0
    assert "[tune]" not in capsys.readouterr().out.split("wrote", 1)[1]  # second run evaluated nothing
    assert aloepri.resolve_params(preset_file=tmp_path / "loose.json").alpha_h == 0.5


class TableEvaluator:
    """An evaluator without models: each candidate's top-1 and per-attack TTRSR come from a table keyed by
    alpha_e, and the attacks run through the tuner's own loop (``attacks_in_turn``), counting each run."""

    src = __import__("pathlib").Path("model")
    budget, fidelity_prompts, private_prompts = "ci", 2, 2

    def __init__(self, table: dict[float, tuple[float, list[float]]]):
        self.table, self.runs = table, 0
        self.attacks = tuple(f"a{i}" for i in range(len(next(iter(table.values()))[1])))

    def evaluate(self, params, seed, stage=lambda what: None, stop=None):
        from aloepri.eval.tuning import attacks_in_turn

        top1, ttrsrs = self.table[params.alpha_e]
        fid = {"top1_agreement": top1, "mean_kl": 1 - top1}

        def run(i, name):
            self.runs += 1
            return {"ttrsr": ttrsrs[i]}

        outcome = attacks_in_turn(self.attacks, run, None if stop is None else lambda done: stop(fid, done))
        return {"params": params.to_dict(), "seed": seed, "fidelity": fid, **outcome, "budget": "ci", "seconds": 0}


def test_the_bounded_tuner_chooses_what_the_full_evaluation_chooses(tmp_path):
    """Branch and bound against brute force on random tables: the same choice, never more attacks run, and
    fewer on a table where the bound can cut (candidates outside the budget, beaten ones, 100% recoveries)."""
    import random

    from aloepri.eval.tuning import tune

    rng = random.Random(0)
    base = aloepri.resolve_params("noisy")
    saved = 0
    for trial in range(60):
        n, k = rng.randint(1, 7), rng.randint(1, 4)
        table = {round(0.1 * (i + 1), 2): (round(rng.uniform(0.5, 1.0), 2),
                                           [rng.choice([1.0, round(rng.uniform(0, 1), 2)]) for _ in range(k)])
                 for i in range(n)}
        if trial % 5 == 0:  # ties on max TTRSR
            table = {a: (t, [0.5] * k) for a, (t, _) in table.items()}
        candidates = [base.replace(alpha_e=a, alpha_h=0.0) for a in table]
        criterion = Criterion(min_top1=rng.choice([0.5, 0.7, 0.9]))
        full, bounded = TableEvaluator(table), TableEvaluator(table)
        try:
            want = tune(full, criterion, candidates, ResultStore(tmp_path / f"f{trial}.json"),
                        tmp_path / f"f{trial}.out", progress=False, all_attacks=True)
        except ValueError:
            with pytest.raises(ValueError, match="accuracy budget"):
                tune(bounded, criterion, candidates, ResultStore(tmp_path / f"b{trial}.json"),
                     tmp_path / f"b{trial}.out", progress=False)
            continue
        got = tune(bounded, criterion, candidates, ResultStore(tmp_path / f"b{trial}.json"), tmp_path / f"b{trial}.out",
                   progress=False)
        assert (got["measured"]["max_ttrsr"], got["measured"]["fidelity"]) == \
               (want["measured"]["max_ttrsr"], want["measured"]["fidelity"])
        assert bounded.runs <= full.runs == n * k
        saved += full.runs - bounded.runs
        # a resumed run reuses every entry, cut short or not
        again = TableEvaluator(table)
        tune(again, criterion, candidates, ResultStore(tmp_path / f"b{trial}.json"), tmp_path / f"b{trial}.out",
             progress=False)
        assert again.runs == 0
    assert saved > 0


def test_stop_reasons():
    from aloepri.eval.tuning import stop_reason

    c = Criterion(min_top1=0.9)
    best = {"max_ttrsr": 0.5, "fidelity": {"top1_agreement": 0.95}}
    fid = {"top1_agreement": 0.93, "mean_kl": 0.0}
    assert "accuracy budget" in stop_reason(c, {"top1_agreement": 0.8, "mean_kl": 0.0}, {}, best)
    assert stop_reason(c, fid, {}, best) is None  # nothing measured yet
    assert stop_reason(c, fid, {"a": {"ttrsr": 0.4}}, best) is None  # could still win
    assert "above" in stop_reason(c, fid, {"a": {"ttrsr": 0.6}}, best)
    assert "ties" in stop_reason(c, fid, {"a": {"ttrsr": 0.5}}, best)  # a tie, and top-1 0.93 < 0.95
    assert stop_reason(c, {"top1_agreement": 0.97, "mean_kl": 0.0}, {"a": {"ttrsr": 0.5}}, best) is None
    assert "100%" in stop_reason(c, fid, {"a": {"ttrsr": 1.0}}, None)
    assert stop_reason(c, fid, {"a": {"ttrsr": 0.9}}, None) is None  # no best yet: keep measuring
