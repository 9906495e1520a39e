"""Moved to ``distrib_train.training.compilation``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.training import compilation as _moved

warnings.warn("distrib_train.compilation moved to distrib_train.training.compilation; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
