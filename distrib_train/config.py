"""Moved to ``distrib_train.training.config``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.training import config as _moved

warnings.warn("distrib_train.config moved to distrib_train.training.config; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
