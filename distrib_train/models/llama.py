"""Moved to ``distrib_train.recipes.llama``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.recipes import llama as _moved

warnings.warn("distrib_train.models.llama moved to distrib_train.recipes.llama; the old name goes in the next release.",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
