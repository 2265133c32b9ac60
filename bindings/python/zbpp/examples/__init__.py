"""Runnable examples that double as tests: `python3 -m zbpp.examples.train_gpt --help`."""
