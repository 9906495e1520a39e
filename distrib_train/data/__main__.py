"""``python -m distrib_train.data convert INPUT [INPUT ...] OUTPUT [--shards N]``."""

from distrib_train.data.record_shards import main

main()
