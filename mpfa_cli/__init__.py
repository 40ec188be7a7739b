"""The `mpfa` command (`app`) and what it runs: the serving harness, results, reports, bench runs and accuracy."""
