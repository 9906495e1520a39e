"""Moved to ``distrib_train.podplan.report``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.podplan import report as _moved

warnings.warn("distrib_train.podplan_report moved to distrib_train.podplan.report; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
