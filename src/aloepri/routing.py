"""TEMPORARY shim, removed before 19:55: aloepri.routing moved to aloepri.obfuscation.routing."""
import sys

from .obfuscation import routing as _moved

sys.modules[__name__] = _moved
