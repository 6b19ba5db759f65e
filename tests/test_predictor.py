"""Fitted predictors for reading ahead (prefetch="gate"): the router inputs they are fitted on are
what the router multiplies, a predictor that equals the router changes nothing, another one
changes what is read ahead but never a logit, and the fit lowers the error it minimises."""

from __future__ import annotations

import numpy as np
import pytest

import pymoecache
from pymoecache import CacheConfig, tune
from conftest import ROOT

MODELS = [ROOT / "models" / "tiny-shakespeare-qwen2moe-60x4.gguf", ROOT / "models" / "tiny-shakespeare-mixtral-8x2.gguf"]
TEXT = (b"ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
        b"Arise, fair sun, and kill the envious moon, who is already sick and pale with grief, that thou her "
        b"maid art far more fair than she. Be not her maid, since she is envious; her vestal livery is but sick")


def tokens(path, n):
    llm = pymoecache.Llama(str(path), cache=CacheConfig(residency="none"), n_ctx=256, verbose=False)
    ids = llm.tokenize(TEXT)[:n]
    llm.close()
    assert len(ids) == n
    return ids


def recorded(path, ids):
    """Router inputs and logits of every MoE layer, the tokens decoded one at a time."""
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=1.0, residency="none", router_record=len(ids),
                                                        router_record_input=True),
                           routing="lru", n_ctx=256, n_threads=2, verbose=False)
    for t in ids:
        llm.eval([t])
    mc = llm.moecache
    out = {il: (mc.router_inputs(il), mc.router_record([il])[0][:, 0, :]) for il in mc.moe_layers}
    llm.close()
    return out


def decode(path, ids, predictors=None):
    """Logits and residency stats of a streamed decode reading ahead (gate, 2 spare slots, always on;
    the routing does not count them: prefetch_route off)."""
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=0.25 if "60x4" in path.name else 2, residency="stream",
                                                        prefetch="gate", prefetch_spare=2, prefetch_adaptive=False,
                                                        prefetch_route=False),
                           routing="prior:0.5", n_ctx=256, n_threads=2, seed=0, logits_all=True, verbose=False)
    if predictors is not None:
        for il, w in predictors.items():
            llm.moecache.set_predictor(il, w)
    llm.eval(ids[:4])
    for t in ids[4:]:
        llm.eval([t])
    logits = np.array(llm.scores[: len(ids)])
    rs = llm.moe_stats().residency
    llm.close()
    return logits, (rs.prefetch_issued, rs.prefetch_used, rs.predicted_selected, rs.predicted_total)


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem)
def test_router_inputs_are_what_the_router_multiplies(path):
    ids = tokens(path, 24)
    llm = pymoecache.Llama(str(path), cache=CacheConfig(residency="none", router_record=24), n_ctx=64, verbose=False)
    for t in ids[:4]:
        llm.eval([t])
    il = llm.moecache.moe_layers[0]
    assert llm.moecache.router_inputs(il).shape == (0, 0)  # only with router_record_input (n_embd floats a token)
    assert llm.moecache.router_record([il])[0].shape[0] == 4
    llm.close()
    rec = recorded(path, ids)
    for il, (x, z) in rec.items():
        w, b = tune._router_weights(str(path), il)
        assert x.shape == (24, w.shape[1]) and z.shape == (24, w.shape[0])
        np.testing.assert_allclose(x @ w.T + (0 if b is None else b), z, rtol=1e-4, atol=1e-4, err_msg=f"layer {il}")


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem)
def test_a_predictor_equal_to_the_router_changes_nothing(path):
    ids = tokens(path, 40)
    ref, st_ref = decode(path, ids)
    layers = [il for il in recorded(path, ids[:2])][1:]
    same, st_same = decode(path, ids, {il: tune._router_weights(str(path), il)[0] for il in layers})
    assert np.array_equal(same, ref) and st_same == st_ref and st_ref[0] > 0


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem)
def test_another_predictor_changes_the_reads_ahead_never_a_logit(path):
    ids = tokens(path, 40)
    ref, st_ref = decode(path, ids)
    rng = np.random.default_rng(0)
    layers = [il for il in recorded(path, ids[:2])][1:]
    other = {il: rng.standard_normal(tune._router_weights(str(path), il)[0].shape).astype(np.float32) for il in layers}
    got, st = decode(path, ids, other)
    assert np.array_equal(got, ref)  # prediction only: the routing and the logits are the stock ones
    assert st != st_ref              # ... but other experts were read ahead


def test_the_fit_lowers_the_error_it_minimises(tmp_path):
    path = MODELS[0]
    ids = tokens(path, 60)
    pred = tune.fit_predictor(path, ids, lam=10.0, n_threads=2)
    rec = recorded(path, ids)
    layers = sorted(rec)
    assert sorted(pred) == layers[1:]  # every MoE layer after the first
    for a, b in zip(layers, layers[1:]):
        x, z = rec[a][0], rec[b][1]
        w, bias = tune._router_weights(str(path), b)
        base = np.mean((x @ w.T - z) ** 2)
        fitted = np.mean((x @ pred[b].T - z) ** 2)
        assert fitted < base, f"layer {b}: {fitted} >= {base}"
    several = tune.fit_predictor(path, [ids[:30], ids[30:]], lam=10.0, n_threads=2)  # two fresh contexts
    assert sorted(several) == sorted(pred) and not np.array_equal(several[layers[1]], pred[layers[1]])
    f = tmp_path / "m.pred"
    tune.save_predictor(f, pred, model=path.name)
    back = tune.load_predictor(f)
    assert sorted(back) == sorted(pred) and all(np.array_equal(back[k], pred[k]) for k in pred)
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=15, residency="stream", prefetch="gate"), n_ctx=64,
                           verbose=False)
    assert llm.load_predictor(f) == len(pred)


def test_bad_predictors_are_refused(tmp_path):
    path = MODELS[0]
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=15, residency="stream", prefetch="gate"), n_ctx=64,
                           verbose=False)
    mc = llm.moecache
    il = mc.moe_layers[1]
    n_embd = tune._router_weights(str(path), il)[0].shape[1]
    with pytest.raises(pymoecache.MoECacheError, match="n_expert"):
        mc.set_predictor(il, np.zeros((3, n_embd), dtype=np.float32))
    with pytest.raises(pymoecache.Error, match="inputs"):
        mc.set_predictor(il, np.zeros((mc.n_expert, n_embd + 1), dtype=np.float32))
    bad = np.zeros((mc.n_expert, n_embd), dtype=np.float32)
    bad[1, 2] = np.nan
    with pytest.raises(pymoecache.Error, match="finite"):
        mc.set_predictor(il, bad)
    with pytest.raises(pymoecache.ConfigError):
        mc.set_predictor(mc.n_layer, bad)
    mc.set_predictor(il, None)  # back to the router: always allowed
    (tmp_path / "x.pred").write_bytes(b"not a predictor")
    with pytest.raises(pymoecache.ConfigError, match="predictor"):
        llm.load_predictor(tmp_path / "x.pred")


def test_the_cli_and_cache_config_take_a_predictor(tmp_path):
    import subprocess
    import sys

    path = MODELS[0]
    f = tmp_path / "m.pred"
    tune.save_predictor(f, tune.fit_predictor(path, tokens(path, 30), lam=10.0, n_threads=2), model=path.name)
    llm = pymoecache.Llama(str(path), cache=CacheConfig(size=15, residency="stream", prefetch="gate", predictor=str(f)),
                           n_ctx=64, verbose=False)
    assert llm.moecache is not None
    with pytest.raises(pymoecache.ConfigError, match="predictor"):
        CacheConfig(predictor=str(tmp_path / "missing.pred"))
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", str(path), "-p", "ROMEO:", "-n", "8",
                        "--cache-size", "15", "--predictor", str(f), "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "pymoecache", "run", str(path), "-n", "4", "--predictor",
                        str(tmp_path / "missing.pred")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "predictor" in r.stderr
