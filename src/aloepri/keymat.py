"""TEMPORARY shim, removed before 19:55: aloepri.keymat moved to aloepri.obfuscation.keymat."""
import sys

from .obfuscation import keymat as _moved

sys.modules[__name__] = _moved
