"""The one error of echobench.predict: a run or a profile the model cannot price."""


class PredictError(ValueError):
    """A run or a profile the model cannot price: one line naming what is missing and the fix."""
