"""Runs in its own process for tests/test_gpu_layers_vulkan.py: with Mesa's lavapipe made visible
(VK_DRIVER_FILES, GGML_VK_VISIBLE_DEVICES), which must be set before ggml registers its backends.
A process that sees a Vulkan device offloads large prompt matmuls to it even without GPU layers,
so the CPU reference runs in the pytest process, which does not see one.

    python tests/vulkan_worker.py RUNS.json OUT.npz

RUNS.json: a list of {"key", "path", "residency", "routing", "size", "unified", "vram_size", "miss",
"prompt_by_token"}; OUT.npz gets,
per key, the logits, the greedy tokens, the counters, the decodes' selections and each layer's cache
contents."""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the tests' helpers, and this checkout's pymoecache as pytest sees it
import numpy as np  # noqa: E402

from test_gpu_layers_rpc import run  # noqa: E402  (the same run as the RPC tests)


def main(spec: str, out: str) -> None:
    arrays = {}
    for r in json.loads(Path(spec).read_text()):
        trace = []
        logits, tokens, st, cached = run(Path(r["path"]), r["residency"], r["routing"], r["size"], 99, None,
                                         unified=r["unified"], vram_size=r.get("vram_size", 0), trace=trace,
                                         miss=r.get("miss"), prompt_by_token=r.get("prompt_by_token", False))
        k = r["key"]
        arrays[f"{k}/logits"] = logits
        arrays[f"{k}/tokens"] = np.array(tokens)
        rs = st.residency
        arrays[f"{k}/counters"] = np.array([st.hits, st.misses, st.evictions, rs.decode_loads, rs.decode_bytes_read,
                                            rs.unified_layers, rs.unified_bytes, rs.vram_hits + rs.vram_from_ram +
                                            rs.vram_from_file])
        # the decodes' selections: [token, layer, the K experts] per record, in order
        arrays[f"{k}/selected"] = np.array(sorted([int(t["token"]), int(t["layer"])] +
                                                  t["experts"][:st.n_expert_used].tolist() for t in trace))
        arrays[f"{k}/cached"] = np.array([np.array(c + [-1] * (st.n_expert - len(c))) for c in cached])
        print(k, flush=True)
    np.savez(out, **arrays)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
