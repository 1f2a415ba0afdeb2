"""One-off probes: each answered one question; its module docstring opens with the answer's place.

Kept runnable (``python launch/experiments/<name>.py``) so a result can be reproduced, but not maintained as
benchmarks: the maintained suites are behind ``python -m launch.bench SUITE`` (launch/bench/__main__.py).
"""
