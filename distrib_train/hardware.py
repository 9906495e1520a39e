"""Moved to ``distrib_train.cluster.hardware``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.cluster import hardware as _moved

warnings.warn("distrib_train.hardware moved to distrib_train.cluster.hardware; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
