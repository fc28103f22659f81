"""Subcommands of the `vlserve` console script, one module each."""
