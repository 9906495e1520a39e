"""Moved to ``distrib_train.training.optimizers``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.training import optimizers as _moved

warnings.warn("distrib_train.optimizers moved to distrib_train.training.optimizers; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
