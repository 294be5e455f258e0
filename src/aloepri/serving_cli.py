"""TEMPORARY shim, removed before 19:55: aloepri.serving_cli moved to aloepri.serving.cli."""
import sys

from .serving import cli as _moved

sys.modules[__name__] = _moved
