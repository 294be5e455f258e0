"""Experiments registered by name: what they measure, their typed settings, named configs, run and report.

An experiment is a module in ``benchmarks/experiments/``, registered under the module's name from its
module-level declarations (``from_module``). A config
is a named instance of the experiment's settings dataclass; ``--set FIELD=VALUE`` overrides are parsed by that
dataclass's field types and must be saved under a new config name (``--save-as``), so a config name always
means the same settings.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable

from .store import ResultStore, UsageError


@dataclass(frozen=True)
class Experiment:
    name: str
    summary: str  # one line: what it measures
    settings: type  # a dataclass of the experiment's settings
    configs: dict[str, Any]  # config name -> settings instance
    run: Callable[[Any, ResultStore], None]  # (settings, store): resumable, skips entries the store has
    report: Callable[[ResultStore], str]  # Markdown (and figures beside the results file)
    default_config: str | None = None  # None: the first of ``configs``
    docs: tuple[str, ...] = ()  # the docs that cite it
    notes: str = ""  # cost, what it needs installed
    legacy_configs: tuple[str, ...] = field(default=())  # result files kept from before (report only, not rerun)

    def __post_init__(self):
        if not dataclasses.is_dataclass(self.settings):
            raise TypeError(f"{self.name}: settings must be a dataclass")
        for name, cfg in self.configs.items():
            if not isinstance(cfg, self.settings):
                raise TypeError(f"{self.name}: config {name!r} is not a {self.settings.__name__}")

    @property
    def config_names(self) -> list[str]:
        return list(self.configs)

    def config(self, name: str | None) -> Any:
        name = name or self.default_config or self.config_names[0]
        if name not in self.configs:
            raise UsageError(f"{self.name} has no config {name!r}; configs: {', '.join(self.configs)}")
        return self.configs[name]

    def store(self, config: str, settings: Any | None = None) -> ResultStore:
        from .fields import to_jsonable

        return ResultStore(self.name, config, None if settings is None else to_jsonable(settings))


_REGISTRY: dict[str, Experiment] = {}


def register(experiment: Experiment) -> Experiment:
    if experiment.name in _REGISTRY and _REGISTRY[experiment.name] is not experiment:
        raise ValueError(f"two experiments named {experiment.name!r}")
    _REGISTRY[experiment.name] = experiment
    return experiment


def from_module(module) -> Experiment:
    """The experiment a module of ``benchmarks/experiments`` declares: its name is the module's, and its parts are
    module-level names -- ``Settings`` (dataclass), ``CONFIGS``, ``run``, ``report``, ``SUMMARY``, and optionally
    ``DEFAULT_CONFIG``, ``DOCS``, ``NOTES``, ``LEGACY_CONFIGS``."""
    name = module.__name__.rsplit(".", 1)[-1]
    missing = [a for a in ("Settings", "CONFIGS", "run", "report", "SUMMARY") if not hasattr(module, a)]
    if missing:
        raise TypeError(f"experiment module {module.__name__} lacks {', '.join(missing)}")
    return Experiment(name=name, summary=module.SUMMARY, settings=module.Settings, configs=module.CONFIGS,
                      run=module.run, report=module.report, default_config=getattr(module, "DEFAULT_CONFIG", None),
                      docs=tuple(getattr(module, "DOCS", ())), notes=getattr(module, "NOTES", ""),
                      legacy_configs=tuple(getattr(module, "LEGACY_CONFIGS", ())))


def _discover() -> None:
    from .. import experiments

    for mod in pkgutil.iter_modules(experiments.__path__):
        if mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"{experiments.__name__}.{mod.name}")
        if mod.name not in _REGISTRY:
            register(from_module(module))


def all_experiments() -> dict[str, Experiment]:
    _discover()
    return dict(sorted(_REGISTRY.items()))


def get_experiment(name: str) -> Experiment:
    experiments = all_experiments()
    if name not in experiments:
        raise UsageError(f"no experiment {name!r}; `python -m benchmarks list` shows them")
    return experiments[name]
