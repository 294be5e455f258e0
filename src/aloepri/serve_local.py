"""TEMPORARY shim, removed before 19:55: aloepri.serve_local moved to aloepri.serving.local_server."""
import sys

from .serving import local_server as _moved

sys.modules[__name__] = _moved
