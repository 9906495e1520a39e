"""Moved to ``distrib_train.podplan.hlo``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.podplan import hlo as _moved

warnings.warn("distrib_train.hlo_module moved to distrib_train.podplan.hlo; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
