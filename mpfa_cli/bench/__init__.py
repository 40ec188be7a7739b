"""A bench run: servers started per backend, each load point measured and stored, progress on the terminal."""
