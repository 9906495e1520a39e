"""Moved to ``distrib_train.podplan.search``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.podplan import search as _moved

warnings.warn("distrib_train.mesh_search moved to distrib_train.podplan.search; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
