"""Moved to ``distrib_train.cluster.xla_flags_check``; this old name goes in the next release."""

import sys
import warnings

from distrib_train.cluster import xla_flags_check as _moved

warnings.warn("distrib_train.xla_flags_check moved to distrib_train.cluster.xla_flags_check; the old name goes in"
              " the next release.", DeprecationWarning, stacklevel=2)
if __name__ == "__main__":
  sys.exit(_moved.main())
else:
  sys.modules[__name__] = _moved
