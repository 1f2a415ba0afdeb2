"""Scripts run from a checkout by the `deepspeed` launcher (train.py) and the benchmarks (bench/); not installed."""
