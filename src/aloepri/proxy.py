"""TEMPORARY shim, removed before 19:55: aloepri.proxy moved to aloepri.serving.proxy."""
import sys

from .serving import proxy as _moved

sys.modules[__name__] = _moved
