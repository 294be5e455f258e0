"""TEMPORARY shim, removed before 19:55: aloepri.server_tokenizer moved to aloepri.obfuscation.server_tokenizer."""
import sys

from .obfuscation import server_tokenizer as _moved

sys.modules[__name__] = _moved
