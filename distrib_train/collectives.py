"""Moved to ``distrib_train.podplan.collectives``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.podplan import collectives as _moved

warnings.warn("distrib_train.collectives moved to distrib_train.podplan.collectives; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
