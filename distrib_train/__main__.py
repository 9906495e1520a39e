"""``python -m distrib_train``: the ``distrib-train`` command."""

from distrib_train.cli import run

run()
