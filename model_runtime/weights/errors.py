"""The one error type of model loading (re-exported as `model_runtime.weights.ModelLoadError`)."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model spec, file or tensor cannot be used; the message names the file and the problem."""
