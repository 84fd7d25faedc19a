"""Differential fuzzers: test oracles, with a command for long runs."""
