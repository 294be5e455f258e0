"""TEMPORARY shim, removed before 19:55: aloepri.staging moved to aloepri.storage.staging."""
import sys

from .storage import staging as _moved

sys.modules[__name__] = _moved
