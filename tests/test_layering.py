"""The package's layers (docs/architecture.md): every import points down or sideways within a layer, never up,
and no modules import each other in a circle. Imports are read with ast (also those inside functions), so the
test needs no heavy dependency and fails on a new arrow the moment it is written."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "aloepri"

# bottom to top; a module may import from its own layer and the layers below it
LAYERS = [
    ["aloepri.storage", "aloepri.models", "aloepri.corpora", "aloepri.progress"],  # files on disk: atomic staging,
    # safetensors reading, resumable result files, progress bars,
    # bundled weights, public text corpora
    ["aloepri.keyfile"],  # the secret key and its binding to one obfuscated model
    ["aloepri.obfuscation"],  # archs, params, secrets, transforms, block strategies, checkpoint I/O, the pipeline
    # GGUF export; in-process inference, tokenizers, module view and probes, token perturbation, sensitivity;
    # tiny/synthetic models
    ["aloepri.export", "aloepri.runtime", "aloepri.testing"],
    ["aloepri.serving"],  # client SDK, proxy, local server, the shared OpenAI HTTP scaffold
    ["aloepri.attacks", "aloepri.eval"],  # attack suite; evaluation: fidelity, privacy budget, parameter search
    ["aloepri.baselines", "aloepri.audit"],  # baseline methods; the audit
    ["aloepri.cli", "aloepri"],  # the command line and the lazy public API (aloepri/__init__.py)
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The aloepri modules ``name`` imports (anywhere in the file)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "aloepri")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "aloepri":
                target = node.module
            else:
                continue
            for a in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{a.name}"
                out.add(sub if sub in known else target)
    return {m for m in out if m != name}


def _layer(module: str) -> int:
    best, best_len = None, -1
    for i, roots in enumerate(LAYERS):
        for root in roots:
            if (module == root or module.startswith(root + ".")) and len(root) > best_len:
                best, best_len = i, len(root)
    assert best is not None, f"{module} is in no layer: add it to LAYERS (and to docs/architecture.md)"
    return best


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_every_module_has_a_layer():
    for name in _modules():
        _layer(name)


def test_no_module_imports_from_a_higher_layer():
    upward = []
    for name, deps in _graph().items():
        for dep in deps:
            if _layer(dep) > _layer(name):
                upward.append(f"{name} (layer {_layer(name)}) imports {dep} (layer {_layer(dep)})")
    assert not upward, "imports that point up:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_layering_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The checker itself: an obfuscation module importing the serving layer is reported."""
    assert _layer("aloepri.obfuscation.pipeline") < _layer("aloepri.serving.client")
    fake = tmp_path / "aloepri" / "obfuscation"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("from ..serving.client import Client\n")
    deps = _imports("aloepri.obfuscation.bad", fake / "bad.py", {"aloepri.serving.client"})
    assert deps == {"aloepri.serving.client"}


_NO_TORCH = "assert 'torch' not in sys.modules, 'torch was imported'"


def _run(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_client_sdk_does_not_import_torch():
    """The light client maps ids and talks HTTP: importing it must not load a deep-learning framework."""
    _run("import sys, aloepri.serving.client; " + _NO_TORCH)
    _run("import sys, aloepri; aloepri.Client, aloepri.AsyncClient, aloepri.load_key, aloepri.KeyFile; " + _NO_TORCH)


def test_an_ids_only_client_does_not_import_torch():
    """A client without a plaintext tokenizer (ids in, ids out) is built and used without torch. (A client that
    loads a Hugging Face tokenizer does load torch: transformers imports it with AutoTokenizer.)"""
    _run("import sys\n"
         "from aloepri.keyfile import KeyFile\n"
         "from aloepri.serving.client import Client\n"
         "key = KeyFile(vocab_permutation=[2, 0, 1], model_fingerprint='f', params={}, seed=1, h_effective=0,\n"
         "              hidden_size=0, source='', architecture='llama')\n"
         "with Client(key, 'http://127.0.0.1:9') as c:\n"
         "    assert c.tokenizer is None\n"
         "    assert c.core.completion_prompt_ids([0, 2]) == [0, 2]\n"
         + _NO_TORCH)
