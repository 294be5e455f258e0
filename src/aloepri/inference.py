"""TEMPORARY shim, removed before 19:55: aloepri.inference moved to aloepri.runtime.inference."""
import sys

from .runtime import inference as _moved

sys.modules[__name__] = _moved
