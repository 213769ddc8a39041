"""Workarounds for what fairseq2 0.8.1, PyTorch 2.9 and fla-core 0.6.0 offer
no public way to do (or do wrong), one module per workaround, named for its
purpose.

Each relies on internals of its library, and a test under
``tests/unit/compat`` (or the one its docstring names) fails as soon as the
behaviour it relies on changes, so that an upgrade shows what to revisit.
"""
