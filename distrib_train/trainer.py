"""Moved to ``distrib_train.training.trainer``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.training import trainer as _moved

warnings.warn("distrib_train.trainer moved to distrib_train.training.trainer; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
