"""Moved to ``distrib_train.checkpoint.checks``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.checkpoint import checks as _moved

warnings.warn("distrib_train.checkpoint_checks moved to distrib_train.checkpoint.checks; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
