"""Compiled kernels, built once per machine from the sources beside this file
(:mod:`kakeya_lab.native.rows`)."""
