"""The torch backend as Keras calls it: the package's versions of Keras'
torch backend ops (each module mirrors the Keras file of the same name).

Modules, bottom first (a module imports only those above it):

- `core`: `convert_to_tensor` without a copy from the host for a Python
  number.
- `numpy`: `einsum` as one matrix product where the equation is one.
- `nn`: `sparse_categorical_crossentropy` on rows, the class dim last.

Nothing is re-exported: importing the package imports none of them.
"""
