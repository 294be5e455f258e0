"""TEMPORARY shim, removed before 19:55: aloepri.transforms moved to aloepri.obfuscation.transforms."""
import sys

from .obfuscation import transforms as _moved

sys.modules[__name__] = _moved
