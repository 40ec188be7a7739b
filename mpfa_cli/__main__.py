"""`python -m mpfa.mpfa_cli`: the `mpfa` command."""
from .app import app

app(prog_name="mpfa")
