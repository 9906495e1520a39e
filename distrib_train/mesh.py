"""Moved to ``distrib_train.sharding.mesh``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.sharding import mesh as _moved

warnings.warn("distrib_train.mesh moved to distrib_train.sharding.mesh; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
