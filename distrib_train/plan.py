"""Moved to ``distrib_train.sharding.plan``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.sharding import plan as _moved

warnings.warn("distrib_train.plan moved to distrib_train.sharding.plan; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
