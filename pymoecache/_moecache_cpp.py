"""ctypes mirror of src_cpp/moecache.h, one-to-one. See the header for the meaning of each field.
Importing it loads the native library; the header's constants are in pymoecache.constants.

Pythonic wrappers live in pymoecache.llama and pymoecache.config; this module only declares.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_bool, c_char_p, c_double, c_float, c_int8, c_int32, c_int64, c_size_t, c_uint32, c_void_p

from ._lib import load_llama_cpp
from .constants import *  # noqa: F401,F403  (the enums and limits of moecache.h, pure Python)
from .constants import MOECACHE_ABI_VERSION, MOECACHE_TRACE_MAX_USED


class moecache_routing_params(ctypes.Structure):
    _fields_ = [
        ("policy", c_int32),
        ("top_j", c_int32),
        ("prior_lambda", c_float),
        ("max_rank", c_int32),
        ("cumsum_tau", c_float),
        ("prune_rank", c_int32),
        ("scope", c_int32),
        ("analysis_rank", c_int32),
        ("analysis_seed", ctypes.c_uint32),
        ("prior_on_probs", ctypes.c_bool),
        ("batch_share", ctypes.c_bool),
        ("batch_prior", c_float),
    ]


class moecache_cache_params(ctypes.Structure):
    _fields_ = [
        ("n_cached", c_int32),
        ("fraction", c_float),
        ("n_cached_per_layer", POINTER(c_int32)),
        ("n_layer_sizes", c_int32),
        ("insertion", c_int32),
        ("update_on_prompt", c_bool),
        ("trace_capacity", c_int32),
        ("residency", c_int32),
        ("model_path", c_char_p),
        ("io_threads", c_int32),
        ("direct_io", c_bool),
        ("lock_memory", c_bool),
        ("lock_dense", c_bool),
        ("overlap_experts", c_bool),
        ("prefetch", c_int32),
        ("prefetch_distance", c_int32),
        ("prefetch_min_p", c_float),
        ("prefetch_threads", c_int32),
        ("prefetch_spare", c_int32),
        ("prefetch_adaptive", c_bool),
        ("prefetch_route", c_bool),
        ("prefetch_budget", c_float),
        ("eviction", c_int32),
        ("eviction_decay", c_float),
        ("router_record", c_int32),
        ("router_record_input", c_bool),
        ("n_vram", c_int32),
        ("vram_fill", c_int32),
        ("unified", c_int32),
        ("vram_copy", c_int32),
        ("lowbit", c_int32),
        ("lowbit_path", c_char_p),
        ("lowbit_in_ram", c_bool),
        ("lowbit_max_p", c_float),
        ("vram_exclusive", c_bool),
        ("n_seq", c_int32),
        ("share_steps", c_bool),
    ]


class moecache_layer_stats(ctypes.Structure):
    _fields_ = [
        ("n_expert", c_int32),
        ("n_expert_used", c_int32),
        ("capacity", c_int32),
        ("occupancy", c_int32),
        ("tokens", c_int64),
        ("selections", c_int64),
        ("hits", c_int64),
        ("misses", c_int64),
        ("evictions", c_int64),
        ("lifetime_count", c_int64),
        ("lifetime_sum", c_double),
        ("delta", c_float),
        ("pinned", c_int32),
        ("pinned_hits", c_int64),
        ("rerouted", c_int64),
        ("p_given_up", c_double),
    ]


class moecache_stats(ctypes.Structure):
    _fields_ = [
        ("n_layer", c_int32),
        ("n_moe_layer", c_int32),
        ("total", moecache_layer_stats),
    ]


class moecache_residency_stats(ctypes.Structure):
    _fields_ = [
        ("residency", c_int32),
        ("io_threads", c_int32),
        ("direct_io", c_bool),
        ("locked", c_bool),
        ("arena_bytes", c_int64),
        ("locked_bytes", c_int64),
        ("dense_locked_bytes", c_int64),
        ("expert_bytes", c_int64),
        ("decode_tokens", c_int64),
        ("decode_loads", c_int64),
        ("decode_bytes_read", c_int64),
        ("decode_t_io_ms", c_double),
        ("decode_t_route_ms", c_double),
        ("prompt_bytes_read", c_int64),
        ("prompt_t_io_ms", c_double),
        ("rss_bytes", c_int64),
        ("demand_bytes_read", c_int64),
        ("prefetch_bytes_read", c_int64),
        ("prefetch_issued", c_int64),
        ("prefetch_used", c_int64),
        ("prefetch_wasted", c_int64),
        ("predicted_selected", c_int64),
        ("predicted_total", c_int64),
        ("prefetch_tokens_on", c_int64),
        ("decode_t_read_ms", c_double),
        ("load_bytes_read", c_int64),
        ("load_t_io_ms", c_double),
        ("vram_bytes", c_int64),
        ("vram_hits", c_int64),
        ("vram_from_ram", c_int64),
        ("vram_from_file", c_int64),
        ("vram_copies", c_int64),
        ("vram_copy_bytes", c_int64),
        ("vram_cpu", c_int64),
        ("vram_ahead", c_int64),
        ("vram_ahead_used", c_int64),
        ("vram_t_copy_ms", c_double),
        ("unified_bytes", c_int64),
        ("unified_layers", c_int32),
        ("vram_slots", c_int32),
        ("vram_copies_down", c_int64),
        ("vram_exclusive_layers", c_int32),
        ("lowbit_bytes", c_int64),
        ("lowbit_loads", c_int64),
        ("lowbit_bytes_read", c_int64),
        ("lowbit_behind", c_int64),
        ("lowbit", c_int32),
        ("decode_graphs", c_int64),
        ("decode_graph_splits", c_int64),
        ("device_reads", c_int64),
        ("decode_steps", c_int64),
        ("device_routed", c_int64),
        ("device_route_differs", c_int64),
        ("vram_pinned_bytes", c_int64),
        ("device_steps", c_int64),
        ("decode_selections", c_int64),
        ("decode_union", c_int64),
        ("direct_tokens", c_int64),
        ("direct_choice", c_int32),
        ("direct_ms", c_double),
        ("round_trip_ms", c_double),
    ]


class moecache_event(ctypes.Structure):
    _fields_ = [
        ("kind", c_int32),
        ("layer", c_int32),
        ("expert", c_int32),
        ("thread", c_int32),
        ("n_tokens", c_int32),
        ("pad", c_int32),
        ("t_queued_us", c_int64),
        ("t_start_us", c_int64),
        ("t_end_us", c_int64),
        ("bytes", c_int64),
    ]


class moecache_trace_record(ctypes.Structure):
    _fields_ = [
        ("layer", c_int32),
        ("n_selected", c_int32),
        ("token", c_int64),
        ("experts", c_int32 * MOECACHE_TRACE_MAX_USED),
        ("hit_mask", c_uint32),
        ("top_k_mask", c_uint32),
    ]


moecache_p = c_void_p  # struct moecache * (opaque)

lib = load_llama_cpp()


def _fn(name, argtypes, restype):
    f = getattr(lib, name)
    f.argtypes = argtypes
    f.restype = restype
    return f


moecache_abi_version = _fn("moecache_abi_version", [], c_uint32)
moecache_version = _fn("moecache_version", [], c_char_p)
moecache_last_error = _fn("moecache_last_error", [], c_char_p)
moecache_cache_default_params = _fn("moecache_cache_default_params", [], moecache_cache_params)
moecache_routing_default_params = _fn("moecache_routing_default_params", [], moecache_routing_params)
moecache_init = _fn("moecache_init", [c_void_p, moecache_cache_params, moecache_routing_params], moecache_p)
moecache_init_synthetic = _fn("moecache_init_synthetic",
                              [c_int32, c_int32, c_int32, moecache_cache_params, moecache_routing_params], moecache_p)
moecache_set_load_residency = _fn("moecache_set_load_residency", [c_int32], None)
# int32_t moecache_get_step_rows(const struct moecache * mc, int32_t * hits, int32_t * misses, int32_t n_max);
moecache_get_step_rows = _fn("moecache_get_step_rows", [moecache_p, POINTER(c_int32), POINTER(c_int32), c_int32], c_int32)
moecache_get_residency_stats = _fn("moecache_get_residency_stats", [moecache_p, POINTER(moecache_residency_stats)],
                                   c_int32)
# int32_t moecache_context_graph_splits(const struct llama_context * ctx);
moecache_context_graph_splits = _fn("moecache_context_graph_splits", [c_void_p], c_int32)
# int32_t moecache_context_nonfinite_logits(struct llama_context * ctx, int32_t i);
moecache_context_nonfinite_logits = _fn("moecache_context_nonfinite_logits", [c_void_p, c_int32], c_int32)
moecache_take_io_error = _fn("moecache_take_io_error", [moecache_p], c_char_p)
# int32_t moecache_timeline_start(struct moecache * mc, int32_t capacity);
moecache_timeline_start = _fn("moecache_timeline_start", [moecache_p, c_int32], c_int32)
# int32_t moecache_timeline_get(const struct moecache * mc, struct moecache_event * out, int32_t cap,
#                               int64_t * n_dropped);
moecache_timeline_get = _fn("moecache_timeline_get", [moecache_p, POINTER(moecache_event), c_int32, POINTER(c_int64)],
                            c_int32)
# int64_t moecache_time_now_us(void);
moecache_time_now_us = _fn("moecache_time_now_us", [], c_int64)
moecache_free = _fn("moecache_free", [moecache_p], None)
moecache_attach = _fn("moecache_attach", [moecache_p, c_void_p], c_int32)
moecache_detach = _fn("moecache_detach", [moecache_p], None)
moecache_set_routing = _fn("moecache_set_routing", [moecache_p, moecache_routing_params], c_int32)
moecache_get_routing = _fn("moecache_get_routing", [moecache_p], moecache_routing_params)
moecache_set_prior_delta = _fn("moecache_set_prior_delta", [moecache_p, POINTER(c_float), c_int32], c_int32)
# int32_t moecache_set_prior_scale(struct moecache * mc, const float * scale, int32_t n);
moecache_set_prior_scale = _fn("moecache_set_prior_scale", [moecache_p, POINTER(c_float), c_int32], c_int32)
moecache_reset_stats = _fn("moecache_reset_stats", [moecache_p], None)
moecache_clear = _fn("moecache_clear", [moecache_p], None)
# void moecache_begin_request(struct moecache * mc);
moecache_begin_request = _fn("moecache_begin_request", [moecache_p], None)
# int32_t moecache_set_eviction(struct moecache * mc, enum moecache_eviction eviction, float decay);
moecache_set_eviction = _fn("moecache_set_eviction", [moecache_p, c_int32, c_float], c_int32)
# enum moecache_eviction moecache_get_eviction(const struct moecache * mc);
moecache_get_eviction = _fn("moecache_get_eviction", [moecache_p], c_int32)
# int32_t moecache_profile_save(const struct moecache * mc, const char * path);
moecache_profile_save = _fn("moecache_profile_save", [moecache_p, c_char_p], c_int32)
# int32_t moecache_profile_load(struct moecache * mc, const char * path);
moecache_profile_load = _fn("moecache_profile_load", [moecache_p, c_char_p], c_int32)
# int32_t moecache_profile_get(const struct moecache * mc, int32_t il, double * counts, int32_t n);
moecache_profile_get = _fn("moecache_profile_get", [moecache_p, c_int32, POINTER(c_double), c_int32], c_int32)
# int32_t moecache_profile_warm(struct moecache * mc, int32_t n_pin);
moecache_profile_warm = _fn("moecache_profile_warm", [moecache_p, c_int32], c_int32)
# int32_t moecache_get_router_record(const struct moecache * mc, int32_t il, float * logits, float * probs,
#                                    float * scores, int32_t cap, bool * rank_on_logits);
moecache_get_router_record = _fn("moecache_get_router_record", [moecache_p, c_int32, POINTER(c_float), POINTER(c_float),
                                                                POINTER(c_float), c_int32, POINTER(c_bool)], c_int32)
# int32_t moecache_get_router_input(const struct moecache * mc, int32_t il, float * x, int32_t cap, int32_t * n_embd);
moecache_get_router_input = _fn("moecache_get_router_input", [moecache_p, c_int32, POINTER(c_float), c_int32,
                                                              POINTER(c_int32)], c_int32)
# int32_t moecache_set_predictor(struct moecache * mc, int32_t il, const float * w, int32_t n_embd);
moecache_set_predictor = _fn("moecache_set_predictor", [moecache_p, c_int32, POINTER(c_float), c_int32], c_int32)
moecache_n_layer = _fn("moecache_n_layer", [moecache_p], c_int32)
moecache_get_stats = _fn("moecache_get_stats", [moecache_p, POINTER(moecache_stats)], c_int32)
moecache_get_layer_stats = _fn("moecache_get_layer_stats", [moecache_p, c_int32, POINTER(moecache_layer_stats)], c_int32)
moecache_get_cached = _fn("moecache_get_cached", [moecache_p, c_int32, POINTER(c_int32), c_int32], c_int32)
moecache_get_vram_cached = _fn("moecache_get_vram_cached", [moecache_p, c_int32, POINTER(c_int32), c_int32], c_int32)
moecache_get_trace = _fn("moecache_get_trace", [moecache_p, POINTER(moecache_trace_record), c_int32], c_int32)
moecache_state_save = _fn("moecache_state_save", [moecache_p, c_char_p], c_int32)
moecache_state_load = _fn("moecache_state_load", [moecache_p, c_char_p], c_int32)
# int32_t moecache_set_model_id(struct moecache * mc, const char * id);
moecache_set_model_id = _fn("moecache_set_model_id", [moecache_p, c_char_p], c_int32)
# void * moecache_device_with_memory(void * dev, size_t free, size_t total);
moecache_device_with_memory = _fn("moecache_device_with_memory", [c_void_p, c_size_t, c_size_t], c_void_p)
# int32_t moecache_guard_add(const struct llama_model * model, const char * path);
moecache_guard_add = _fn("moecache_guard_add", [c_void_p, c_char_p], c_int32)
# int64_t moecache_guard_faults(int32_t id);
moecache_guard_faults = _fn("moecache_guard_faults", [c_int32], c_int64)
# void moecache_guard_remove(int32_t id);
moecache_guard_remove = _fn("moecache_guard_remove", [c_int32], None)
moecache_route = _fn("moecache_route", [moecache_p, c_int32, POINTER(c_float), POINTER(c_float), POINTER(c_float),
                                        c_int32, c_int32, c_int32, c_bool, POINTER(c_int32), POINTER(c_int8)], c_int32)
# int32_t moecache_route_step(struct moecache * mc, int32_t il, const float * logits, const float * probs,
#                             const float * scores, int32_t n_expert, int32_t n_expert_used, int32_t n_tokens,
#                             bool rank_on_logits, int32_t * selected, int8_t * hits);
moecache_route_step = _fn("moecache_route_step", [moecache_p, c_int32, POINTER(c_float), POINTER(c_float),
                                                  POINTER(c_float), c_int32, c_int32, c_int32, c_bool, POINTER(c_int32),
                                                  POINTER(c_int8)], c_int32)

if moecache_abi_version() != MOECACHE_ABI_VERSION:
    raise ImportError(f"libllama has moecache ABI {moecache_abi_version()}, these bindings expect "
                      f"{MOECACHE_ABI_VERSION}: rebuild with `pip install .`")


def last_error() -> str:
    return (moecache_last_error() or b"").decode("utf-8", "replace")
