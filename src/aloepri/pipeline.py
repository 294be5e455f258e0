"""TEMPORARY shim, removed before 19:55: aloepri.pipeline moved to aloepri.obfuscation.pipeline."""
import sys

from .obfuscation import pipeline as _moved

sys.modules[__name__] = _moved
