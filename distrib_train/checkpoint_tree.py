"""Moved to ``distrib_train.checkpoint.tree``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.checkpoint import tree as _moved

warnings.warn("distrib_train.checkpoint_tree moved to distrib_train.checkpoint.tree; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
