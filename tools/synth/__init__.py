"""Deterministic random-weight GGUF models for tests and benchmarks (a development tool: it needs
a source checkout with vendor/llama.cpp and is not installed with the package; tests and scripts
put tools/ on sys.path and ``import synth``).

The project's tests need real Mixture-of-Experts GGUF files that llama.cpp can
load and run, but the model hubs are not reachable. This module writes small
models with random weights instead:

* the architecture metadata and tensor layout follow what llama.cpp's loader
  expects for each architecture (see vendor/llama.cpp/src/models/<arch>.cpp);
* the tokenizer is a real vocabulary copied from one of the vocab-only files
  shipped with llama.cpp (vendor/llama.cpp/models/ggml-vocab-*.gguf);
* every weight comes from a numpy generator seeded with (seed, tensor name), so
  the same spec and seed always give a byte-identical file.

Public functions:

* ``build_fixture(name, out_dir, seed)`` writes one of the ``FIXTURES``;
* ``quantize(src, dst, ftype_name)`` makes a Q8_0 / Q4_K_M copy through
  llama.cpp's own quantizer (llama-cpp-python's ctypes API);
* ``build_all(out_dir, seed)`` writes every fixture plus quantized copies of
  the MoE ones, skipping files that are already up to date;
* ``build_bench_model(out_path, target_mb, seed)`` writes one large
  qwen2moe-style model (Q8_0 weights) for speed benchmarks.

Each model file ``<name>.gguf`` gets a JSON card ``<name>.json`` next to it
that records the hyperparameters, the seed, the file size and sha256, and for
quantized copies the ggml types the quantizer actually chose.

Modules: spec (ModelSpec, FIXTURES, BENCH_SPEC), layout (tensors per architecture), vocab,
writer (GGUF files, trained weights), cards, quantize, build.
"""

from .spec import BENCH_SPEC, FIXTURES, QUANT_TYPES, REPO_ROOT, SYNTH_VERSION, VOCAB_DIR, ModelSpec  # noqa: F401
from .layout import TensorPlan, tensor_plan  # noqa: F401
from .vocab import vocab_path, vocab_size  # noqa: F401
from .writer import export_trained  # noqa: F401
from .cards import spec_hash, card_path, _sha256  # noqa: F401
from .quantize import quantize  # noqa: F401
from .build import bench_spec, build_all, build_bench_model, build_fixture, build_model  # noqa: F401
