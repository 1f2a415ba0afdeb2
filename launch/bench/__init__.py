"""The benchmarks; `harness` is the side-by-side runner they share (source tree only, not installed)."""
