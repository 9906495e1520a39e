"""Moved to ``distrib_train.training.metrics``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.training import metrics as _moved

warnings.warn("distrib_train.metrics moved to distrib_train.training.metrics; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
