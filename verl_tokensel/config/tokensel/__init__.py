"""Hydra config group ``tokensel`` (package data; a package so that setuptools ships it as one)."""
