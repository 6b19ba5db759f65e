"""What the server says of itself: ``/health`` (public), llama-server's ``/props``, ``/slots`` and ``/metrics``
(Prometheus text), and ``/moecache/stats`` (the cache's counters since load). Each answers during a
generation, from a snapshot taken between two tokens.
"""

from __future__ import annotations

from fastapi import HTTPException, Request
from fastapi.responses import Response

from .. import __version__
from ..config import Routing, resolved_top_j
from ..llama import Llama
from . import native as server_native
from .model import perf_counters
from .requests import slot_context


def metrics_text(llm, generating: bool, waiting: int, since: tuple = (0, 0.0, 0, 0.0)) -> str:
    """``GET /metrics``: llama-server's counters (prompt and predicted tokens, their seconds and
    rates, requests in flight and waiting) from llama.cpp's own timings since ``since`` (the
    perf_counters when the server started: what the load itself decoded does not count), and the
    expert cache's (hits, misses, hit rate, bytes read, I/O wait), in Prometheus' text format."""
    n_p, ms_p, n_e, ms_e = (a - b for a, b in zip(perf_counters(llm), since))
    t_p, t_e = ms_p / 1e3, ms_e / 1e3
    rows = [
        ("llamacpp:prompt_tokens_total", "counter", "Prompt tokens processed.", n_p),
        ("llamacpp:prompt_seconds_total", "counter", "Prompt process time.", t_p),
        ("llamacpp:tokens_predicted_total", "counter", "Generated tokens (decoded).", n_e),
        ("llamacpp:tokens_predicted_seconds_total", "counter", "Predict process time.", t_e),
        ("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
         n_p / t_p if t_p > 0 else 0.0),
        ("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
         n_e / t_e if t_e > 0 else 0.0),
        ("llamacpp:requests_processing", "gauge", "Requests generating.", int(generating)),
        ("llamacpp:requests_deferred", "gauge", "Requests waiting in the queue.", waiting),
    ]
    if llm.moecache is not None:
        st = llm.moe_stats()
        rs = st.residency
        rows += [
            ("pymoecache:tokens_total", "counter", "Tokens routed through the expert cache.", st.tokens),
            ("pymoecache:cache_hits_total", "counter", "Expert selections found in the cache.", st.hits),
            ("pymoecache:cache_misses_total", "counter", "Expert selections not in the cache.", st.misses),
            ("pymoecache:cache_hit_rate", "gauge", "Hits / (hits + misses) since load.", st.hit_rate),
            ("pymoecache:rerouted_total", "counter", "Experts run from outside the router's own top K (what "
             "cache-conditional routing changed).", st.rerouted),
            ("pymoecache:router_probability_given_up", "gauge", "Router probability given up per token and MoE "
             "layer since load: its own top K's less that of the experts run.", st.p_given_up),
            ("pymoecache:bytes_read_total", "counter", "Expert bytes read from the model file (load, prompts, "
             "decoding).", (rs.load_bytes_read + rs.prompt_bytes_read + rs.decode_bytes_read) if rs else 0),
            ("pymoecache:io_wait_seconds_total", "counter", "Time decoded tokens waited for expert reads.",
             rs.decode_t_io_ms / 1e3 if rs else 0.0),
            ("pymoecache:lowbit_loads_total", "counter", "Selections of decoded tokens computed from the low-bit "
             "companion (--miss lowbit).", rs.lowbit_loads if rs else 0),
            ("pymoecache:lowbit_bytes_read_total", "counter", "Bytes read from the low-bit companion.",
             rs.lowbit_bytes_read if rs else 0),
        ]
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(out) + "\n"


def stats_json(llm: Llama, routing: Routing, routing_scope: str) -> dict:
    """What ``GET /moecache/stats`` answers: the counters since load, in total and per MoE layer."""
    st = llm.moe_stats()
    routing = llm.moecache.routing  # as resolved (a preset names what it chose)
    return {
        "model": llm.model_path,
        "routing": routing.spec(),
        "preset": llm.preset.name if getattr(llm, "preset", None) is not None else None,
        "top_j": (resolved_top_j(routing, llm.model_info.n_expert_used) if hasattr(routing, "top_j") else None),
        "routing_scope": routing_scope,
        **st.summary_dict(),
        "expert_bytes": st.expert_bytes,
        "moe_layers": st.moe_layers.tolist(),
        "cache_size_per_layer": st.capacity_per_layer.tolist(),
        "cache_choice": str(llm.cache_choice) if getattr(llm, "cache_choice", None) is not None else None,
        "tokens_per_layer": st.tokens_per_layer.tolist(),
        "hits_per_layer": st.hits_per_layer.tolist(),
        "misses_per_layer": st.misses_per_layer.tolist(),
        "evictions_per_layer": st.evictions_per_layer.tolist(),
        "hit_rate_per_layer": st.hit_rate_per_layer.tolist(),
    }


async def health(request: Request) -> dict:  # public, as llama-server's: no API key needed
    served = request.app.state.served
    generating, waiting = served.load()
    return {"status": "ok", "model": served.model_id, "generating": generating, "waiting": waiting,
            "slots": served.n_parallel, "max_queue": served.max_queue}


def props(request: Request) -> dict:
    import llama_cpp

    served = request.app.state.served
    llm = served.llm()
    tmpl = llm.chat_template
    return {"default_generation_settings": {"n_ctx": slot_context(llm), "model": served.model_id,
                                            # /completion's defaults (server/native.py), llama-server's names
                                            "params": {**server_native._DEFAULTS, "n_predict": -1, "seed": -1,
                                                       "n_probs": 0, "stream": False, "stop": [], "grammar": "",
                                                       "return_tokens": False}},
            "total_slots": served.n_parallel, "n_ctx": llm.n_ctx(), "kv_unified": served.kv_unified,
            "model_alias": served.model_id, "model_path": served.model_path,
            "chat_template": tmpl.source,
            "chat_template_source": tmpl.label,
            "build_info": f"pymoecache {__version__} on llama-cpp-python {llama_cpp.__version__}",
            "moecache": {"routing": (llm.moecache.routing if llm.moecache is not None else served.routing).spec(),
                         "preset": llm.preset.name if getattr(llm, "preset", None) is not None else None,
                         "routing_scope": served.routing_scope,
                         # as resolved at load (auto made explicit): where the experts are, what a miss reads
                         "residency": (llm.moecache.residency_stats().residency if llm.moecache is not None
                                       else "none"),
                         "miss": llm.cache_config.miss if llm.moecache is not None else None,
                         "lowbit": (str(llm.cache_config.lowbit) if llm.moecache is not None
                                    and llm.cache_config.lowbit else None),
                         "cache_choice": served.cache_choice,
                         # where the memory goes (the plan line at start, as numbers): the dense part, the
                         # cache, a VRAM tier (n_vram, vram_exclusive), experts llama.cpp put on a GPU
                         "memory_plan": served.memory_plan.as_dict() if served.memory_plan is not None else None}}


def slots(request: Request) -> list:
    served = request.app.state.served
    generating, waiting = served.load()
    n_ctx = slot_context(served.llm())  # (each slot's own: n_ctx / N, or all of it with -kvu)
    batch = served.batch
    if batch is not None and batch.dec.running:  # each slot's own state: the batch's sequences in theirs
        seqs = batch.slots()
        return [{"id": i, "n_ctx": n_ctx, "is_processing": s is not None,
                 "state": "generating" if s is not None else "idle",
                 "n_decoded": len(s.tokens) if s is not None else 0} for i, s in enumerate(seqs)]
    states = ["generating"] * generating + ["waiting"] * waiting
    return [{"id": i, "n_ctx": n_ctx, "is_processing": i < len(states) and states[i] == "generating",
             "state": states[i] if i < len(states) else "idle"} for i in range(served.n_parallel)]


def prometheus_metrics(request: Request):
    served = request.app.state.served
    return Response(metrics_text(served.llm(), *served.load(), since=served.perf0),
                    media_type="text/plain; version=0.0.4")


def moecache_stats(request: Request) -> dict:
    # Llama.moe_stats() reads the counters under the lock that guards each decoded token: a
    # consistent snapshot between two tokens, without waiting for (or interrupting) a whole
    # request as the server's request lock would
    served = request.app.state.served
    llm = served.llm()
    if llm.moecache is None:
        raise HTTPException(status_code=404, detail=f"{served.model_path} has no MoE layers: there is no expert cache")
    out = stats_json(llm, served.routing, served.routing_scope)
    if getattr(served, "batch", None) is not None:  # (-np N: which running slots a step took, and why)
        out["batch_order"] = served.batch.dec.order.state()
    return out


def models(request: Request) -> dict:
    """OpenAI's model list, as llama-server answers it: the served model, owned by "llamacpp", with its ``meta``."""
    served = request.app.state.served
    llm = served.llm()
    info = llm.model_info
    return {"object": "list", "data": [{
        "id": served.model_id, "object": "model", "created": served.created, "owned_by": "llamacpp",
        "meta": {"n_vocab": llm.n_vocab(), "n_ctx_train": info.n_ctx_train, "n_embd": info.n_embd,
                 "n_params": int(llm._model.n_params()), "size": int(llm._model.size()),
                 "n_expert": info.n_expert, "n_expert_used": info.n_expert_used}}]}


def add_routes(router, served) -> None:
    """/v1/models, /health (and /v1/health), /props, /slots, /metrics and /moecache/stats on ``router``."""
    router.add_api_route("/v1/models", models, methods=["GET"], summary="Models (OpenAI's list, llama-server's meta)",
                         tags=["OpenAI V1"], dependencies=served.auth)
    router.add_api_route("/v1/health", health, methods=["GET"], include_in_schema=False)  # (llama-server's alias)
    router.add_api_route("/health", health, methods=["GET"], summary="Server health", tags=["pymoecache"])
    for path, fn, summary in (
            ("/props", props, "Server properties (llama-server's /props)"),
            ("/slots", slots, "Slots (llama-server's /slots)"),
            ("/metrics", prometheus_metrics, "Prometheus metrics (llama-server's names, and the expert cache's)"),
            ("/moecache/stats", moecache_stats, "Expert cache statistics")):
        router.add_api_route(path, fn, methods=["GET"], summary=summary, tags=["pymoecache"],
                             dependencies=served.auth)
