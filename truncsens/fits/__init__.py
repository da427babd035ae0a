"""Fits: decay laws of D(w), curves of a results Dataset, bootstrap intervals, the fit file."""
