"""mpfa: benchmark and profile LLM serving across attention backends, and the MpFA backend.

The repository root is this package: a folder's import path is `mpfa.` and its path (`kernels/sm90/` is
`mpfa.kernels.sm90`, `mpfa_cli/harness/` is `mpfa.mpfa_cli.harness`)."""
