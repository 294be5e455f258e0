"""TEMPORARY shim, removed before 19:55: aloepri.client moved to aloepri.serving.client."""
import sys

from .serving import client as _moved

sys.modules[__name__] = _moved
