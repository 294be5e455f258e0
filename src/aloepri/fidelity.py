"""TEMPORARY shim, removed before 19:55: aloepri.fidelity moved to aloepri.runtime.fidelity."""
import sys

from .runtime import fidelity as _moved

sys.modules[__name__] = _moved
