"""Moved to ``distrib_train.sharding.planner``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.sharding import planner as _moved

warnings.warn("distrib_train.planner moved to distrib_train.sharding.planner; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
