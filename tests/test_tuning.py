"""Frontier/tuner plumbing: accuracy budget, choice, resumable parallel-safe store, preset file round trip."""
import json
import os
import subprocess
import sys

import pytest

import aloepri
from aloepri.tuning import Criterion, ResultStore, choose


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
    code = ("import sys; from aloepri.tuning import ResultStore; s = ResultStore(sys.argv[1]); "
            "[s.put(f'{sys.argv[2]}{i}', {'i': i}) for i in range(30)]")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "r.json"), p]) for p in "xy"]
    assert all(p.wait() == 0 for p in procs)
    assert len(ResultStore(tmp_path / "r.json").load()) == 60  # no lost update


def test_tuned_preset_file_is_accepted_by_obfuscate(tmp_path):
    preset = {"params": aloepri.resolve_params("default", alpha_e=0.3).to_dict(), "criterion": "top-1 >= 0.5",
              "measured": {"max_ttrsr": 0.1}}
    (tmp_path / "p.json").write_text(json.dumps(preset))
    assert aloepri.resolve_params(preset_file=tmp_path / "p.json").alpha_e == 0.3


def test_tune_needs_an_accuracy_budget(capsys):
    from aloepri.cli import main

    assert main(["tune", "x.gguf", "--out", "p.json"]) == 2
    assert "accuracy budget" in capsys.readouterr().err
