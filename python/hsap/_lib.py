"""Loading libhsap.so and the ctypes mirror of include/hsap/hsap.h.

The library is found, in this order:
  1. $HSAP_LIBRARY, the path of a built libhsap.so (e.g. build/libhsap.so of a checkout);
  2. libhsap.so installed inside this package (pip install ./python builds it there);
  3. libhsap.so on the system search path (cmake --install, ldconfig).
ctypes.CDLL releases the GIL around every call, so ranks in Python threads run in parallel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from pathlib import Path

# The header this binding mirrors: HSAP_VERSION_CODE of include/hsap/hsap.h.
HSAP_MAJOR = 0
HSAP_MINOR = 1
HSAP_PATCH = 0
VERSION_CODE = HSAP_MAJOR * 10000 + HSAP_MINOR * 100 + HSAP_PATCH
CONFIG_MAGIC = 0x48534150

# hsapResult_t
SUCCESS = 0
INVALID_ARGUMENT = 1
INVALID_USAGE = 2
SYSTEM_ERROR = 3
INTERNAL_ERROR = 4
UNSUPPORTED = 5
TIMEOUT = 6
ABORTED = 7
COMPILE_ERROR = 8
OUT_OF_MEMORY = 9

# hsapDataType_t
FLOAT32 = 0
BFLOAT16 = 1
FLOAT16 = 2

# hsapMaskKind_t
MASK_CAUSAL = 0
MASK_FULL = 1
MASK_PREFIX_LM = 2
MASK_SLIDING_WINDOW = 3

# hsapSliceKind_t
SLICE_FULL = 0
SLICE_CAUSAL = 1

# hsapBackend_t (appended to hsapCommConfig_t in 0.1; a library without the field accepts
# the longer struct when the field is 0, i.e. hsapBackendDefault).
BACKEND_DEFAULT = 0
BACKEND_HOST = 1
BACKEND_CUDA = 2

c_int64_p = ctypes.POINTER(ctypes.c_int64)
c_double_p = ctypes.POINTER(ctypes.c_double)
c_int_p = ctypes.POINTER(ctypes.c_int)
c_float_p = ctypes.POINTER(ctypes.c_float)


class MaskSlice(ctypes.Structure):
    _fields_ = [
        ("qBegin", ctypes.c_int64),
        ("qEnd", ctypes.c_int64),
        ("kBegin", ctypes.c_int64),
        ("kEnd", ctypes.c_int64),
        ("kind", ctypes.c_int),
        ("window", ctypes.c_int64),
    ]


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("numTokens", ctypes.c_int64),
        ("numHeads", ctypes.c_int32),
        ("headDim", ctypes.c_int32),
    ]


class AttentionConfig(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("softmaxScale", ctypes.c_float),
        ("numThreads", ctypes.c_int),
    ]


class CommConfig(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("timeoutMs", ctypes.c_int),
        ("numThreads", ctypes.c_int),
        ("cudaStream", ctypes.c_void_p),
        ("backend", ctypes.c_int),
    ]


class BatchConfig(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("dtype", ctypes.c_int),
        ("numHeadsQ", ctypes.c_int),
        ("numHeadsKV", ctypes.c_int),
        ("headDim", ctypes.c_int),
        ("softmaxScale", ctypes.c_float),
    ]


class Traffic(ctypes.Structure):
    _fields_ = [
        ("forwardBytesSent", ctypes.c_uint64),
        ("forwardBytesReceived", ctypes.c_uint64),
        ("backwardBytesSent", ctypes.c_uint64),
        ("backwardBytesReceived", ctypes.c_uint64),
    ]


class TrafficDetail(ctypes.Structure):
    _fields_ = [
        ("forwardAllToAllBytesSent", ctypes.c_uint64),
        ("forwardAllToAllBytesReceived", ctypes.c_uint64),
        ("forwardRingBytesSent", ctypes.c_uint64),
        ("forwardRingBytesReceived", ctypes.c_uint64),
        ("backwardAllToAllBytesSent", ctypes.c_uint64),
        ("backwardAllToAllBytesReceived", ctypes.c_uint64),
        ("backwardRingBytesSent", ctypes.c_uint64),
        ("backwardRingBytesReceived", ctypes.c_uint64),
    ]


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def new_config(struct_type: type) -> ctypes.Structure:
    """A config struct as its HSAP_*_INITIALIZER fills it (the remaining fields zero)."""
    config = struct_type()
    config.size = ctypes.sizeof(struct_type)
    config.magic = CONFIG_MAGIC
    config.version = VERSION_CODE
    return config


_H = ctypes.c_void_p  # every opaque handle
_P = ctypes.POINTER
_PROTOTYPES: dict[str, tuple] = {
    "hsapGetVersion": (c_int_p,),
    "hsapLayoutCreate": (_P(_H), c_int64_p, ctypes.c_int64, c_int_p, c_int64_p),
    "hsapLayoutCreateFromSlices": (_P(_H), ctypes.c_int64, _P(MaskSlice), ctypes.c_int64),
    "hsapLayoutDestroy": (_H,),
    "hsapLayoutGetNumTokens": (_H, c_int64_p),
    "hsapLayoutGetVisiblePairs": (_H, c_int64_p),
    "hsapLayoutGetSlices": (_H, _P(MaskSlice), c_int64_p),
    "hsapAttentionForwardLocal": (_P(AttentionConfig), _H, _P(Tensor), _P(Tensor), _P(Tensor),
                                  _P(Tensor), c_float_p),
    "hsapAttentionBackwardLocal": (_P(AttentionConfig), _H, _P(Tensor), _P(Tensor), _P(Tensor),
                                   _P(Tensor), _P(Tensor), c_float_p, _P(Tensor), _P(Tensor),
                                   _P(Tensor)),
    "hsapCommInitAll": (_P(_H), ctypes.c_int, _P(CommConfig)),
    "hsapCommDestroy": (_H,),
    "hsapCommAbort": (_H,),
    "hsapCommCount": (_H, c_int_p),
    "hsapCommUserRank": (_H, c_int_p),
    "hsapCommIsCuda": (_H, c_int_p),
    "hsapGetUniqueId": (_P(UniqueId),),
    "hsapCommInitRank": (_P(_H), ctypes.c_int, UniqueId, ctypes.c_int, _P(CommConfig)),
    "hsapPartitionCreate": (_P(_H), _H, ctypes.c_int, c_double_p),
    "hsapPartitionCreateForLayouts": (_P(_H), _P(_H), ctypes.c_int, ctypes.c_int, c_double_p),
    "hsapPartitionDestroy": (_H,),
    "hsapPartitionGetRanges": (_H, ctypes.c_int, c_int64_p, c_int64_p, c_int64_p),
    "hsapPartitionScatter": (_H, ctypes.c_void_p, ctypes.c_size_t, _P(ctypes.c_void_p)),
    "hsapPartitionGather": (_H, _P(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_void_p),
    "hsapBatchCreate": (_P(_H), _H, _H, c_double_p, _P(BatchConfig)),
    "hsapBatchCreateWithPlan": (_P(_H), _H, _H, _H, _P(BatchConfig)),
    "hsapBatchCreateWithPartition": (_P(_H), _H, _H, _H, _P(BatchConfig)),
    "hsapBatchCreateManyWithPartition": (_P(_H), ctypes.c_int, _H, _P(_H), _H, _P(BatchConfig)),
    "hsapBatchDestroy": (_H,),
    "hsapBatchGetPartition": (_H, _P(_H)),
    "hsapBatchGetLocalTokens": (_H, c_int64_p),
    "hsapAttentionForward": (_H, _P(Tensor), _P(Tensor), _P(Tensor), _P(Tensor), c_float_p),
    "hsapAttentionBackward": (_H, _P(Tensor), _P(Tensor), _P(Tensor), _P(Tensor), _P(Tensor),
                              c_float_p, _P(Tensor), _P(Tensor), _P(Tensor)),
    "hsapAttentionForwardOnStream": (_H, _P(Tensor), _P(Tensor), _P(Tensor), _P(Tensor),
                                     c_float_p, ctypes.c_void_p),
    "hsapAttentionBackwardOnStream": (_H, _P(Tensor), _P(Tensor), _P(Tensor), _P(Tensor),
                                      _P(Tensor), c_float_p, _P(Tensor), _P(Tensor), _P(Tensor),
                                      ctypes.c_void_p),
    "hsapBatchGetTraffic": (_H, _P(Traffic)),
    "hsapBatchGetTrafficDetail": (_H, _P(TrafficDetail)),
    "hsapPlanCreate": (_P(_H), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, c_int_p,
                       c_int_p, c_double_p, c_double_p, c_int_p, c_int_p, c_int_p),
    "hsapPlanCreateFromJson": (_P(_H), ctypes.c_char_p),
    "hsapPlanToJson": (_H, ctypes.c_char_p, _P(ctypes.c_size_t)),
    "hsapPlanDestroy": (_H,),
    "hsapPlanGetPredictedTime": (_H, c_double_p, c_double_p),
    "hsapPlanGetShape": (_H, c_int_p, c_int_p, c_int_p, c_int_p),
}

_lib: ctypes.CDLL | None = None
_lib_path: str | None = None
_lock = threading.Lock()


def _candidates() -> list[str]:
    env = os.environ.get("HSAP_LIBRARY")
    if env:
        return [env]  # an explicit choice is never silently replaced by another library
    paths = [str(Path(__file__).with_name("libhsap.so"))]
    found = ctypes.util.find_library("hsap")
    if found:
        paths.append(found)
    return paths


def lib() -> ctypes.CDLL:
    """The loaded libhsap.so (loaded and checked on first use)."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for path in _candidates():
            if os.sep in path and not os.path.exists(path):
                tried.append(f"{path} (no such file)")
                continue
            try:
                handle = ctypes.CDLL(path)
            except OSError as e:
                tried.append(f"{path} ({e})")
                continue
            _bind(handle)
            _check_version(handle, path)
            _lib, _lib_path = handle, path
            return handle
        raise ImportError(
            "hsap: libhsap.so not found; tried " + "; ".join(tried) +
            ". Install the package with `pip install ./python` (builds it), or set "
            "HSAP_LIBRARY to a built libhsap.so (e.g. build/libhsap.so after scripts/build.sh).")


def library_path() -> str:
    """The path libhsap.so was loaded from."""
    lib()
    assert _lib_path is not None
    return _lib_path


def _bind(handle: ctypes.CDLL) -> None:
    for name, argtypes in _PROTOTYPES.items():
        fn = getattr(handle, name)
        fn.argtypes = list(argtypes)
        fn.restype = ctypes.c_int
    handle.hsapGetLastError.argtypes = []
    handle.hsapGetLastError.restype = ctypes.c_char_p
    handle.hsapGetErrorString.argtypes = [ctypes.c_int]
    handle.hsapGetErrorString.restype = ctypes.c_char_p


def _check_version(handle: ctypes.CDLL, path: str) -> None:
    version = ctypes.c_int(0)
    if handle.hsapGetVersion(ctypes.byref(version)) != SUCCESS:
        raise ImportError(f"hsap: hsapGetVersion failed in {path}")
    major, minor = version.value // 10000, version.value // 100 % 100
    # Same rule as the C ABI's config structs: same major, this minor or a later one.
    if major != HSAP_MAJOR or minor < HSAP_MINOR:
        raise ImportError(
            f"hsap: {path} has ABI version {version.value} but this package binds "
            f"{VERSION_CODE} (major {HSAP_MAJOR}, minor >= {HSAP_MINOR} needed); rebuild "
            "libhsap.so from the same checkout or reinstall the package.")
