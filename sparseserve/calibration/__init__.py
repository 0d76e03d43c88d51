"""Offline calibration of engine options from a dense run: `sparseserve calibrate` (calibration/cli.py)."""
