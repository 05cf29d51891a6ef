"""pqcache for Python: a ctypes + numpy binding of the pqcache C library.

Build the shared library first with `make lib` (build/libpqcache.so). The module
loads, in this order: the file named by $PQCACHE_LIB, ../build/libpqcache.so next to
this file, then libpqcache.so from the system's library path.

Arrays go to the C side without copies when they are C-contiguous (K/V: contiguous
within each row; rows may be strided) and of a type the C side reads: float32 and
float16 for keys and values, float32 for queries. Anything else is converted once.
numpy has no bfloat16: a uint16 array (or ml_dtypes' bfloat16) is read as bfloat16
bit patterns.

Every failure of the library raises PQCacheError (a subclass per result code) with the
library's message. A Cache serialises its calls (one lock each), so threads may share
one; close a Runtime or Scheduler only when no other thread is using it.
"""

import contextlib
import ctypes
import functools
import operator
import os
import threading
import weakref
from ctypes import (CFUNCTYPE, POINTER, Structure, byref, c_char, c_char_p, c_double, c_float, c_int, c_size_t,
                    c_uint, c_uint16, c_uint32, c_uint64, c_uint8, c_void_p, sizeof)

import numpy as np

__all__ = [
    "PQCacheError", "InvalidArgumentError", "BadShapeError", "OutOfRangeError", "NonFiniteError",
    "OutOfMemoryError", "EmptyError", "BadStateError", "CapacityError", "ThreadError", "JobFailedError",
    "FileIOError", "BadFileError", "NoDeviceError", "BackendError", "CallbackError", "UnsupportedError",
    "Runtime", "PQ", "Codes", "Scheduler", "Cache", "Selection", "batch_select", "batch_fetch",
    "exact_search", "exact_scores", "topk", "recall", "rerank", "version", "cuda_probe",
]

# ----- errors ---------------------------------------------------------------------------


class PQCacheError(Exception):
    """A pqcache call failed; `code` is the pqc_result, `message` the library's text."""

    code = None

    def __init__(self, message, code=None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidArgumentError(PQCacheError): code = -1
class BadShapeError(PQCacheError): code = -2
class OutOfRangeError(PQCacheError): code = -3
class NonFiniteError(PQCacheError): code = -4
class OutOfMemoryError(PQCacheError): code = -5
class EmptyError(PQCacheError): code = -6
class BadStateError(PQCacheError): code = -7
class CapacityError(PQCacheError): code = -8
class ThreadError(PQCacheError): code = -9
class JobFailedError(PQCacheError): code = -10
class FileIOError(PQCacheError): code = -11
class BadFileError(PQCacheError): code = -12
class NoDeviceError(PQCacheError): code = -13
class BackendError(PQCacheError): code = -14
class CallbackError(PQCacheError): code = -15
class UnsupportedError(PQCacheError): code = -16


_ERRORS = {cls.code: cls for cls in PQCacheError.__subclasses__()}

# ----- the C structs, field for field as pqcache.h declares them -------------------------

_alloc_fn = CFUNCTYPE(c_void_p, c_size_t, c_void_p)
_free_fn = CFUNCTYPE(None, c_void_p, c_void_p)
_log_fn = CFUNCTYPE(None, c_void_p, c_int, c_char_p)
_job_fn = CFUNCTYPE(None, c_void_p)
_submit_fn = CFUNCTYPE(c_int, c_void_p, _job_fn, c_void_p)


class pqc_allocator(Structure):
    _fields_ = [("alloc", _alloc_fn), ("free", _free_fn), ("user", c_void_p)]


class pqc_matrix(Structure):
    _fields_ = [("data", c_void_p), ("dtype", c_int), ("rows", c_size_t), ("cols", c_size_t),
                ("row_stride", c_size_t)]


class pqc_runtime_desc(Structure):
    _fields_ = [("n_threads", c_int), ("simd", c_int), ("allocator", pqc_allocator), ("log", _log_fn),
                ("log_user", c_void_p), ("log_level", c_int), ("submit", _submit_fn), ("submit_user", c_void_p),
                ("backend", c_int), ("cuda_device", c_int), ("cuda_kernel_cache", c_char_p)]


class pqc_pq_desc(Structure):
    _fields_ = [("m", c_int), ("bits", c_int), ("iters", c_int), ("init", c_int),
                ("max_points_per_centroid", c_int), ("seed", c_uint64), ("objective", POINTER(c_double)),
                ("device", c_int), ("metric", POINTER(c_float)), ("rope", c_int), ("subspaces", c_int),
                ("metric_blocks", POINTER(c_float))]


class pqc_pq(Structure):
    _fields_ = [("dim", c_int), ("m", c_int), ("bits", c_int), ("ksub", c_int), ("dsub", c_int),
                ("ksub_pad", c_int), ("centroids", POINTER(c_float)), ("cent_t", POINTER(c_float)),
                ("cnorm", POINTER(c_float)), ("metric", POINTER(c_float)), ("wnorm", POINTER(c_float)),
                ("half_bands", c_int), ("alloc", pqc_allocator), ("mblocks", POINTER(c_float)),
                ("wcent_t", POINTER(c_float)), ("mchol", POINTER(c_float))]


class pqc_codes(Structure):
    _fields_ = [("m", c_int), ("bits", c_int), ("count", c_size_t), ("capacity", c_size_t),
                ("col_stride", c_size_t), ("data", POINTER(c_uint8)), ("alloc", pqc_allocator)]


class pqc_scratch(Structure):
    _fields_ = [("buf", c_void_p), ("size", c_size_t), ("alloc", pqc_allocator)]


class pqc_search_desc(Structure):
    _fields_ = [("k", c_size_t), ("gqa", c_int), ("first", c_size_t), ("count", c_size_t), ("rerank", c_double),
                ("keys", POINTER(pqc_matrix)), ("residuals", POINTER(c_uint8)),
                ("residual_scale", POINTER(c_float)), ("residual_weight", c_float), ("softmax_scale", c_float)]


class pqc_scheduler_desc(Structure):
    _fields_ = [("t_min", c_int), ("t_max", c_int), ("t_default", c_int), ("parallel", c_double),
                ("allocator", pqc_allocator)]


class pqc_scheduler_fit(Structure):
    _fields_ = [("a1", c_double), ("b1", c_double), ("a2", c_double), ("b2", c_double), ("g2", c_double),
                ("n1", c_int), ("n2", c_int)]


class pqc_backend_i(Structure):
    _fields_ = [("name", c_char_p), ("alloc", CFUNCTYPE(c_void_p, c_void_p, c_size_t)),
                ("free", CFUNCTYPE(None, c_void_p, c_void_p)),
                ("copy_h2d", CFUNCTYPE(c_int, c_void_p, c_void_p, c_void_p, c_size_t)),
                ("synchronize", CFUNCTYPE(c_int, c_void_p))]


class pqc_backend(Structure):
    _fields_ = [("iface", pqc_backend_i), ("ctx", c_void_p)]


class pqc_cache_desc(Structure):
    _fields_ = [("n_layers", c_int), ("n_kv_heads", c_int), ("n_q_heads", c_int), ("head_dim", c_int),
                ("kv_dtype", c_int), ("max_tokens", c_size_t), ("n_sink", c_int), ("window", c_int),
                ("budget_ratio", c_double), ("budget_tokens", c_size_t), ("recent_share", c_double),
                ("pq", pqc_pq_desc), ("metric", c_int), ("metric_floor", c_double), ("observe", c_int),
                ("split", c_int), ("gqa", c_int), ("softmax_scale", c_float), ("rerank", c_double),
                ("outliers", c_int), ("residual_weight", c_double), ("block_tokens", c_int),
                ("cache_blocks", c_int), ("policy", c_int), ("admit_blocks", c_int), ("rebuild_share", c_double),
                ("scheduler", c_void_p), ("backend", POINTER(pqc_backend)), ("cuda_stream", c_void_p),
                ("codes_resident", c_int), ("first_kv_head", c_int), ("rerank_max", c_double)]


class pqc_kv_device(Structure):
    _fields_ = [("k", c_uint64), ("v", c_uint64), ("head_stride", c_size_t), ("pos", c_uint64)]


class pqc_layer_stats(Structure):
    _fields_ = [("selects", c_uint64), ("fetches", c_uint64), ("hits", c_uint64), ("misses", c_uint64),
                ("bytes_h2d", c_uint64), ("bytes_codes", c_uint64), ("bytes_d2h", c_uint64),
                ("tokens_selected", c_uint64), ("builds", c_uint64), ("rebuilds", c_uint64),
                ("last_iters", c_int), ("select_s", c_double), ("fetch_s", c_double), ("build_s", c_double),
                ("wait_s", c_double), ("device_waits", c_uint64)]


class pqc_head_plan(Structure):
    _fields_ = [("tokens", c_size_t), ("sinks", c_size_t), ("window", c_size_t), ("coded", c_size_t),
                ("take", c_size_t), ("candidates", c_size_t)]


class pqc_selection(Structure):
    _fields_ = [("n_kv_heads", c_int), ("capacity", c_size_t), ("count", POINTER(c_size_t)),
                ("idx", POINTER(c_uint32)), ("alloc", pqc_allocator), ("owned", c_int)]


class pqc_kv_out(Structure):
    _fields_ = [("k", POINTER(c_float)), ("v", POINTER(c_float)), ("head_stride", c_size_t)]


class pqc_kv_view(Structure):
    _fields_ = [("n_kv_heads", c_int), ("head_dim", c_int), ("dtype", c_int), ("k", POINTER(c_void_p)),
                ("v", POINTER(c_void_p)), ("count", POINTER(c_size_t)), ("pos", POINTER(POINTER(c_uint32))),
                ("krows", POINTER(POINTER(c_void_p))), ("vrows", POINTER(POINTER(c_void_p))),
                ("on_device", c_int)]


class pqc_engine(Structure):
    _fields_ = [("user", c_void_p),
                ("qkv", CFUNCTYPE(c_int, c_void_p, c_int, c_size_t, c_size_t, POINTER(c_float), POINTER(c_float),
                                  POINTER(c_float))),
                ("attend", CFUNCTYPE(c_int, c_void_p, c_int, c_size_t, c_size_t, POINTER(c_float),
                                     POINTER(pqc_kv_view))),
                ("accepts_row_pointers", c_int), ("accepts_device_kv", c_int)]


class pqc_cuda_info(Structure):
    _fields_ = [("available", c_int), ("driver_version", c_int), ("device_count", c_int), ("cc_major", c_int),
                ("cc_minor", c_int), ("sm_count", c_int), ("total_mem", c_size_t), ("nvrtc_major", c_int),
                ("nvrtc_minor", c_int), ("have_cublaslt", c_int), ("name", c_char * 128),
                ("message", c_char * 512)]


STRUCTS = [pqc_allocator, pqc_matrix, pqc_runtime_desc, pqc_pq_desc, pqc_pq, pqc_codes, pqc_scratch,
           pqc_search_desc, pqc_scheduler_desc, pqc_scheduler_fit, pqc_backend_i, pqc_backend, pqc_cache_desc,
           pqc_kv_device, pqc_layer_stats, pqc_head_plan, pqc_selection, pqc_kv_out, pqc_kv_view, pqc_engine,
           pqc_cuda_info]

# ----- the library ----------------------------------------------------------------------

_P = c_void_p  # opaque handles and array data are passed as addresses
_R = c_int     # pqc_result
_PROTOTYPES = {
    "pqc_result_description": (c_char_p, [c_int]),
    "pqc_last_error": (c_char_p, []),
    "pqc_version": (c_char_p, []),
    "pqc_version_number": (c_uint, []),
    "pqc_dtype_size": (c_size_t, [c_int]),
    "pqc_f32_to_f16": (c_uint16, [c_float]),
    "pqc_f16_to_f32": (c_float, [c_uint16]),
    "pqc_f32_to_bf16": (c_uint16, [c_float]),
    "pqc_bf16_to_f32": (c_float, [c_uint16]),
    "pqc_runtime_create": (_R, [POINTER(pqc_runtime_desc), POINTER(c_void_p)]),
    "pqc_runtime_destroy": (None, [_P]),
    "pqc_runtime_simd": (c_int, [_P]),
    "pqc_cpu_best_simd": (c_int, []),
    "pqc_runtime_threads": (c_int, [_P]),
    "pqc_runtime_backend": (c_int, [_P]),
    "pqc_runtime_backend_note": (c_char_p, [_P]),
    "pqc_simd_name": (c_char_p, [c_int]),
    "pqc_pq_train": (_R, [_P, POINTER(pqc_pq_desc), POINTER(pqc_matrix), POINTER(pqc_pq)]),
    "pqc_pq_free": (None, [POINTER(pqc_pq)]),
    "pqc_pq_mse": (_R, [_P, POINTER(pqc_pq), POINTER(pqc_matrix), POINTER(c_double)]),
    "pqc_pq_decode": (_R, [POINTER(pqc_pq), POINTER(pqc_codes), c_size_t, _P]),
    "pqc_pq_save": (_R, [POINTER(pqc_pq), c_char_p]),
    "pqc_pq_load": (_R, [_P, c_char_p, POINTER(pqc_pq)]),
    "pqc_pq_dim": (c_int, [POINTER(pqc_pq), c_int, c_int]),
    "pqc_codes_init": (_R, [POINTER(pqc_codes), POINTER(pqc_pq), c_size_t, POINTER(pqc_allocator)]),
    "pqc_codes_free": (None, [POINTER(pqc_codes)]),
    "pqc_codes_reserve": (_R, [POINTER(pqc_codes), c_size_t]),
    "pqc_codes_bytes": (c_size_t, [POINTER(pqc_codes)]),
    "pqc_codes_get": (c_uint, [POINTER(pqc_codes), c_size_t, c_int]),
    "pqc_pq_encode": (_R, [_P, POINTER(pqc_pq), POINTER(pqc_matrix), POINTER(pqc_codes)]),
    "pqc_pq_residuals": (_R, [_P, POINTER(pqc_pq), POINTER(pqc_codes), c_size_t, POINTER(pqc_matrix), _P, _P]),
    "pqc_pq_lut": (_R, [_P, POINTER(pqc_pq), _P, c_int, _P]),
    "pqc_pq_search": (_R, [_P, POINTER(pqc_pq), POINTER(pqc_codes), _P, c_int, POINTER(pqc_search_desc),
                           POINTER(pqc_scratch), _P, _P]),
    "pqc_pq_scores": (_R, [_P, POINTER(pqc_pq), POINTER(pqc_codes), _P, c_int, POINTER(pqc_search_desc),
                           POINTER(pqc_scratch), _P]),
    "pqc_exact_search": (_R, [_P, POINTER(pqc_matrix), _P, c_int, POINTER(pqc_search_desc), POINTER(pqc_scratch),
                              _P, _P]),
    "pqc_exact_scores": (_R, [_P, POINTER(pqc_matrix), _P, c_int, c_int, POINTER(pqc_scratch), _P]),
    "pqc_rerank": (_R, [_P, POINTER(pqc_matrix), _P, c_int, c_int, _P, c_size_t, c_size_t, POINTER(pqc_scratch),
                        _P, _P]),
    "pqc_topk": (_R, [_P, _P, c_size_t, c_size_t, POINTER(pqc_scratch), _P, _P]),
    "pqc_recall": (c_double, [_P, c_size_t, _P, c_size_t]),
    "pqc_scheduler_create": (_R, [POINTER(pqc_scheduler_desc), POINTER(c_void_p)]),
    "pqc_scheduler_destroy": (None, [_P]),
    "pqc_scheduler_add_kmeans": (_R, [_P, c_double, c_int, c_double]),
    "pqc_scheduler_add_compute": (_R, [_P, c_double, c_double]),
    "pqc_scheduler_iters": (c_int, [_P, c_double, c_int]),
    "pqc_scheduler_get_fit": (pqc_scheduler_fit, [_P]),
    "pqc_scheduler_set_fit": (_R, [_P, POINTER(pqc_scheduler_fit)]),
    "pqc_scheduler_save": (_R, [_P, c_char_p]),
    "pqc_scheduler_load": (_R, [_P, c_char_p]),
    "pqc_cache_create": (_R, [_P, POINTER(pqc_cache_desc), POINTER(c_void_p)]),
    "pqc_cache_resolve": (_R, [_P, POINTER(pqc_cache_desc), POINTER(pqc_cache_desc)]),
    "pqc_cache_config": (_R, [_P, POINTER(pqc_cache_desc)]),
    "pqc_cache_destroy": (None, [_P]),
    "pqc_cache_prefill": (_R, [_P, c_int, POINTER(pqc_matrix), POINTER(pqc_matrix)]),
    "pqc_cache_observe": (_R, [_P, c_int, _P, c_size_t]),
    "pqc_cache_observed_mass": (_R, [_P, c_int, c_int, POINTER(c_double), POINTER(c_double)]),
    "pqc_cache_append": (_R, [_P, c_int, _P, _P]),
    "pqc_cache_select": (_R, [_P, c_int, _P, POINTER(pqc_selection)]),
    "pqc_cache_fetch": (_R, [_P, c_int, POINTER(pqc_selection), POINTER(pqc_kv_out)]),
    "pqc_cache_on_device": (c_int, [_P]),
    "pqc_cache_report_compute": (_R, [_P, c_int, c_double, c_double]),
    "pqc_cache_sync": (_R, [_P]),
    "pqc_cache_save": (_R, [_P, c_char_p]),
    "pqc_cache_load": (_R, [_P, POINTER(pqc_cache_desc), c_char_p, POINTER(c_void_p)]),
    "pqc_cache_tokens": (c_size_t, [_P, c_int]),
    "pqc_cache_window": (c_int, [_P]),
    "pqc_cache_layer_window": (c_int, [_P, c_int]),
    "pqc_cache_stats": (_R, [_P, c_int, POINTER(pqc_layer_stats)]),
    "pqc_cache_head_plan": (_R, [_P, c_int, _P, c_int, POINTER(pqc_head_plan), _P, c_size_t]),
    "pqc_cache_memory": (None, [_P, POINTER(c_size_t), POINTER(c_size_t)]),
    "pqc_cache_kv": (_R, [_P, c_int, c_int, POINTER(c_void_p), POINTER(c_void_p), POINTER(c_size_t),
                          POINTER(c_int)]),
    "pqc_cache_cached_blocks": (c_int, [_P, c_int, c_int, _P, c_int]),
    "pqc_batch_select": (_R, [_P, c_int, c_int, _P, _P]),
    "pqc_batch_fetch": (_R, [_P, c_int, c_int, _P, _P]),
    "pqc_cuda_probe": (_R, [POINTER(pqc_cuda_info)]),
    # optional: absent from libraries built before prefix sharing
    "pqc_cache_fork": (_R, [_P, POINTER(c_void_p)]),
    "pqc_cache_host_memory": (None, [_P, POINTER(c_size_t), POINTER(c_size_t)]),
    "pqc_cache_kv_part": (_R, [_P, c_int, c_int, c_size_t, POINTER(c_void_p), POINTER(c_void_p), POINTER(c_size_t)]),
    # the binding's helpers (python/libpqcache.c)
    "pqcpy_sizeof": (c_size_t, [c_char_p]),
    "pqcpy_time_select": (_R, [_P, c_int, _P, POINTER(pqc_selection), c_int, POINTER(c_double)]),
}
_OPTIONAL = {"pqc_cache_fork", "pqc_cache_host_memory", "pqc_cache_kv_part"}


class _Lib:
    """The loaded library: each prototyped function as an attribute (absent if missing)."""

    def __init__(self, path):
        self.path = path
        try:
            self.dll = ctypes.CDLL(path)
        except OSError as e:
            raise ImportError("cannot load %s (build it with make lib, or set PQCACHE_LIB): %s" % (path, e)) from None
        for name, (restype, argtypes) in _PROTOTYPES.items():
            try:
                fn = getattr(self.dll, name)
            except AttributeError:
                if name in _OPTIONAL:
                    continue
                raise ImportError("%s has no %s: rebuild it with make lib" % (path, name)) from None
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, fn)


def _find_library():
    env = os.environ.get("PQCACHE_LIB")
    if env:
        return env
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "build", "libpqcache.so")
    if os.path.exists(here):
        return os.path.normpath(here)
    return "libpqcache.so"


lib = _Lib(_find_library())
_select = lib.pqc_cache_select


def version():
    """The library's version string, e.g. "0.1.0"."""
    return lib.pqc_version().decode()


def _raise(r, what=None):
    msg = (lib.pqc_last_error() or b"").decode("utf-8", "replace")
    if not msg:
        msg = lib.pqc_result_description(r).decode()
    if what:
        msg = "%s: %s" % (what, msg)
    raise _ERRORS.get(r, PQCacheError)(msg, r)


def _check(r, what=None):
    if r:
        _raise(r, what)


def _optional(name):
    """A function that libraries built from an older pqcache.h lack."""
    fn = getattr(lib, name, None)
    if fn is None:
        raise UnsupportedError("the loaded library has no %s (rebuild it with make lib)" % name)
    return fn


# ----- argument conversion --------------------------------------------------------------

_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)
_U16 = np.dtype(np.uint16)
_U32 = np.dtype(np.uint32)
_DTYPE_CODES = {"f32": 0, "float32": 0, "fp32": 0, "f16": 1, "float16": 1, "fp16": 1, "bf16": 2, "bfloat16": 2}
_DTYPE_NUMPY = {0: _F32, 1: _F16, 2: _U16}


def _empty_f32_lines(shape):
    """An uninitialised float32 array starting on a 64-byte line: large fetches write whole
    lines around the caches there (numpy's own arrays start 16 bytes into one)."""
    n = int(np.prod(shape)) * 4
    buf = np.empty(n + 64, np.uint8)
    off = -buf.ctypes.data % 64
    return buf[off:off + n].view(_F32).reshape(shape)


_ENUMS = {
    "simd": {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3, "neon": 4},
    "backend": {"cpu": 0, "auto": 1, "cuda": 2},
    "log_level": {"error": 0, "warn": 1, "info": 2, "debug": 3},
    "init": {"kmeans++": 0, "random": 1},
    "rope": {"none": 0, "half": 1, "interleaved": 2},
    "subspaces": {"default": 0, "rope_bands": 1, "contiguous": 2},
    "gqa": {"softmax_sum": 0, "sum": 1},
    "policy": {"lfu": 0, "lru": 1},
    "metric": {"query": 0, "l2": 1, "query_diag": 2},
    "split": {"compete": 0, "fixed": 1, "adaptive": 2, "fixed_compete": 3},
}

_addressof = ctypes.addressof
_char_from_buffer = c_char.from_buffer

# Tests set this to a list to see the addresses handed to the C side: (label, address).
_pass_hook = None


def _enum(kind, value):
    if isinstance(value, str):
        table = _ENUMS[kind]
        if value.lower() not in table:
            raise OutOfRangeError("unknown %s %r (one of %s)" % (kind, value, ", ".join(table)))
        return table[value.lower()]
    return _int(value, kind)


def _dtype_code(value):
    """A storage dtype from a name, a numpy dtype or a pqc_dtype number."""
    if isinstance(value, str) and value.lower() in _DTYPE_CODES:
        return _DTYPE_CODES[value.lower()]
    if isinstance(value, (int, np.integer)):
        return _int(value, "kv_dtype")
    try:
        dt = np.dtype(value)
    except TypeError:
        raise InvalidArgumentError("unknown dtype %r" % (value,)) from None
    code = _array_dtype_code(dt)
    if code is None:
        raise InvalidArgumentError("dtype %s cannot be stored (float32, float16 or bfloat16)" % dt)
    return code


def _array_dtype_code(dt):
    if dt == _F32:
        return 0
    if dt == _F16:
        return 1
    if dt == _U16 or (dt.name == "bfloat16" and dt.itemsize == 2):
        return 2
    return None


_LIMITS = {c_int: (-2 ** 31, 2 ** 31 - 1), c_size_t: (0, 2 ** (8 * sizeof(c_size_t)) - 1),
           c_uint64: (0, 2 ** 64 - 1), c_void_p: (0, 2 ** (8 * sizeof(c_void_p)) - 1)}


def _int(value, what, ctype=c_int):
    """value as a Python int that fits ctype (ctypes would wrap it silently)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidArgumentError("%s must be an integer, not %r" % (what, value)) from None
    lo, hi = _LIMITS[ctype]
    if not lo <= v <= hi:
        raise OutOfRangeError("%s = %d does not fit in %s" % (what, v, ctype.__name__))
    return v


def _size(value, what):
    return _int(value, what, c_size_t)


def _real(arr, what):
    arr = np.asarray(arr)
    if arr.dtype.kind not in "fiu" and _array_dtype_code(arr.dtype) is None:
        raise InvalidArgumentError("%s: dtype %s is not a real number type" % (what, arr.dtype))
    return arr


def _indices(arr, what):
    """Token indices as a C-contiguous uint32 array (1-D)."""
    a = np.asarray(arr).reshape(-1)
    if a.size and (a.dtype.kind not in "iu" or a.min() < 0 or a.max() > 0xFFFFFFFF):
        raise OutOfRangeError("%s: indices must be integers in 0..2^32-1" % what)
    return np.ascontiguousarray(a, dtype=_U32)


def _addr(arr, label):
    """The address of a C-contiguous array's data (no copy)."""
    try:
        a = _addressof(_char_from_buffer(arr))  # much faster than arr.ctypes.data
    except (TypeError, ValueError):  # read-only, strided rows or empty
        a = arr.ctypes.data
    if _pass_hook is not None:
        _pass_hook.append((label, a))
    return a


def _to_f32(arr):
    """A C-contiguous, aligned float32 copy (or arr itself when it is one); uint16 is bfloat16."""
    if _array_dtype_code(arr.dtype) == 2:
        return (arr.view(_U16).astype(np.uint32) << 16).view(_F32)
    return np.require(arr, _F32, ["C", "A"])


def _f32(arr, shape, what):
    """arr as a C-contiguous float32 array of `shape`, or flat with as many elements
    (copied only when it is not one already)."""
    if not (type(arr) is np.ndarray and arr.dtype == _F32 and arr.flags.c_contiguous and arr.flags.aligned):
        arr = _to_f32(_real(arr, what))
    if arr.shape != shape:
        if arr.ndim != 1 or arr.size != int(np.prod(shape)):
            raise BadShapeError("%s: shape %s, expected %s" % (what, arr.shape, shape))
        arr = arr.reshape(shape)
    return arr


def _rows(arr, inner, what, dtypes=("f32",)):
    """A (rows, *inner) array (or (rows, prod(inner)), or one row shaped `inner`) as a
    pqc_matrix. Returns (matrix, array): the array must stay referenced while the C
    side reads it. No copy when the dtype is in `dtypes` and each row is contiguous."""
    arr = _real(arr, what)
    inner = tuple(int(x) for x in inner)
    cols = int(np.prod(inner))
    if arr.shape == inner:
        arr = arr.reshape((1,) + inner)
    if not (arr.ndim >= 1 and (arr.shape[1:] == inner or (arr.ndim == 2 and arr.shape[1] == cols))):
        raise BadShapeError("%s: shape %s, expected (rows, %s)" % (what, arr.shape, ", ".join(map(str, inner))))
    if arr.shape[0] == 0:
        raise EmptyError("%s: no rows" % what)
    code = _array_dtype_code(arr.dtype)
    if code is None or _DTYPE_NAMES[code] not in dtypes:
        arr, code = _to_f32(arr), 0
    es = arr.dtype.itemsize
    rows = arr.shape[0]
    if not arr[0].flags.c_contiguous or not arr.flags.aligned or (rows > 1 and arr.strides[0] < cols * es):
        arr = np.require(arr, requirements=["C", "A"])
    stride = arr.strides[0] if rows > 1 else cols * es
    return pqc_matrix(_addr(arr, what), code, rows, cols, stride), arr


_DTYPE_NAMES = {0: "f32", 1: "f16", 2: "bf16"}
_KV_DTYPES = ("f32", "f16", "bf16")


def _path(path):
    p = os.fsencode(path)
    if b"\0" in p:
        raise InvalidArgumentError("path holds a NUL byte: %r" % (path,))
    return p


def _rt(runtime):
    if runtime is None:
        return None
    return runtime._live()


class _Handle:
    """An owned C object: close() frees it, and so does garbage collection."""

    _ptr = None
    _what = "object"

    def _live(self):
        if self._ptr is None:
            raise BadStateError("%s is closed" % self._what)
        return self._ptr

    @property
    def closed(self):
        return self._ptr is None

    def close(self):
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            self._free(ptr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _locked(method):
    """Runs a Cache method under the cache's lock (the C side allows one caller at a time)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return call


# ----- runtime --------------------------------------------------------------------------


class Runtime(_Handle):
    """A thread pool and the device tier (pqc_runtime).

    threads: worker threads (0: one worker, -1: run every job on the calling thread).
    simd: "auto", "scalar", "avx2", "avx512" or "neon". backend: "cpu", "auto" or "cuda".
    log: optional callable(level, message); it may be called from worker threads.
    Closing a runtime closes the caches made on it first."""

    _what = "runtime"

    def __init__(self, threads=0, simd="auto", backend="cpu", cuda_device=0, kernel_cache=None, log=None,
                 log_level="error"):
        d = pqc_runtime_desc()
        d.n_threads = _int(threads, "threads")
        d.simd = _enum("simd", simd)
        d.backend = _enum("backend", backend)
        d.cuda_device = _int(cuda_device, "cuda_device")
        d.log_level = _enum("log_level", log_level)
        if kernel_cache is not None:
            d.cuda_kernel_cache = _path(kernel_cache)
        self._log = None
        if log is not None:
            def _on_log(user, level, message):
                try:
                    log(level, message.decode("utf-8", "replace"))
                except Exception:
                    pass
            self._log = _log_fn(_on_log)
            d.log = self._log
        self._dependents = weakref.WeakSet()
        out = c_void_p()
        _check(lib.pqc_runtime_create(byref(d), byref(out)), "Runtime")
        self._ptr = out.value

    def _free(self, ptr):
        for dep in list(self._dependents):
            dep.close()
        lib.pqc_runtime_destroy(ptr)

    @property
    def threads(self):
        return lib.pqc_runtime_threads(self._live())

    @property
    def simd(self):
        return lib.pqc_simd_name(lib.pqc_runtime_simd(self._live())).decode()

    @property
    def backend(self):
        return {0: "cpu", 1: "auto", 2: "cuda"}.get(lib.pqc_runtime_backend(self._live()), "?")

    @property
    def backend_note(self):
        return lib.pqc_runtime_backend_note(self._live()).decode("utf-8", "replace")


def cuda_probe():
    """What CUDA offers here: a dict (available, name, message, ...). Never raises for no GPU."""
    info = pqc_cuda_info()
    lib.pqc_cuda_probe(byref(info))
    out = {name: getattr(info, name) for name, _ in pqc_cuda_info._fields_}
    out["name"] = info.name.decode("utf-8", "replace")
    out["message"] = info.message.decode("utf-8", "replace")
    return out


# ----- the PQ core ----------------------------------------------------------------------


def _search_desc(k, gqa, first=0, count=0, softmax_scale=0.0):
    d = pqc_search_desc()
    d.k = _size(k, "k")
    d.gqa = _enum("gqa", gqa)
    d.first = _size(first, "first")
    d.count = _size(count, "count")
    d.softmax_scale = float(softmax_scale)
    return d


def _queries(queries, dim, what="queries"):
    """(g, dim) float32 queries (one query may be given as (dim,))."""
    q = np.asarray(queries)
    if q.ndim == 1:
        q = q.reshape(1, -1)
    if q.ndim != 2 or q.shape[1] != dim or q.shape[0] == 0:
        raise BadShapeError("%s: shape %s, expected (g, %d)" % (what, np.shape(queries), dim))
    return _f32(q, q.shape, what)


class PQ(_Handle):
    """A trained product quantizer for one key head (pqc_pq). Make it with PQ.train or PQ.load."""

    _what = "PQ"

    def __init__(self):
        raise TypeError("use PQ.train(...) or PQ.load(...)")

    @classmethod
    def _wrap(cls, pq):
        self = object.__new__(cls)
        self._pq = pq
        self._ptr = ctypes.addressof(pq)
        self.objective = None
        return self

    def _free(self, ptr):
        lib.pqc_pq_free(byref(self._pq))

    @classmethod
    def train(cls, keys, m=0, bits=0, iters=0, init="kmeans++", seed=0, metric=None, rope="none",
              subspaces="default", max_points_per_centroid=0, runtime=None, objective=False, metric_blocks=None):
        """Trains on the rows of keys (s x d_h; float32, float16 or bfloat16 as uint16).

        0 means the library's default (m=4, bits=8, iters=10; rope bands where rope states
        a layout). metric: optional d_h weights of the distance. metric_blocks: instead,
        optional symmetric positive definite matrices (m, d_h/m, d_h/m), one per sub-space
        in its element order (m=0 takes m from them). objective=True keeps the k-means
        objective per sub-space and iteration in `.objective` (m x (iters + 1))."""
        keys = np.asarray(keys)
        km, karr = _rows(keys, keys.shape[-1:], "keys", _KV_DTYPES)
        d = pqc_pq_desc()
        d.m = _int(m, "m")
        d.bits = _int(bits, "bits")
        d.iters = _int(iters, "iters")
        d.init = _enum("init", init)
        d.seed = _int(seed, "seed", c_uint64)
        d.rope = _enum("rope", rope)
        d.subspaces = _enum("subspaces", subspaces)
        d.max_points_per_centroid = _int(max_points_per_centroid, "max_points_per_centroid")
        w = wb = None
        if metric is not None:
            w = _f32(metric, (km.cols,), "metric")
            d.metric = ctypes.cast(_addr(w, "metric"), POINTER(c_float))
        if metric_blocks is not None:
            wb = np.asarray(metric_blocks)
            mb = d.m if d.m > 0 else (wb.shape[0] if wb.ndim == 3 and wb.shape[0] > 0 else 1)
            if km.cols % mb:
                raise BadShapeError("metric_blocks: m = %d does not divide d_h = %d" % (mb, km.cols))
            wb = _f32(wb, (mb, km.cols // mb, km.cols // mb), "metric_blocks")
            d.m = mb
            d.metric_blocks = ctypes.cast(_addr(wb, "metric_blocks"), POINTER(c_float))
        obj = None
        if objective:  # sized for what the C side writes when it accepts the settings
            t = 10 if d.iters == 0 else min(max(d.iters, 0), 100000)
            mm = min(d.m if d.m > 0 else 2, km.cols)
            obj = np.zeros((max(mm, 1), t + 1), np.float64)
            d.objective = ctypes.cast(obj.ctypes.data, POINTER(c_double))
        pq = pqc_pq()
        _check(lib.pqc_pq_train(_rt(runtime), byref(d), byref(km), byref(pq)), "PQ.train")
        self = cls._wrap(pq)
        self.objective = obj
        return self

    @classmethod
    def load(cls, path, runtime=None):
        """A quantizer saved by save()."""
        pq = pqc_pq()
        _check(lib.pqc_pq_load(_rt(runtime), _path(path), byref(pq)), "PQ.load")
        return cls._wrap(pq)

    def save(self, path):
        self._live()
        _check(lib.pqc_pq_save(byref(self._pq), _path(path)), "PQ.save")

    dim = property(lambda self: self._live_pq().dim, doc="d_h")
    m = property(lambda self: self._live_pq().m, doc="sub-spaces")
    bits = property(lambda self: self._live_pq().bits, doc="bits per code")
    ksub = property(lambda self: self._live_pq().ksub, doc="centroids per sub-space (2^bits)")
    dsub = property(lambda self: self._live_pq().dsub, doc="dims per sub-space")

    def _live_pq(self):
        self._live()
        return self._pq

    @property
    def centroids(self):
        """A copy of the centroids, (m, 2^bits, d_h / m)."""
        self._live()
        p = self._pq
        return np.ctypeslib.as_array(p.centroids, shape=(p.m, p.ksub, p.dsub)).copy()

    @property
    def metric(self):
        """A copy of the metric weights (d_h), or None for Euclidean."""
        self._live()
        if not self._pq.metric:
            return None
        return np.ctypeslib.as_array(self._pq.metric, shape=(self._pq.dim,)).copy()

    @property
    def metric_blocks(self):
        """A copy of the metric blocks (m, d_h/m, d_h/m), or None."""
        self._live()
        p = self._pq
        if not p.mblocks:
            return None
        return np.ctypeslib.as_array(p.mblocks, shape=(p.m, p.dsub, p.dsub)).copy()

    def subspace_dim(self, j, e):
        """The key dim of element e of sub-space j (pqc_pq_dim)."""
        self._live()
        return lib.pqc_pq_dim(byref(self._pq), _int(j, "j"), _int(e, "e"))

    def encode(self, keys, codes=None, runtime=None):
        """Codes of the rows of keys, appended to `codes` (a new Codes when None)."""
        self._live()
        km, karr = _rows(keys, (self._pq.dim,), "keys", _KV_DTYPES)
        if codes is None:
            codes = Codes(self, km.rows)
        _check(lib.pqc_pq_encode(_rt(runtime), byref(self._pq), byref(km), byref(codes._c)), "PQ.encode")
        return codes

    def mse(self, keys, runtime=None):
        """Mean squared reconstruction error of keys' rows."""
        self._live()
        km, karr = _rows(keys, (self._pq.dim,), "keys", _KV_DTYPES)
        out = c_double()
        _check(lib.pqc_pq_mse(_rt(runtime), byref(self._pq), byref(km), byref(out)), "PQ.mse")
        return out.value

    def decode(self, codes, t):
        """Token t's key reconstructed from its codes (d_h floats)."""
        self._live()
        out = np.empty(self._pq.dim, _F32)
        _check(lib.pqc_pq_decode(byref(self._pq), byref(codes._live_c()), _size(t, "t"), out.ctypes.data),
               "PQ.decode")
        return out

    def lut(self, queries, runtime=None):
        """Lookup table (g, m, 2^bits) of query x centroid dot products."""
        self._live()
        q = _queries(queries, self._pq.dim)
        out = np.empty((q.shape[0], self._pq.m, self._pq.ksub), _F32)
        _check(lib.pqc_pq_lut(_rt(runtime), byref(self._pq), _addr(q, "queries"), q.shape[0], out.ctypes.data),
               "PQ.lut")
        return out

    def search(self, codes, queries, k, gqa="softmax_sum", first=0, count=0, rerank=0.0, keys=None,
               residuals=None, residual_scale=None, residual_weight=0.0, return_scores=False, runtime=None,
               softmax_scale=0.0):
        """Approximate top-k over the codes for g query heads (queries: (g, d_h)).

        Returns k token indices, ascending (and their combined scores with
        return_scores). rerank >= 1 rescores the top ceil(rerank k) with the exact keys.
        softmax_scale: the model's attention scale (0: 1/sqrt(d_h))."""
        self._live()
        c = codes._live_c()
        q = _queries(queries, self._pq.dim)
        d = _search_desc(k, gqa, first, count, softmax_scale)
        keep = []
        if rerank:
            d.rerank = float(rerank)
            if keys is not None:
                km, karr = _rows(keys, (self._pq.dim,), "keys", _KV_DTYPES)
                keep += [km, karr]
                d.keys = ctypes.pointer(km)
        if residuals is not None:
            r = np.ascontiguousarray(residuals, dtype=np.uint8)
            if r.size < c.count * self._pq.m:
                raise BadShapeError("residuals: %d bytes for %d tokens x m = %d" % (r.size, c.count, self._pq.m))
            sc = _f32(residual_scale, (self._pq.m,), "residual_scale")
            keep += [r, sc]
            d.residuals = ctypes.cast(r.ctypes.data, POINTER(c_uint8))
            d.residual_scale = ctypes.cast(sc.ctypes.data, POINTER(c_float))
            d.residual_weight = float(residual_weight)
        idx = np.empty(max(1, min(d.k, c.count)), _U32)
        scores = np.empty_like(idx, dtype=_F32) if return_scores else None
        _check(lib.pqc_pq_search(_rt(runtime), byref(self._pq), byref(c), _addr(q, "queries"), q.shape[0],
                                 byref(d), None, idx.ctypes.data, scores.ctypes.data if return_scores else None),
               "PQ.search")
        return (idx, scores) if return_scores else idx

    def scores(self, codes, queries, gqa="softmax_sum", first=0, count=0, runtime=None, softmax_scale=0.0):
        """Every token's combined approximate score (no selection)."""
        self._live()
        c = codes._live_c()
        q = _queries(queries, self._pq.dim)
        d = _search_desc(0, gqa, first, count, softmax_scale)
        n = d.count or max(0, c.count - d.first)
        out = np.empty(max(1, min(n, c.count)), _F32)
        _check(lib.pqc_pq_scores(_rt(runtime), byref(self._pq), byref(c), _addr(q, "queries"), q.shape[0],
                                 byref(d), None, out.ctypes.data), "PQ.scores")
        return out[:n]

    def residuals(self, codes, keys, first=0, scale=None, runtime=None):
        """Residual norms for residual-aware scoring: (bytes (rows, m), scale (m,))."""
        self._live()
        c = codes._live_c()
        km, karr = _rows(keys, (self._pq.dim,), "keys", _KV_DTYPES)
        sc = np.zeros(self._pq.m, _F32) if scale is None else _f32(scale, (self._pq.m,), "scale").copy()
        out = np.empty((km.rows, self._pq.m), np.uint8)
        _check(lib.pqc_pq_residuals(_rt(runtime), byref(self._pq), byref(c), _size(first, "first"), byref(km),
                                    sc.ctypes.data, out.ctypes.data), "PQ.residuals")
        return out, sc


class Codes(_Handle):
    """The PQ codes of a growing sequence (pqc_codes), for one quantizer's m and bits."""

    _what = "codes"

    def __init__(self, pq, capacity=0):
        pq._live()
        self._c = pqc_codes()
        _check(lib.pqc_codes_init(byref(self._c), byref(pq._pq), _size(capacity, "capacity"), None), "Codes")
        self._ptr = ctypes.addressof(self._c)

    def _free(self, ptr):
        lib.pqc_codes_free(byref(self._c))

    def _live_c(self):
        self._live()
        return self._c

    def __len__(self):
        return self._live_c().count

    count = property(lambda self: self._live_c().count)
    capacity = property(lambda self: self._live_c().capacity)

    @property
    def nbytes(self):
        """Exact bytes of the codes: m * ceil(count * bits / 8)."""
        return lib.pqc_codes_bytes(byref(self._live_c()))

    def reserve(self, capacity):
        _check(lib.pqc_codes_reserve(byref(self._live_c()), _size(capacity, "capacity")), "Codes.reserve")

    def get(self, t, j):
        """Token t's code in sub-space j."""
        c = self._live_c()
        t, j = _size(t, "t"), _int(j, "j")
        if t >= c.count or not 0 <= j < c.m:
            raise OutOfRangeError("Codes.get: token %d of %d, sub-space %d of %d" % (t, c.count, j, c.m))
        return lib.pqc_codes_get(byref(c), t, j)

    def to_array(self):
        """All codes as a (count, m) uint8 array (unpacked from the bit-packed columns)."""
        c = self._live_c()
        out = np.zeros((c.count, c.m), np.uint8)
        if c.count == 0:
            return out
        nb = (c.count * c.bits + 7) // 8
        base = ctypes.cast(c.data, c_void_p).value
        for j in range(c.m):
            col = np.ctypeslib.as_array((c_uint8 * nb).from_address(base + j * c.col_stride))
            bits = np.unpackbits(col, bitorder="little")[: c.count * c.bits].reshape(c.count, c.bits)
            out[:, j] = (bits.astype(np.uint16) << np.arange(c.bits, dtype=np.uint16)).sum(axis=1)
        return out


def exact_search(keys, queries, k, gqa="softmax_sum", return_scores=False, runtime=None, softmax_scale=0.0):
    """Exact top-k of keys' rows under the same GQA combination as the PQ search
    (softmax_scale: the model's attention scale, 0: 1/sqrt(d_h))."""
    qarr = np.asarray(queries)
    dim = qarr.shape[-1] if qarr.ndim else 0
    km, karr = _rows(keys, (dim,), "keys", _KV_DTYPES)
    q = _queries(qarr, dim)
    d = _search_desc(k, gqa, softmax_scale=softmax_scale)
    idx = np.empty(max(1, min(d.k, km.rows)), _U32)
    scores = np.empty_like(idx, dtype=_F32) if return_scores else None
    _check(lib.pqc_exact_search(_rt(runtime), byref(km), _addr(q, "queries"), q.shape[0], byref(d), None,
                                idx.ctypes.data, scores.ctypes.data if return_scores else None), "exact_search")
    return (idx, scores) if return_scores else idx


def exact_scores(keys, queries, gqa="softmax_sum", runtime=None):
    """Every row's exact combined score."""
    qarr = np.asarray(queries)
    dim = qarr.shape[-1] if qarr.ndim else 0
    km, karr = _rows(keys, (dim,), "keys", _KV_DTYPES)
    q = _queries(qarr, dim)
    out = np.empty(km.rows, _F32)
    _check(lib.pqc_exact_scores(_rt(runtime), byref(km), _addr(q, "queries"), q.shape[0], _enum("gqa", gqa), None,
                                out.ctypes.data), "exact_scores")
    return out


def rerank(keys, queries, candidates, k, gqa="softmax_sum", return_scores=False, runtime=None):
    """Exact top-k among candidate rows of keys (strictly ascending row indices)."""
    qarr = np.asarray(queries)
    dim = qarr.shape[-1] if qarr.ndim else 0
    km, karr = _rows(keys, (dim,), "keys", _KV_DTYPES)
    q = _queries(qarr, dim)
    cand = _indices(candidates, "rerank candidates")
    k = _size(k, "k")
    idx = np.empty(max(1, min(k, cand.size)), _U32)
    scores = np.empty_like(idx, dtype=_F32) if return_scores else None
    _check(lib.pqc_rerank(_rt(runtime), byref(km), _addr(q, "queries"), q.shape[0], _enum("gqa", gqa),
                          cand.ctypes.data, cand.size, k, None, idx.ctypes.data,
                          scores.ctypes.data if return_scores else None), "rerank")
    return (idx, scores) if return_scores else idx


def topk(scores, k, runtime=None):
    """Indices (ascending) and values of the k largest scores; ties to the lower index."""
    s = _f32(scores, (np.size(scores),), "scores")
    k = _size(k, "k")
    idx = np.empty(max(1, min(k, s.size)), _U32)
    vals = np.empty_like(idx, dtype=_F32)
    _check(lib.pqc_topk(_rt(runtime), _addr(s, "scores"), s.size, k, None, idx.ctypes.data, vals.ctypes.data),
           "topk")
    return idx, vals


def recall(truth, got):
    """Fraction of the indices in `truth` found in `got` (any order)."""
    t = _indices(truth, "recall truth")
    g = np.sort(_indices(got, "recall got"))
    return lib.pqc_recall(t.ctypes.data, t.size, g.ctypes.data, g.size)


# ----- scheduler ------------------------------------------------------------------------

_FIT_FIELDS = [name for name, _ in pqc_scheduler_fit._fields_]


class Scheduler(_Handle):
    """The adaptive T_max scheduler (pqc_scheduler); 0 means the library's default.

    Closing a scheduler closes the caches that use it first."""

    _what = "scheduler"

    def __init__(self, t_min=0, t_max=0, t_default=0, parallel=0.0):
        d = pqc_scheduler_desc()
        d.t_min = _int(t_min, "t_min")
        d.t_max = _int(t_max, "t_max")
        d.t_default = _int(t_default, "t_default")
        d.parallel = float(parallel)
        self._dependents = weakref.WeakSet()
        out = c_void_p()
        _check(lib.pqc_scheduler_create(byref(d), byref(out)), "Scheduler")
        self._ptr = out.value

    def _free(self, ptr):
        for dep in list(self._dependents):
            dep.close()
        lib.pqc_scheduler_destroy(ptr)

    def add_kmeans(self, tokens, iters, seconds):
        """One k-means measurement: `seconds` for `iters` iterations over `tokens` keys."""
        _check(lib.pqc_scheduler_add_kmeans(self._live(), float(tokens), _int(iters, "iters"), float(seconds)),
               "Scheduler.add_kmeans")

    def add_compute(self, tokens, seconds):
        """One measurement of the engine's prefill of one layer over `tokens` tokens."""
        _check(lib.pqc_scheduler_add_compute(self._live(), float(tokens), float(seconds)), "Scheduler.add_compute")

    def iters(self, tokens, jobs=1):
        """Lloyd iterations for a build over `tokens` keys whose `jobs` head builds share a layer."""
        return lib.pqc_scheduler_iters(self._live(), float(tokens), _int(jobs, "jobs"))

    def get_fit(self):
        """The fits as a dict: a1, b1 (k-means), a2, b2, g2 (compute), n1, n2 (samples)."""
        f = lib.pqc_scheduler_get_fit(self._live())
        return {name: getattr(f, name) for name in _FIT_FIELDS}

    def set_fit(self, fit=None, **values):
        """Fixes the fits (a dict like get_fit's, or keywords; missing ones are 0)."""
        values = dict(fit or {}, **values)
        unknown = set(values) - set(_FIT_FIELDS)
        if unknown:
            raise TypeError("unknown fit fields: %s" % ", ".join(sorted(unknown)))
        f = pqc_scheduler_fit()
        for name, v in values.items():
            setattr(f, name, _int(v, name) if name in ("n1", "n2") else float(v))
        _check(lib.pqc_scheduler_set_fit(self._live(), byref(f)), "Scheduler.set_fit")

    def save(self, path):
        _check(lib.pqc_scheduler_save(self._live(), _path(path)), "Scheduler.save")

    def load(self, path):
        """Replaces the fits by a saved calibration; on failure nothing changes."""
        _check(lib.pqc_scheduler_load(self._live(), _path(path)), "Scheduler.load")


# ----- sequence cache -------------------------------------------------------------------

# keyword -> (field of pqc_cache_desc or of its pq desc, kind)
_CACHE_FIELDS = {
    "n_layers": ("n_layers", c_int), "n_kv_heads": ("n_kv_heads", c_int), "n_q_heads": ("n_q_heads", c_int),
    "head_dim": ("head_dim", c_int), "kv_dtype": ("kv_dtype", "dtype"), "max_tokens": ("max_tokens", c_size_t),
    "n_sink": ("n_sink", c_int), "window": ("window", c_int), "budget_ratio": ("budget_ratio", float),
    "budget_tokens": ("budget_tokens", c_size_t), "recent_share": ("recent_share", float),
    "metric": ("metric", "metric"), "metric_floor": ("metric_floor", float), "observe": ("observe", c_int),
    "split": ("split", "split"), "gqa": ("gqa", "gqa"), "softmax_scale": ("softmax_scale", float),
    "rerank": ("rerank", float), "rerank_max": ("rerank_max", float),
    "outliers": ("outliers", c_int), "residual_weight": ("residual_weight", float),
    "block_tokens": ("block_tokens", c_int), "cache_blocks": ("cache_blocks", c_int),
    "policy": ("policy", "policy"), "admit_blocks": ("admit_blocks", c_int),
    "rebuild_share": ("rebuild_share", float), "cuda_stream": ("cuda_stream", c_void_p),
    "codes_resident": ("codes_resident", c_int), "first_kv_head": ("first_kv_head", c_int),
    # the PQ settings (pqc_cache_desc.pq)
    "m": ("pq.m", c_int), "bits": ("pq.bits", c_int), "iters": ("pq.iters", c_int), "init": ("pq.init", "init"),
    "max_points_per_centroid": ("pq.max_points_per_centroid", c_int), "seed": ("pq.seed", c_uint64),
    "pq_device": ("pq.device", c_int), "rope": ("pq.rope", "rope"), "subspaces": ("pq.subspaces", "subspaces"),
}


def _cache_desc(options, scheduler):
    d = pqc_cache_desc()
    for key, value in options.items():
        if key not in _CACHE_FIELDS:
            raise TypeError("unknown cache setting %r" % key)
        field, kind = _CACHE_FIELDS[key]
        if kind == "dtype":
            value = _dtype_code(value)
        elif isinstance(kind, str):
            value = _enum(kind, value)
        elif kind is float:
            value = float(value)
        else:
            value = _int(value, key, kind)
        target = d
        if field.startswith("pq."):
            target, field = d.pq, field[3:]
        setattr(target, field, value)
    if scheduler is not None:
        d.scheduler = scheduler._live()
    return d


def _desc_settings(d):
    """The settings (Cache's keywords) of a resolved pqc_cache_desc; enums by name"""
    names = {kind: {v: k for k, v in table.items()} for kind, table in _ENUMS.items()}
    out = {}
    for key, (field, kind) in _CACHE_FIELDS.items():
        if kind is c_void_p:
            continue
        target = d
        if field.startswith("pq."):
            target, field = d.pq, field[3:]
        value = getattr(target, field)
        if kind == "dtype":
            value = _DTYPE_NAMES.get(value, value)
        elif isinstance(kind, str):
            value = names[kind].get(value, value)
        out[key] = value
    return out


def resolve(runtime=None, **settings):
    """The configuration a Cache with these settings gets (pqc_cache_resolve): every default
    filled in, every rule checked; a dict of Cache's keywords. Nothing is created."""
    d, out = _cache_desc(settings, None), pqc_cache_desc()
    _check(lib.pqc_cache_resolve(_rt(runtime), byref(d), byref(out)), "resolve")
    return _desc_settings(out)


class Cache(_Handle):
    """A sequence cache (pqc_cache): one per request.

    Settings are pqc_cache_desc's fields as keywords (0 or absent: the library's
    default), with the PQ settings m, bits, iters, init, seed, rope, subspaces,
    max_points_per_centroid and pq_device; kv_dtype is "f32", "f16" or "bf16".
    K/V arrays are (tokens, n_kv_heads, head_dim) or (tokens, n_kv_heads * head_dim).
    runtime: a Runtime (None: jobs run inline on the calling thread)."""

    _what = "cache"

    def __init__(self, runtime=None, scheduler=None, **settings):
        self._lock = threading.RLock()
        d = _cache_desc(settings, scheduler)
        out = c_void_p()
        _check(lib.pqc_cache_create(_rt(runtime), byref(d), byref(out)), "Cache")
        self._adopt(out.value, runtime, scheduler, settings)

    def _adopt(self, ptr, runtime, scheduler, settings):
        self._lock = getattr(self, "_lock", None) or threading.RLock()
        self._ptr = ptr
        self._runtime = runtime
        self._scheduler = scheduler
        self._settings = dict(settings)
        s = self._settings
        self._n_layers = int(s.get("n_layers", 0))
        self._n_kv_heads = int(s.get("n_kv_heads", 0))
        self._n_q_heads = int(s.get("n_q_heads", 0)) or self._n_kv_heads
        self._head_dim = int(s.get("head_dim", 0))
        self._kv_dtype = _DTYPE_NAMES[_dtype_code(s.get("kv_dtype", 0))]
        self._max_tokens = int(s.get("max_tokens", 0)) or 1 << 20
        self._q_shapes = ((self._n_q_heads, self._head_dim), (self._n_q_heads * self._head_dim,))
        self._kv_shape = (self._n_kv_heads, self._head_dim)
        for owner in (runtime, scheduler):
            if owner is not None:
                owner._dependents.add(self)

    n_layers = property(lambda self: self._n_layers)
    n_kv_heads = property(lambda self: self._n_kv_heads)
    n_q_heads = property(lambda self: self._n_q_heads)
    head_dim = property(lambda self: self._head_dim)
    kv_dtype = property(lambda self: self._kv_dtype, doc='"f32", "f16" or "bf16"')
    max_tokens = property(lambda self: self._max_tokens)

    def _free(self, ptr):
        lib.pqc_cache_destroy(ptr)

    @_locked
    def close(self):
        """Frees the cache (waits for its builds); later calls raise BadStateError."""
        super().close()

    @classmethod
    def load(cls, path, runtime=None, scheduler=None, **settings):
        """A cache saved by save(), created with the same settings as the saved one."""
        d = _cache_desc(settings, scheduler)
        out = c_void_p()
        _check(lib.pqc_cache_load(_rt(runtime), byref(d), _path(path), byref(out)), "Cache.load")
        self = object.__new__(cls)
        self._adopt(out.value, runtime, scheduler, settings)
        return self

    @_locked
    def save(self, path):
        """Writes the whole cache to path (waits for the builds first)."""
        _check(lib.pqc_cache_save(self._live(), _path(path)), "Cache.save")

    @_locked
    def fork(self):
        """A new cache that shares this one's stored prefix and continues on its own."""
        out = c_void_p()
        _check(_optional("pqc_cache_fork")(self._live(), byref(out)), "Cache.fork")
        child = object.__new__(type(self))
        child._adopt(out.value, self._runtime, self._scheduler, self._settings)
        return child

    def _layer(self, layer):
        self._live()
        if type(layer) is not int:
            layer = _int(layer, "layer")
        if not 0 <= layer < self._n_layers:
            raise OutOfRangeError("layer %d not in 0..%d" % (layer, self._n_layers - 1))
        return layer

    def _head(self, head):
        head = _int(head, "head")
        if not 0 <= head < self._n_kv_heads:
            raise OutOfRangeError("head %d not in 0..%d" % (head, self._n_kv_heads - 1))
        return head

    @_locked
    def prefill(self, layer, k, v):
        """Stores n prompt tokens of one layer; the layer's PQ build starts in the background."""
        layer = self._layer(layer)
        km, karr = _rows(k, self._kv_shape, "K", _KV_DTYPES)
        vm, varr = _rows(v, self._kv_shape, "V", _KV_DTYPES)
        _check(lib.pqc_cache_prefill(self._ptr, layer, byref(km), byref(vm)), "Cache.prefill")

    @_locked
    def observe(self, layer, q):
        """Observes n queries of one layer ((n, n_q_heads, head_dim), post-RoPE) before its prefill."""
        layer = self._layer(layer)
        q = _real(q, "queries")
        hq, d = self._q_shapes[0]
        if q.shape in self._q_shapes:
            q = q.reshape(1, hq, d)  # one query row
        elif q.ndim == 2 and q.shape[1] == hq * d:
            q = q.reshape(-1, hq, d)
        if q.ndim != 3 or q.shape[1:] != (hq, d):
            raise BadShapeError("queries: shape %s, expected (n, %d, %d)" % (q.shape, hq, d))
        if q.shape[0] == 0:
            raise EmptyError("queries: no rows")
        q = _f32(q, q.shape, "queries")
        _check(lib.pqc_cache_observe(self._ptr, layer, _addr(q, "queries"), q.shape[0]), "Cache.observe")

    @_locked
    def append(self, layer, k, v):
        """One decode token's K and V ((n_kv_heads, head_dim) each) for one layer."""
        layer = self._layer(layer)
        k = _f32(k, self._kv_shape, "K")
        v = _f32(v, self._kv_shape, "V")
        _check(lib.pqc_cache_append(self._ptr, layer, _addr(k, "K"), _addr(v, "V")), "Cache.append")

    def selection(self):
        """An empty Selection for this cache, to pass to select(out=...)."""
        return Selection(self)

    def select(self, layer, q, out=None):
        """Sinks + top-k + window per KV head for queries q ((n_q_heads, head_dim) float32).

        Returns a Selection (out, when given, is filled and returned)."""
        if not (type(q) is np.ndarray and q.dtype == _F32 and q.flags.c_contiguous and q.flags.aligned
                and q.shape in self._q_shapes):
            q = _f32(q, self._q_shapes[0], "queries")
        with self._lock:  # inline rather than @_locked: this is the per-step call
            if type(layer) is not int or not 0 <= layer < self._n_layers or self._ptr is None:
                layer = self._layer(layer)
            if out is None:
                out = Selection(self, lib.pqc_cache_tokens(self._ptr, layer))
            elif type(out) is not Selection:
                raise InvalidArgumentError("Cache.select: out must be a Selection")
            elif out._n_kv_heads != self._n_kv_heads:
                raise BadShapeError("Cache.select: selection made for %d KV heads, cache has %d"
                                    % (out._n_kv_heads, self._n_kv_heads))
            qp = _addr(q, "queries")
            r = _select(self._ptr, layer, qp, out._ref)
            if r == CapacityError.code and out._grow(self, layer):  # refused before any change
                r = _select(self._ptr, layer, qp, out._ref)
        if r:
            _raise(r, "Cache.select")
        return out

    @_locked
    def fetch(self, layer, sel, out=None):
        """The selected K and V (float32) through the block cache.

        Returns (k, v), each (n_kv_heads, stride, head_dim): head h's rows are
        [h, :sel.counts[h]], in selection order (the rest is left as it was). out: a
        (k, v) pair of such arrays to fill instead of new ones."""
        layer = self._layer(layer)
        if not isinstance(sel, Selection):
            raise InvalidArgumentError("Cache.fetch: sel must be a Selection")
        stride = max(1, int(sel._count.max()) if sel._count.size else 1)
        if out is None:
            k = _empty_f32_lines((self._n_kv_heads, stride, self._head_dim))
            v = _empty_f32_lines(k.shape)
        else:
            k, v = out
            for a, name in ((k, "k"), (v, "v")):
                if not (isinstance(a, np.ndarray) and a.dtype == _F32 and a.flags.carray and a.ndim == 3
                        and a.shape[0] == self._n_kv_heads and a.shape[2] == self._head_dim and a.shape[1] >= 1):
                    raise BadShapeError("Cache.fetch: out %s must be writable, C-contiguous float32 (%d, rows, %d)"
                                        % (name, self._n_kv_heads, self._head_dim))
            if k.shape != v.shape:
                raise BadShapeError("Cache.fetch: out k %s and v %s differ" % (k.shape, v.shape))
            stride = k.shape[1]
        kv = pqc_kv_out(ctypes.cast(k.ctypes.data, POINTER(c_float)), ctypes.cast(v.ctypes.data, POINTER(c_float)),
                        stride)
        _check(lib.pqc_cache_fetch(self._ptr, layer, sel._ref, byref(kv)), "Cache.fetch")
        return k, v

    @_locked
    def config(self):
        """The cache's configuration as the library resolved it (pqc_cache_config), its
        window once fixed: a dict of the keywords Cache takes."""
        out = pqc_cache_desc()
        _check(lib.pqc_cache_config(self._live(), byref(out)), "Cache.config")
        return _desc_settings(out)

    @_locked
    def tokens(self, layer=0):
        """Tokens stored at a layer."""
        return lib.pqc_cache_tokens(self._ptr, self._layer(layer))

    @property
    @_locked
    def window(self):
        """The recent window in tokens (0 until known)."""
        return lib.pqc_cache_window(self._live())

    @_locked
    def layer_window(self, layer):
        """A layer's recent window in tokens: the cache's, or less where a build lowered it
        from the observed attention."""
        return lib.pqc_cache_layer_window(self._live(), self._layer(layer))

    @property
    @_locked
    def on_device(self):
        """True when the device tier is on a CUDA GPU."""
        return bool(lib.pqc_cache_on_device(self._live()))

    @_locked
    def memory(self):
        """(device tier bytes, bytes of the whole K/V in the storage dtype)."""
        dev, full = c_size_t(), c_size_t()
        lib.pqc_cache_memory(self._live(), byref(dev), byref(full))
        return dev.value, full.value

    @_locked
    def host_memory(self):
        """(bytes this cache holds alone, bytes of the prefix it shares with its forks)."""
        own, shared = c_size_t(), c_size_t()
        _optional("pqc_cache_host_memory")(self._live(), byref(own), byref(shared))
        return own.value, shared.value

    @_locked
    def stats(self, layer):
        """A layer's statistics (pqc_layer_stats) as a dict."""
        st = pqc_layer_stats()
        _check(lib.pqc_cache_stats(self._ptr, self._layer(layer), byref(st)), "Cache.stats")
        return {name: getattr(st, name) for name, _ in pqc_layer_stats._fields_}

    @_locked
    def sync(self):
        """Waits for every build; raises the first build's error, if any."""
        _check(lib.pqc_cache_sync(self._live()), "Cache.sync")

    @_locked
    def kv(self, layer, head):
        """A copy of the stored K and V of one (layer, KV head): (tokens, head_dim) each,
        in the storage dtype (bfloat16 as uint16)."""
        layer, head = self._layer(layer), self._head(head)
        dtype = _DTYPE_NUMPY[_DTYPE_CODES[self._kv_dtype]]
        kp, vp, n = c_void_p(), c_void_p(), c_size_t()

        def rows(p, count):
            nbytes = count * self._head_dim * dtype.itemsize
            return np.frombuffer((c_char * nbytes).from_address(p.value), dtype).reshape(count, self._head_dim)

        if not hasattr(lib, "pqc_cache_kv_part"):  # a library without forks: one part
            _check(lib.pqc_cache_kv(self._ptr, layer, head, byref(kp), byref(vp), byref(n), None), "Cache.kv")
            return rows(kp, n.value).copy(), rows(vp, n.value).copy()
        ks, vs, start = [np.empty((0, self._head_dim), dtype)], [np.empty((0, self._head_dim), dtype)], 0
        while True:  # a fork's rows lie in two parts: the shared prefix, then its own
            _check(lib.pqc_cache_kv_part(self._ptr, layer, head, start, byref(kp), byref(vp), byref(n)), "Cache.kv")
            if n.value == 0:
                return np.concatenate(ks), np.concatenate(vs)
            ks.append(rows(kp, n.value))
            vs.append(rows(vp, n.value))
            start += n.value

    @_locked
    def observed_mass(self, layer, head):
        """(sinks, window): the share of the observed queries' attention on each."""
        layer, head = self._layer(layer), self._head(head)
        s, w = c_double(), c_double()
        _check(lib.pqc_cache_observed_mass(self._ptr, layer, head, byref(s), byref(w)), "Cache.observed_mass")
        return s.value, w.value

    @_locked
    def head_plan(self, layer, q, head):
        """One KV head's part in a select of this layer with queries q ((n_q_heads, head_dim)),
        without selecting (pqc_cache_head_plan): (plan, scores), plan a dict (tokens, sinks,
        window, coded, take, candidates), scores the PQ score the search ranks each coded
        token by (float32, plan["coded"] of them; token n_sink + i for scores[i]; empty
        before the layer's first build)."""
        layer, head = self._layer(layer), self._head(head)
        q = _f32(q, self._q_shapes[0], "queries")
        plan = pqc_head_plan()
        _check(lib.pqc_cache_head_plan(self._ptr, layer, _addr(q, "queries"), head, byref(plan), None, 0),
               "Cache.head_plan")
        scores = np.zeros(plan.coded, dtype=_F32)
        if plan.coded:
            _check(lib.pqc_cache_head_plan(self._ptr, layer, _addr(q, "queries"), head, byref(plan),
                                           _addr(scores, "scores"), plan.coded), "Cache.head_plan")
        return {name: getattr(plan, name) for name, _ in pqc_head_plan._fields_}, scores

    @_locked
    def report_compute(self, layer, tokens, seconds):
        """The engine's compute time for one layer's prefill (feeds the scheduler)."""
        _check(lib.pqc_cache_report_compute(self._ptr, self._layer(layer), float(tokens), float(seconds)),
               "Cache.report_compute")

    @_locked
    def cached_blocks(self, layer, head):
        """The blocks (token // block_tokens) held in the block cache of one (layer, KV head)."""
        layer, head = self._layer(layer), self._head(head)
        n = lib.pqc_cache_cached_blocks(self._ptr, layer, head, None, 0)
        out = np.empty(max(n, 1), np.int32)
        n = lib.pqc_cache_cached_blocks(self._ptr, layer, head, out.ctypes.data, out.size)
        return out[:n].copy()

    @_locked
    def time_select(self, layer, q, sel, reps):
        """Seconds that `reps` pqc_cache_select calls take, timed in C (for benchmarks)."""
        layer = self._layer(layer)
        q = _f32(q, self._q_shapes[0], "queries")
        reps = _int(reps, "reps")
        if not isinstance(sel, Selection):
            raise InvalidArgumentError("Cache.time_select: sel must be a Selection")
        if reps < 1:
            raise OutOfRangeError("time_select: reps = %d" % reps)
        sel._grow(self, layer)
        secs = c_double()
        _check(lib.pqcpy_time_select(self._ptr, layer, q.ctypes.data, sel._ref, reps, byref(secs)),
               "Cache.time_select")
        return secs.value


class Selection:
    """Token indices to attend, per KV head, ascending (a pqc_selection whose memory is numpy's).

    sel[h] is head h's indices (a view: a later select(out=sel) overwrites it),
    sel.counts the number per head. Indices stay valid after the cache changes."""

    def __init__(self, cache, capacity=None):
        cache._live()
        self._n_kv_heads = cache.n_kv_heads
        self._c = pqc_selection()
        self._c.n_kv_heads = self._n_kv_heads
        self._c.owned = 0  # the C side never reallocates it: _reserve does
        self._count = np.zeros(self._n_kv_heads, np.uintp)
        self._c.count = ctypes.cast(self._count.ctypes.data, POINTER(c_size_t))
        self._idx = np.zeros((self._n_kv_heads, 0), _U32)
        self._ref = byref(self._c)
        if capacity is None:  # room for the longest layer now
            capacity = max(cache.tokens(layer) for layer in range(cache.n_layers))
        self._reserve(_size(capacity, "capacity"), cache.max_tokens)

    def _grow(self, cache, layer):
        """Room for the layer's tokens; False when there already was."""
        n = lib.pqc_cache_tokens(cache._ptr, layer)
        if n <= self._c.capacity:
            return False
        self._reserve(n, cache.max_tokens)
        return True

    def _reserve(self, n, max_tokens):
        cap = min(n + n // 8 + 256, max(max_tokens, n))
        idx = np.zeros((self._n_kv_heads, cap), _U32)
        if self._idx.size:
            idx[:, : self._idx.shape[1]] = self._idx
        self._idx = idx
        self._c.idx = ctypes.cast(idx.ctypes.data, POINTER(c_uint32))
        self._c.capacity = cap

    @classmethod
    def from_indices(cls, cache, indices):
        """A selection of chosen tokens: one ascending index array per KV head (for fetch)."""
        if len(indices) != cache.n_kv_heads:
            raise BadShapeError("Selection.from_indices: %d arrays for %d KV heads" % (len(indices), cache.n_kv_heads))
        arrays = [_indices(a, "Selection.from_indices") for a in indices]
        sel = cls(cache, max(a.size for a in arrays))
        for h, a in enumerate(arrays):
            sel._idx[h, : a.size] = a
            sel._count[h] = a.size
        return sel

    @property
    def counts(self):
        """Indices per KV head (a copy)."""
        return self._count.astype(np.int64)

    def __len__(self):
        return self._n_kv_heads

    def __getitem__(self, h):
        if not -self._n_kv_heads <= h < self._n_kv_heads:
            raise IndexError("head %d of %d" % (h, self._n_kv_heads))
        return self._idx[h, : self._count[h]]

    def __iter__(self):
        return (self[h] for h in range(self._n_kv_heads))

    def tolist(self):
        """Per head a list of indices."""
        return [a.tolist() for a in self]


# ----- batches ----------------------------------------------------------------------------


@contextlib.contextmanager
def _batch(caches, what):
    """Distinct live caches, each locked (in a fixed order) for the call."""
    caches = list(caches)
    if not caches:
        raise EmptyError("%s: no caches" % what)
    if not all(isinstance(c, Cache) for c in caches) or len({id(c) for c in caches}) != len(caches):
        raise InvalidArgumentError("%s: the caches must be distinct Cache objects" % what)
    with contextlib.ExitStack() as stack:
        for c in sorted(caches, key=id):
            stack.enter_context(c._lock)
        yield caches


def _pointers(values):
    return (c_void_p * len(values))(*values)


def batch_select(caches, layer, queries, out=None):
    """Cache.select on several caches (sequences) at once; their work runs in parallel
    on the runtime's pool. queries[i] and out[i] (optional Selections) belong to
    caches[i]. Returns the list of Selections."""
    with _batch(caches, "batch_select") as caches:
        n = len(caches)
        queries = list(queries)
        outs = [None] * n if out is None else list(out)
        if len(queries) != n or len(outs) != n:
            raise BadShapeError("batch_select: %d caches, %d queries, %d selections" % (n, len(queries), len(outs)))
        qs, sels = [], []
        for c, q, sel in zip(caches, queries, outs):
            layer = c._layer(layer)
            qs.append(_f32(q, c._q_shapes[0], "queries"))
            if sel is None:
                sel = Selection(c, lib.pqc_cache_tokens(c._ptr, layer))
            elif not isinstance(sel, Selection) or sel._n_kv_heads != c._n_kv_heads:
                raise BadShapeError("batch_select: selection %d does not fit its cache" % len(sels))
            sel._grow(c, layer)
            sels.append(sel)
        if len({id(sel) for sel in sels}) != n:
            raise InvalidArgumentError("batch_select: the selections must be distinct")
        _check(lib.pqc_batch_select(_pointers([c._ptr for c in caches]), n, layer,
                                    _pointers([_addr(q, "queries") for q in qs]),
                                    _pointers([ctypes.addressof(sel._c) for sel in sels])), "batch_select")
    return sels


def batch_fetch(caches, layer, selections):
    """Cache.fetch on several caches at once; returns a (k, v) pair per cache."""
    with _batch(caches, "batch_fetch") as caches:
        n = len(caches)
        sels = list(selections)
        if len(sels) != n or not all(isinstance(sel, Selection) for sel in sels):
            raise BadShapeError("batch_fetch: %d caches need %d Selections" % (n, n))
        outs, views = [], (pqc_kv_out * n)()
        for i, (c, sel) in enumerate(zip(caches, sels)):
            layer = c._layer(layer)
            stride = max(1, int(sel._count.max()))
            k = _empty_f32_lines((c._n_kv_heads, stride, c._head_dim))
            v = _empty_f32_lines(k.shape)
            views[i] = pqc_kv_out(ctypes.cast(k.ctypes.data, POINTER(c_float)),
                                  ctypes.cast(v.ctypes.data, POINTER(c_float)), stride)
            outs.append((k, v))
        base, size = ctypes.addressof(views), sizeof(pqc_kv_out)
        _check(lib.pqc_batch_fetch(_pointers([c._ptr for c in caches]), n, layer,
                                   _pointers([ctypes.addressof(sel._c) for sel in sels]),
                                   _pointers([base + i * size for i in range(n)])), "batch_fetch")
    return outs
