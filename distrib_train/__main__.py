"""``python -m distrib_train``: the ``distrib-train`` command."""

from distrib_train.cli import run

if __name__ == "__main__":  # not in a data worker process, which imports this module as __mp_main__
  run()
