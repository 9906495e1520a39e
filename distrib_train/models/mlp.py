"""Moved to ``distrib_train.recipes.mlp``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.recipes import mlp as _moved

warnings.warn("distrib_train.models.mlp moved to distrib_train.recipes.mlp; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
