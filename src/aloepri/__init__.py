"""aloepri: privacy-preserving LLM inference by covariant obfuscation (the AloePri method)."""
from .archs import UnsupportedArchitectureError, supported_architectures
from .checkpoint import CheckpointError
from .keyfile import KeyFile, KeyFileError, KeyMismatchError, check_key_matches, load_key
from .params import PRESETS, ObfuscationParams, resolve_params
from .pipeline import ObfuscationResult, obfuscate

__all__ = [
    "CheckpointError", "KeyFile", "KeyFileError", "KeyMismatchError", "ObfuscationParams", "ObfuscationResult",
    "PRESETS", "UnsupportedArchitectureError", "check_key_matches", "load_key", "obfuscate", "resolve_params",
    "supported_architectures", "PrivateModel", "Client", "AsyncClient",
]


def __getattr__(name):  # lazy: the inference client pulls in transformers' model classes
    if name == "PrivateModel":
        from .inference import PrivateModel

        return PrivateModel
    if name in ("Client", "AsyncClient"):  # the serving client SDK (aloepri.client)
        from . import client

        return getattr(client, name)
    raise AttributeError(name)
