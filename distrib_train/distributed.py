"""Moved to ``distrib_train.cluster.distributed``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.cluster import distributed as _moved

warnings.warn("distrib_train.distributed moved to distrib_train.cluster.distributed; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
