"""The `mpfa` commands: one module per command group, a thin Typer front end over the packages below it."""
