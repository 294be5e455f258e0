"""TEMPORARY shim, removed before 19:55: aloepri.checkpoint moved to aloepri.obfuscation.checkpoint."""
import sys

from .obfuscation import checkpoint as _moved

sys.modules[__name__] = _moved
