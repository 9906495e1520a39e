"""Moved to ``distrib_train.podplan.cpu_attention``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.podplan import cpu_attention as _moved

warnings.warn("distrib_train.cpu_attention moved to distrib_train.podplan.cpu_attention; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
