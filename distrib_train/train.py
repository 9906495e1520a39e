"""Moved to ``distrib_train.cli`` (run ``distrib-train`` or ``python -m distrib_train``); this old name goes in
the next release."""

import sys
import warnings

from distrib_train import cli as _moved

warnings.warn("distrib_train.train moved to distrib_train.cli (python -m distrib_train); the old name goes in the"
              " next release.", DeprecationWarning, stacklevel=2)
if __name__ == "__main__":
  _moved.run()
else:
  sys.modules[__name__] = _moved
