"""TEMPORARY shim, removed before 19:55: aloepri.secrets moved to aloepri.obfuscation.secrets."""
import sys

from .obfuscation import secrets as _moved

sys.modules[__name__] = _moved
