"""TEMPORARY shim, removed before 19:55: aloepri.archs moved to aloepri.obfuscation.archs."""
import sys

from .obfuscation import archs as _moved

sys.modules[__name__] = _moved
