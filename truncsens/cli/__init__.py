"""The truncsens command line (Typer). One module per command; each exposes ``register(app)``.

May import: truncsens.api (and what it returns); nothing imports the CLI.
"""
