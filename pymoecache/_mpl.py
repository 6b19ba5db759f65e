"""matplotlib on demand (the Agg backend): ``import pymoecache`` never imports it, and a figure
without it is a clear error. Imports nothing of the package but its errors (plots.py, timeline.py)."""

from .errors import EvalError


def require_matplotlib():
    """Import matplotlib with the Agg backend, or raise EvalError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise EvalError("plotting needs matplotlib: pip install matplotlib (or pip install 'pymoecache[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
