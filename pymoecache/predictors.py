"""Files of fitted predictors (:func:`pymoecache.tune.fit_predictor`): ``{layer: [n_expert, n_embd]}``
float32 matrices in an npz with a format tag, read by ``Llama.load_predictor``. Apart from tune.py
so that llama.py can read them without importing the evaluation code."""

from __future__ import annotations

PREDICTOR_FORMAT = "pymoecache-predictor"


def save_predictor(path, predictors, model: str = "") -> None:
    """Write ``{layer: [n_expert, n_embd]}`` predictors to ``path`` (npz, atomically)."""
    import io

    import numpy as np

    from .files import write_atomic

    buf = io.BytesIO()
    np.savez(buf, format=np.array(PREDICTOR_FORMAT), model=np.array(str(model)),
             **{f"layer_{il}": np.asarray(w, dtype=np.float32) for il, w in predictors.items()})
    write_atomic(path, buf.getvalue(), "predictor")


def load_predictor(path):
    """``{layer: [n_expert, n_embd] float32}`` from a file of :func:`save_predictor`; ConfigError if it is not one."""
    import numpy as np

    from .errors import ConfigError

    try:
        with np.load(path, allow_pickle=False) as f:
            if "format" not in f.files or str(f["format"]) != PREDICTOR_FORMAT:
                raise ConfigError(f"{path} is not a pymoecache predictor file")
            return {int(k[len("layer_"):]): np.asarray(f[k], dtype=np.float32) for k in f.files if k.startswith("layer_")}
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the predictor file {path}: {e}") from e
