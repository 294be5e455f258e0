"""TEMPORARY shim, removed before 19:55: aloepri.gguf_export moved to aloepri.export.gguf."""
import sys

from .export import gguf as _moved

sys.modules[__name__] = _moved
