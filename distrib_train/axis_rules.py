"""Moved to ``distrib_train.sharding.axis_rules``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.sharding import axis_rules as _moved

warnings.warn("distrib_train.axis_rules moved to distrib_train.sharding.axis_rules; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
