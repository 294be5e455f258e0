"""TEMPORARY shim, removed before 19:55: aloepri.params moved to aloepri.obfuscation.params."""
import sys

from .obfuscation import params as _moved

sys.modules[__name__] = _moved
