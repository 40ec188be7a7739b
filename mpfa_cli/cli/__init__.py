"""The `mpfa` command line: a thin Typer front end over `mpfa.harness` and `mpfa.profiles`."""
