"""`python -m mpfa.cli`: the `mpfa` command."""
from mpfa.cli.app import app

app(prog_name="mpfa")
