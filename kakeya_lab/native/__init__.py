"""Compiled kernels, built once per machine from the sources beside this file
(:mod:`kakeya_lab.native.build`): the few-row product (:mod:`kakeya_lab.native.rows`) and
a layer step's small operations (:mod:`kakeya_lab.native.step`)."""
