"""The Python API: plain functions on in-memory objects, which the command line calls."""
