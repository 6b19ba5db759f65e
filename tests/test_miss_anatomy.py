"""scripts/miss_anatomy.py: the misses of a streamed decode, classed by whether the router's top J
forced them, whether a read ahead was queued for them, and whether the token waited for them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

MODEL = ROOT / "models" / "tiny-shakespeare-qwen2moe-60x4.gguf"  # 60 experts, top-4, 6 MoE layers
N_TOKENS = 12


def anatomy(*args: str) -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "miss_anatomy.py"), str(MODEL), "--prompt-tokens", "8",
                        "--warmup", "4", "--tokens", str(N_TOKENS), "--cache-size", "15", "--json", *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def share(r: dict, word: str) -> int:
    """Misses whose class names ``word``: forced, chosen, ahead, demand, waited."""
    return sum(v for k, v in r["classes"].items() if word in k.split())


@pytest.fixture(scope="module")
def layers():
    import pymoecache

    return len(pymoecache.model_info(str(MODEL)).moe_layers)


def test_every_selection_is_counted_once(layers):
    r = anatomy("--routing", "prior:0.5", "--prefetch", "gate:s=2:b=-1")  # (no budget: every predicted miss)
    assert r["selections"] == N_TOKENS * layers * 4  # (the prior drops nothing)
    assert r["hits"] + r["misses"] == r["selections"]
    assert sum(r["classes"].values()) == r["misses"] > 0
    assert r["top_j"] == 2
    assert share(r, "ahead") > 0  # the gate read some ahead


def test_no_reads_ahead_without_prefetch():
    r = anatomy("--routing", "prior:0.5", "--prefetch", "off")
    assert r["misses"] > 0 and share(r, "ahead") == 0 and share(r, "demand") == r["misses"]


def test_top_k_misses_are_all_forced():
    """lru runs the router's top K: a miss outside it would mean the ranks were read wrong."""
    r = anatomy("--routing", "lru", "--prefetch", "off")
    assert r["top_j"] == 4
    assert r["misses"] > 0 and share(r, "forced") == r["misses"] and share(r, "chosen") == 0


def test_a_prior_with_j_0_forces_nothing():
    r = anatomy("--routing", "prior:0.05:j=0", "--prefetch", "off")  # (a weak prior: some misses are left)
    assert r["top_j"] == 0 and share(r, "forced") == 0 and share(r, "chosen") == r["misses"] > 0
