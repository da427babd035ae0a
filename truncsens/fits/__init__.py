"""Fits: decay laws of D(w), curves of a results Dataset, bootstrap intervals, the fit file.

May import: results' schema (in-memory Datasets, never its files), metrics and the math modules.
"""
