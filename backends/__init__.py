"""Backends (installed as pagedjax.backends): one ModelRunner per framework, chosen by name
through the registry in pagedjax.core.model_runner, plus the weight mapping and rope tables
they share.
"""
