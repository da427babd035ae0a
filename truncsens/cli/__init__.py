"""The truncsens command line (Typer). One module per command; each exposes ``register(app)``."""
