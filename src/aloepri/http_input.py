"""TEMPORARY shim, removed before 19:55: aloepri.http_input moved to aloepri.serving.http."""
import sys

from .serving import http as _moved

sys.modules[__name__] = _moved
