"""The experiment system's library: registry, results store, typed settings, models, cached targets."""
from .registry import Experiment, all_experiments, get_experiment, register
from .store import ResultStore, SettingsMismatchError, UsageError

__all__ = ["Experiment", "ResultStore", "SettingsMismatchError", "UsageError", "all_experiments", "get_experiment", "register"]
