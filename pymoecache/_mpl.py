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


def check_image_path(path, what: str = "plot") -> None:
    """EvalError unless matplotlib can write a picture to ``path`` by its extension (.png, .svg,
    .pdf, ...): said before any work, not after it."""
    import os

    require_matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(str(path))[1].lower().lstrip(".")
    if ext not in kinds:
        raise EvalError(f"{what} {path}: matplotlib writes {', '.join('.' + k for k in sorted(kinds))}; "
                        f"{('.' + ext) if ext else 'a name without an extension'} is none of them")
