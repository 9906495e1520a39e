"""Moved to ``distrib_train.podplan.cli``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.podplan import cli as _moved

warnings.warn("distrib_train.plan_cli moved to distrib_train.podplan.cli; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
