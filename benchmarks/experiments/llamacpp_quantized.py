"""An obfuscated model served on llama.cpp as people serve it (q8_0, a 4-bit K-quant), against the plaintext GGUF at
the same quantization: fidelity, greedy identity with its logit margins, HumanEval pass@1, and the
attacks on the very checkpoints that were measured. Made for Qwen2.5-Coder-1.5B-Instruct, the largest real model
here; any bundled model name works.

Models. Each preset is obfuscated once (``seed``, output ``dtype``: bfloat16, what ``aloepri obfuscate`` writes from a
quantized GGUF) and exported with ``aloepri export-gguf`` at each type named; K-quants come from llama.cpp's own
quantizer applied to an f32 export; an output whose rows are not multiples of 32 (``paper``'s expansion on the Qwen
models) is served at f16 instead, against plaintext at f16, and its entry says so. The plaintext model at a type is the same dequantized weights the obfuscation
started from (``plaintext_reference_dir``), exported by the same exporter at the same type. llama-cpp-python runs
both with the same threads, context and f32 logits; one model is loaded at a time.

- ``fidelity`` (``PRESET:TYPE``, or ``PRESET@SEED:TYPE`` for another key): the first ``prompts`` built-in chat prompts, each followed by the plaintext model's
  greedy reply at that type (``reply_tokens``). Teacher-forced over the reply: top-1 agreement and mean
  KL(plaintext || obfuscated) in nats, the obfuscated logits mapped back through the key. Greedy identity: the
  obfuscated model's own greedy reply against the plaintext one; at the first divergence, both models' margins
  (top-1 minus top-2 logit) there, so a near-tie is told from a real departure. Decode seconds per token are
  stored but not reported: the two models run minutes apart, not side by side.
- ``humaneval`` (``plaintext:TYPE`` or ``PRESET:TYPE``): pass@1 (greedy) on the problems of ``humaneval_subset``, the
  prompt and sandbox of aloepri.eval.humaneval, the client mapping ids in and out with the key as a real client does;
  problem by problem, every configuration on a problem before the next, so a partial run compares like with like.
- ``attacks`` (``PRESET``): ``aloepri attack ATTACKS --budget ci`` on the obfuscated checkpoint (safetensors, the
  weights the GGUF files were exported from), TTRSR and PIIRSR from its report.

Stages run fidelity, attacks, HumanEval. Resumable: every problem-level result is its own entry.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from ..lib import ResultStore, UsageError
from ..lib.models import model_path
from ..lib.variants import preset_params

PLAINTEXT = "plaintext"


@dataclass(frozen=True)
class Settings:
    model: str = "qwen-coder-1.5b"
    seed: int = 2026
    dtype: str = "bfloat16"
    fidelity: tuple[str, ...] = ("default:q8_0", "default:q4_k_m", "noisy:q8_0", "paper:q8_0")
    prompts: int = 8
    reply_tokens: int = 64
    humaneval: tuple[str, ...] = ("plaintext:q8_0", "default:q8_0", "noisy:q8_0", "paper:q8_0")
    humaneval_subset: str = "ci"
    max_new_tokens: int = 384
    attacks: tuple[str, ...] = ("noisy", "paper")
    attack_names: str = "vma"
    threads: int = 2
    n_ctx: int = 2048


def _split(spec: str) -> tuple[str, str]:
    preset, sep, qtype = spec.partition(":")
    if not sep:
        raise UsageError(f"{spec!r}: expected PRESET:TYPE")
    return preset, qtype


class Models:
    """Obfuscated targets and GGUF files, built on first use and cached (benchmarks.lib.targets)."""

    def __init__(self, s: Settings):
        from aloepri.runtime.tokenizer import load_hf_tokenizer

        from ..lib.targets import WORK

        self.s = s
        self.src = model_path(s.model)
        self.work = Path(WORK) / "gguf"
        self.work.mkdir(parents=True, exist_ok=True)
        self.tokenizer = load_hf_tokenizer(self.src)  # the client's plaintext tokenizer, loaded once

    def target(self, preset: str):
        """``preset``, ``preset@SEED`` (another key of the same preset) or ``preset+alpha_e=0.5+alpha_h=0.1``
        (the preset with parameters overridden: a point of a noise sweep)."""
        from ..lib.targets import obfuscated

        name, _, seed = preset.partition("@")
        return obfuscated(self.src, preset_params(name), int(seed) if seed else self.s.seed, dtype=self.s.dtype)

    def gguf(self, preset: str, qtype: str) -> Path:
        from aloepri.export.gguf import export_gguf

        from ..lib.targets import plaintext_reference, prune, touch

        if preset == PLAINTEXT:
            out, model_dir = self.work / f"{self.src.stem}-plaintext-{qtype}.gguf", None
        else:
            t = self.target(preset)
            out, model_dir = self.work / f"{self.src.stem}-{t.cache_key}-{qtype}.gguf", t.model_dir
        if out.exists():
            touch(out)  # for the cache's least-recently-used order
        else:
            export_gguf(model_dir or plaintext_reference(self.src), out, qtype)
            prune(keep=(out,))
        return out

    def served_type(self, preset: str, qtype: str) -> str:
        """``qtype``, or f16 where the output's rows cannot be cut into 32-value blocks (an expansion h that the
        head count raised, e.g. ``paper`` on Qwen2.5-Coder: d + 2h = 1800); plaintext is always ``qtype``."""
        if preset == PLAINTEXT or qtype in ("f32", "f16"):
            return qtype
        cfg = json.loads((self.target(preset).model_dir / "config.json").read_text())
        rows = (cfg["hidden_size"], cfg["intermediate_size"],
                cfg["num_attention_heads"] * cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]))
        return qtype if all(r % 32 == 0 for r in rows) else "f16"

    def llama(self, path: Path):
        import llama_cpp

        return llama_cpp.Llama(str(path), n_ctx=self.s.n_ctx, n_threads=self.s.threads,
                               n_threads_batch=self.s.threads, logits_all=True, verbose=False)


def _greedy(llm, server_ids: list[int], max_tokens: int, stop_server: set[int]) -> tuple[list[int], float]:
    """Greedy server ids after ``server_ids`` (no repeat penalty), and the decode seconds per token (first token
    to last: the prompt's prefill is not in it)."""
    out: list[int] = []
    first = last = 0.0
    for tok in llm.generate(server_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        last = time.perf_counter()
        first = first or last
        if tok in stop_server or len(out) >= max_tokens:
            break
        out.append(int(tok))
    return out, (last - first) / max(1, len(out) - 1)


def _logits(llm, server_ids: list[int], first: int):
    """llama.cpp's logits at positions ``first`` .. end-1 (each predicting the next token), float32."""
    import numpy as np

    llm.reset()
    llm.eval(server_ids)
    return np.array(llm.scores[first:len(server_ids)], dtype=np.float32)


def _margin(row) -> float:
    import numpy as np

    top2 = np.partition(row, -2)[-2:]
    return float(top2[1] - top2[0])


def _eos(tokenizer) -> set[int]:
    from aloepri.eval.humaneval import _eos_ids

    return set(_eos_ids(tokenizer))


def run_fidelity(s: Settings, store: ResultStore, models: Models) -> None:
    import numpy as np

    from aloepri.keyfile import load_key

    from .gguf_fidelity import compare, log_softmax, pooled

    todo = [spec for spec in s.fidelity if not store.has(f"fidelity/{spec}")]
    if not todo:
        return
    served = {spec: models.served_type(*_split(spec)) for spec in todo}
    from aloepri.eval.fidelity import builtin_prompt_ids

    prompts, eos = builtin_prompt_ids(models.tokenizer, 0, s.prompts), _eos(models.tokenizer)
    for qtype in dict.fromkeys(served.values()):
        plain_path = models.gguf(PLAINTEXT, qtype)
        llm = models.llama(plain_path)
        plain = []  # (prompt ids, reply ids, log-probs over the reply, seconds per token)
        for ids in prompts:
            reply, spt = _greedy(llm, ids, s.reply_tokens, eos)
            plain.append((ids, reply, log_softmax(_logits(llm, ids + reply, len(ids) - 1)), spt))
        del llm
        for spec in todo:
            preset, requested = _split(spec)
            if served[spec] != qtype:
                continue
            target = models.target(preset)
            key = load_key(target.key_path)
            path = models.gguf(preset, qtype)
            llm = models.llama(path)
            vocab = llm.n_vocab()
            enc = np.asarray(key.encode_ids(list(range(vocab))))  # plain id -> server id
            eos_server = {int(enc[i]) for i in eos if i < vocab}
            parts, prompts_out = [], []
            for ids, reply, ref, plain_spt in plain:
                got = log_softmax(_logits(llm, key.encode_ids(ids + reply), len(ids) - 1)[:, enc])
                parts.append(compare(ref, got))
                own_server, spt = _greedy(llm, key.encode_ids(ids), s.reply_tokens, eos_server)
                own = key.decode_ids(own_server)
                div = next((i for i, (a, b) in enumerate(zip(own, reply)) if a != b),
                           None if len(own) == len(reply) else min(len(own), len(reply)))
                row = {"prompt_tokens": len(ids), "reply_tokens": len(reply), "same_greedy_reply": div is None,
                       "plain_seconds_per_token": round(plain_spt, 4), "obfuscated_seconds_per_token": round(spt, 4)}
                if div is not None and div < len(reply) and div < len(own):
                    # the plaintext model's margin at the divergence (teacher-forced on its own reply), and the
                    # obfuscated model's on the same prefix
                    row.update(diverged_at=div, plain_margin=round(_margin(ref[div]), 4),
                               obfuscated_margin=round(_margin(got[div]), 4))
                elif div is not None:
                    row.update(diverged_at=div, length_differs=True)
                prompts_out.append(row)
            del llm
            plain_spt = sum(p[3] for p in plain) / len(plain)
            obf_spt = sum(r["obfuscated_seconds_per_token"] for r in prompts_out) / len(prompts_out)
            store.put(f"fidelity/{spec}", {
                **pooled(parts), "preset": preset, "type": qtype, "requested_type": requested, "prompts": prompts_out,
                "same_greedy_replies": sum(r["same_greedy_reply"] for r in prompts_out),
                "plain_tokens_per_second": round(1 / plain_spt, 2), "obfuscated_tokens_per_second": round(1 / obf_spt, 2),
                "plain_bytes": plain_path.stat().st_size, "obfuscated_bytes": path.stat().st_size,
                "source_bytes": models.src.stat().st_size, "params": target_params(preset)})
            print(f"fidelity/{spec}", json.dumps({k: v for k, v in store.get(f"fidelity/{spec}").items()
                                                  if k not in ("prompts", "params")}), flush=True)


def target_params(preset: str) -> dict:
    return preset_params(preset.partition("@")[0]).to_dict()


class LlamaCppRunner:
    """aloepri.eval.humaneval's Runner on llama.cpp: the client maps ids in and out with its key (or none)."""

    def __init__(self, label: str, llm, tokenizer, key=None):
        self.label, self.llm, self.tokenizer, self.key = label, llm, tokenizer, key
        self.eos = _eos(tokenizer)

    def complete(self, problem: dict, max_new_tokens: int) -> dict:
        from aloepri.eval.humaneval import build_prompt_ids, truncate_at_stop

        ids, _ = build_prompt_ids(self.tokenizer, problem)
        to_s = self.key.encode_ids if self.key else (lambda v: list(v))
        from_s = self.key.decode_ids if self.key else (lambda v: list(v))
        out: list[int] = []
        text, stopped = "", False
        t0 = time.perf_counter()
        for tok in self.llm.generate(to_s(ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                     reset=True):
            plain = from_s([int(tok)])[0]
            if plain in self.eos:
                stopped = True
                break
            out.append(plain)
            text, stopped = truncate_at_stop(self.tokenizer.decode(out))
            if stopped or len(out) >= max_new_tokens:
                break
        if not stopped:
            text = self.tokenizer.decode(out)
        return {"completion": text, "new_tokens": len(out), "stopped": stopped, "prompt_tokens": len(ids),
                "gen_seconds": time.perf_counter() - t0}


def run_humaneval(s: Settings, store: ResultStore, models: Models) -> None:
    """Problem by problem, every configuration on the problem before the next problem (one model loaded at a
    time), so that a stopped run leaves every configuration measured on the same problems."""
    from aloepri.eval.humaneval import check_completion, select_problems
    from aloepri.keyfile import load_key

    problems = select_problems(s.humaneval_subset)
    for tid, problem in problems.items():
        for spec in s.humaneval:
            entry = f"humaneval/{spec}/{tid}"
            if store.has(entry):
                continue
            preset, qtype = _split(spec)
            key = None if preset == PLAINTEXT else load_key(models.target(preset).key_path)
            path = models.gguf(preset, models.served_type(preset, qtype))
            runner = LlamaCppRunner(spec, models.llama(path), models.tokenizer, key)
            r = runner.complete(problem, s.max_new_tokens)
            del runner
            ex = check_completion(problem, r["completion"])
            store.put(entry, {**r, "status": ex.status, "detail": ex.detail, "passed": ex.passed, "gguf": path.name})


def run_attacks(s: Settings, store: ResultStore, models: Models) -> None:
    import tempfile

    from .device_attack import attack_once

    entries = store.load()["entries"]
    for preset in s.attacks:
        # one `aloepri attack` process and one entry per attack, so a stopped run keeps the attacks it finished;
        # an entry "attacks/PRESET" (one process for every name) from earlier runs still counts
        done = {name for k, e in entries.items() if k.startswith("attacks/") and e["preset"] == preset
                for name in e["attacks"]}
        todo = [n for n in s.attack_names.split(",") if n and n not in done]
        t = models.target(preset) if todo else None
        for name in todo:
            with tempfile.TemporaryDirectory(prefix="aloepri-quantized-attack-") as work:
                row = attack_once(models.src, t.model_dir, t.key_path, name, "cpu", "default", "ci", 10,
                                  s.threads, Path(work))
            store.put(f"attacks/{preset}/{name}", {**row, "preset": preset})
            print(f"attacks/{preset}/{name}", json.dumps(row["attacks"]), flush=True)


def run(s: Settings, store: ResultStore) -> None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise UsageError("llamacpp_quantized needs llama-cpp-python: pip install 'aloepri[llamacpp]'") from None
    models = Models(s)
    run_fidelity(s, store, models)
    run_attacks(s, store, models)  # the privacy side before the long accuracy run
    run_humaneval(s, store, models)


def _humaneval_rows(entries: dict) -> dict[str, dict]:
    by: dict[str, dict] = {}
    for k, e in entries.items():
        if k.startswith("humaneval/"):
            _, spec, tid = k.split("/", 2)
            by.setdefault(spec, {})[tid] = e
    return by


def report(store: ResultStore) -> str:
    entries = store.entries()
    settings = store.load()["settings"]
    model = settings["model"]
    # decode speeds are stored, not reported: plaintext and obfuscated run minutes apart, not side by side
    out = []
    if settings.get("fidelity"):
        out += ["| model | preset | type | top-1 | KL (nats) | same greedy reply | divergences: plaintext margin / "
                "obfuscated margin | file MB, plaintext / obfuscated |", "|---|---|---|---|---|---|---|---|"]
    for k, e in entries.items():
        if not k.startswith("fidelity/"):
            continue
        divs = ", ".join(f"{p['plain_margin']:.2f} / {p['obfuscated_margin']:.2f}" for p in e["prompts"]
                         if "plain_margin" in p) or "-"
        out.append(f"| {model} | {e['preset']} | {e['type']} | {e['top1']:.4f} | {e['kl']:.2e} | "
                   f"{e['same_greedy_replies']}/{len(e['prompts'])} | {divs} | "
                   f"{e['plain_bytes'] / 1e6:.0f} / {e['obfuscated_bytes'] / 1e6:.0f} |")
    he = _humaneval_rows(entries)
    if settings.get("humaneval"):  # the tables a config's settings ask for, present even while empty
        plain = next((rows for spec, rows in he.items() if spec.startswith(PLAINTEXT + ":")), {})
        out += [""] * bool(out) + ["| model | HumanEval | problems | passed | pass@1 | plaintext on the same problems | "
                    "same completion as plaintext |", "|---|---|---|---|---|---|---|"]
        for spec, rows in he.items():
            n, passed = len(rows), sum(bool(r["passed"]) for r in rows.values())
            common = [t for t in rows if t in plain]
            pp = sum(bool(plain[t]["passed"]) for t in common)
            same = sum(rows[t]["completion"] == plain[t]["completion"] for t in common)
            out.append(f"| {model} | {spec} | {n} | {passed} | {passed / n:.2f} | {pp}/{len(common)} | {same}/{len(common)} |")
    attacks = [e for k, e in entries.items() if k.startswith("attacks/")]
    if settings.get("attacks"):
        out += [""] * bool(out) + ["| model | preset | attack | TTRSR | PIIRSR | vocabulary recovery | seconds |",
                "|---|---|---|---|---|---|---|"]
        for e in attacks:
            preset = e["preset"]
            for name, a in e["attacks"].items():
                voc = "-" if a["vocab_recovery"] is None else f"{a['vocab_recovery']:.4f}"
                out.append(f"| {model} | {preset} | {name} | {a['ttrsr']:.3f} | {a['piirsr']:.3f} | {voc} | {a['seconds']:.0f} |")
    return "\n".join(out)


SUMMARY = ("obfuscated vs plaintext GGUF on llama.cpp at the same quantization (q8_0, q4_k_m): fidelity, greedy "
           "identity with margins, HumanEval pass@1, attacks on the same checkpoints")
CONFIGS = {
    # docs/serving-gguf.md and docs/accuracy.md: the 1.5B model (hours on 2 cores)
    "qwen-coder-1.5b": Settings(),
    # the same harness on the two smaller real models, for the table across scales
    # (HumanEval without `default`, whose fidelity row shows it lossless)
    "qwen-coder": Settings(model="qwen-coder", humaneval=("plaintext:q8_0", "noisy:q8_0", "paper:q8_0")),
    "smollm2": Settings(model="smollm2", humaneval=("plaintext:q8_0", "noisy:q8_0", "paper:q8_0")),
    # a noise sweep at 1.5B between `noisy` (alpha 0.1/0.05, VMA 100%) and `paper` (1.0/0.2 with expansion): the
    # paper's alpha without the expansion, and half of it, served at q8_0; VMA on the same checkpoints
    "qwen-coder-1.5b-alpha": Settings(fidelity=("noisy+alpha_e=0.5+alpha_h=0.1:q8_0", "noisy+alpha_e=1.0+alpha_h=0.2:q8_0"),
                                      humaneval=(), attacks=("noisy+alpha_e=0.5+alpha_h=0.1",
                                                             "noisy+alpha_e=1.0+alpha_h=0.2")),
    # the composed behavioural attack on the same two checkpoints (the same seed, the same cached targets)
    "qwen-coder-1.5b-alpha-composed": Settings(fidelity=(), humaneval=(), attacks=("noisy+alpha_e=1.0+alpha_h=0.2",
                                                                                  "noisy+alpha_e=0.5+alpha_h=0.1"),
                                               attack_names="behavioural-composed"),
    # the strongest attacks of the smaller models on the 1.5B model's `paper` checkpoint (the one VMA reads least
    # of); the checkpoint is the `qwen-coder-1.5b` config's (same seed, same cached target)
    "qwen-coder-1.5b-strong": Settings(fidelity=(), humaneval=(), attacks=("paper",),
                                       attack_names="isa_anchor,behavioural-composed"),
    # greedy identity over keys: SmolLM2's `exact` output (h = 128) in float32 on llama.cpp, 20 keys x 4 prompts
    "smollm2-exact-keys": Settings(model="smollm2", dtype="float32", prompts=4, humaneval=(), attacks=(),
                                   fidelity=tuple(f"exact@{k}:f32" for k in range(1, 21))),
    # a check that the path runs: SmolLM2, one preset, two prompts, two problems, no attack
    "smoke": Settings(model="smollm2", fidelity=("default:q8_0",), prompts=2, reply_tokens=8,
                      humaneval=("plaintext:q8_0", "default:q8_0"), humaneval_subset="2", max_new_tokens=16,
                      attacks=(), n_ctx=1024),
}
DEFAULT_CONFIG = "qwen-coder-1.5b"
DOCS = ("docs/serving-gguf.md", "docs/accuracy.md", "docs/security.md")
NOTES = "needs llama-cpp-python; the 1.5B config obfuscates three presets (about 10 min each) and runs for hours"
