"""ctypes bindings of the C ABI (include/moegraph/moegraph.h): the library, its structs and calls.

The library is found through MOEGRAPH_LIBRARY (a path to libmoegraph.so*), else pkg-config
(`pkg-config --variable=libdir moegraph`), else the loader's search path. Every struct mirrors its
C declaration field for field (python/tests/test_bindings.py compares them with the header)."""
import ctypes
import ctypes.util
import os
import pathlib
import subprocess

ABI_MAJOR = 0  # the C ABI these bindings follow: libmoegraph.so.0

c_int, c_int64, c_size_t, c_void_p, c_double = ctypes.c_int, ctypes.c_int64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_double

STATUS_NAMES = {0: "MG_OK", 1: "MG_ERR_INVALID_ARGUMENT", 2: "MG_ERR_CUDA", 3: "MG_ERR_LIBRARY",
                4: "MG_ERR_DEVICE_SPLITS", 5: "MG_ERR_INTERNAL", 6: "MG_ERR_NO_DEVICE",
                7: "MG_ERR_UNSUPPORTED_DEVICE", 8: "MG_ERR_CONFIG", 9: "MG_ERR_INVALID_HANDLE"}
DTYPE = {"bf16": 0, "fp16": 1}
RECIPE = {"bf16": 0, "mxfp8": 1}
ROUTER_SCORE = {"softmax": 0, "sigmoid": 1}
SHARD_POLICY = {"chunk": 0, "balanced": 1}


class MoegraphError(RuntimeError):
    """A failed C ABI call: .status is the mg_status value, .status_name its name."""

    def __init__(self, status, message):
        self.status = status
        self.status_name = STATUS_NAMES.get(status, str(status))
        super().__init__(f"{self.status_name}: {message}")


class _Sized(ctypes.Structure):
    """A C struct whose first field is its own size (moegraph.h's convention)."""

    def __init__(self, **fields):
        super().__init__(struct_size=ctypes.sizeof(type(self)), **fields)


class GroupedLinearOptions(_Sized):
    _fields_ = [("struct_size", c_size_t), ("num_groups", c_int), ("in_features", c_int64),
                ("out_features", c_int64), ("capacity_rows", c_int64), ("row_align", c_int), ("dtype", c_int),
                ("bias", c_int), ("wgrad_slots", c_int), ("delay_wgrad", c_int), ("recipe", c_int),
                ("prequantized_weights", c_int), ("dequantized_weights", c_int64), ("forward_only", c_int64)]


# The four arrays of MXFP8 weights (moegraph.h, "MXFP8 weights"), under a prefix.
def _mxfp8_fields(prefix):
    return [(prefix + name, c_void_p) for name in ("data", "scales", "data_t", "scales_t")]


# Their bf16 values (dequantized_weights), appended in a later release.
def _dequantized_fields(prefix):
    return [(prefix + name, c_void_p) for name in ("dequantized", "dequantized_t")]


# Their scales in the swap-AB route's tile order (mg_tile_mxfp8_weight_scales), appended after those.
def _tiled_fields(prefix):
    return [(prefix + name, c_void_p) for name in ("scales_tiled", "scales_t_tiled")]


class ForwardArgs(_Sized):
    _fields_ = [("struct_size", c_size_t), ("x", c_void_p), ("splits", c_void_p), ("weight", c_void_p),
                ("bias", c_void_p), ("bias_scale", c_void_p), ("y", c_void_p), ("offsets", c_void_p),
                *_mxfp8_fields("mxfp8_"), *_dequantized_fields("mxfp8_"), *_tiled_fields("mxfp8_")]


class BackwardArgs(_Sized):
    _fields_ = [("struct_size", c_size_t), ("dy", c_void_p), ("weight", c_void_p), ("bias", c_void_p),
                ("dx", c_void_p), ("dbias", c_void_p), ("dbias_scale", c_void_p), ("dweight", c_void_p),
                ("main_grad", c_void_p), *_mxfp8_fields("mxfp8_"), *_dequantized_fields("mxfp8_"),
                *_tiled_fields("mxfp8_")]


class MoeLayerOptions(_Sized):
    _fields_ = [("struct_size", c_size_t), ("experts", c_int), ("hidden", c_int64), ("ffn", c_int64),
                ("top_k", c_int), ("bias", c_int), ("score", c_int), ("renormalize", c_int),
                ("aux_loss_coef", c_double), ("capacity_factor", c_double), ("fuse_weights", c_int),
                ("max_tokens", c_int64), ("row_align", c_int), ("dtype", c_int), ("training", c_int),
                ("wgrad_slots", c_int), ("delay_wgrad", c_int), ("main_grad_fp32", c_int), ("recipe", c_int),
                ("expert_parallel", c_int), ("ep_recv_rows", c_int64), ("prequantized_weights", c_int),
                ("ep_exchange", c_int), ("ep_chunk_rows", c_int64), ("dequantized_weights", c_int)]


class MoeLayerWeights(_Sized):
    _fields_ = [("struct_size", c_size_t), ("router", c_void_p), ("w1", c_void_p), ("b1", c_void_p),
                ("w2", c_void_p), ("b2", c_void_p), ("main_grad_router", c_void_p), ("main_grad1", c_void_p),
                ("main_grad2", c_void_p), ("d_router", c_void_p), ("dw1", c_void_p), ("dw2", c_void_p),
                ("db1", c_void_p), ("db2", c_void_p),
                *_mxfp8_fields("w1_mxfp8_"), *_mxfp8_fields("w2_mxfp8_"),
                *_dequantized_fields("w1_mxfp8_"), *_dequantized_fields("w2_mxfp8_"),
                *_tiled_fields("w1_mxfp8_"), *_tiled_fields("w2_mxfp8_")]


class MoeLayerIO(_Sized):
    _fields_ = [("struct_size", c_size_t), ("x", c_void_p), ("num_tokens", c_void_p), ("y", c_void_p),
                ("aux_loss", c_void_p), ("dy", c_void_p), ("dx", c_void_p)]


class ConfigShape(_Sized):
    _fields_ = [("struct_size", c_size_t), ("whole_layer", c_int), ("experts", c_int), ("hidden", c_int64),
                ("ffn", c_int64), ("top_k", c_int), ("bias", c_int), ("dtype", c_int), ("recipe", c_int),
                ("training", c_int), ("delay_wgrad", c_int), ("main_grad_fp32", c_int), ("num_buckets", c_int),
                ("max_tokens", c_int64), ("expert_parallel", c_int), ("prequantized_weights", c_int),
                ("dequantized_weights", c_int), ("shard_ranks", c_int64), ("shard_policy", c_int),
                ("shard_unit", c_int)]


class StepWeights(_Sized):
    _fields_ = [("struct_size", c_size_t), ("router", c_void_p), ("main_grad_router", c_void_p),
                ("d_router", c_void_p), ("w1", c_void_p), ("w2", c_void_p), ("b1", c_void_p), ("b2", c_void_p),
                ("main_grad1", c_void_p), ("main_grad2", c_void_p), ("dw1", c_void_p), ("dw2", c_void_p),
                ("db1", c_void_p), ("db2", c_void_p),
                *_mxfp8_fields("w1_mxfp8_"), *_mxfp8_fields("w2_mxfp8_"),
                *_dequantized_fields("w1_mxfp8_"), *_dequantized_fields("w2_mxfp8_"),
                *_tiled_fields("w1_mxfp8_"), *_tiled_fields("w2_mxfp8_")]


class StepGraphsOptions(_Sized):
    _fields_ = [("struct_size", c_size_t), ("thread_local_capture", c_int), ("comm", c_void_p),
                ("shard_comm", c_void_p)]


class BucketIO(_Sized):
    _fields_ = [("struct_size", c_size_t), ("tokens", c_int64), ("rows", c_int64), ("x", c_void_p),
                ("splits", c_void_p), ("num_tokens", c_void_p), ("aux_loss", c_void_p), ("y", c_void_p),
                ("dy", c_void_p), ("dx", c_void_p)]


STRUCTS = {"mg_grouped_linear_options": GroupedLinearOptions, "mg_forward_args": ForwardArgs,
           "mg_backward_args": BackwardArgs, "mg_moe_layer_options": MoeLayerOptions,
           "mg_moe_layer_weights": MoeLayerWeights, "mg_moe_layer_io": MoeLayerIO, "mg_config_shape": ConfigShape,
           "mg_step_weights": StepWeights, "mg_step_graphs_options": StepGraphsOptions, "mg_bucket_io": BucketIO}

P = ctypes.POINTER
_h = c_void_p  # handles are opaque pointers
# name: (restype, argtypes); a restype of c_int is an mg_status checked by call().
SIGNATURES = {
    "mg_status_string": (ctypes.c_char_p, [c_int]),
    "mg_last_error": (ctypes.c_char_p, []),
    "mg_version": (c_int, []),
    "mg_nccl_version": (c_int, []),
    "mg_mxfp8_weight_bytes": (c_int, [c_int, c_int64, c_int64, P(c_size_t), P(c_size_t)]),
    "mg_quantize_mxfp8_weights": (c_int, [c_int, c_void_p, c_int, c_int64, c_int64, c_void_p, c_void_p, c_void_p,
                                          c_void_p, c_void_p]),
    "mg_dequantize_mxfp8_weights": (c_int, [c_int, c_int64, c_int64, c_void_p, c_void_p, c_void_p, c_void_p,
                                            c_void_p, c_void_p, c_void_p]),
    "mg_mxfp8_tiled_scale_bytes": (c_int, [c_int, c_int64, c_int64, P(c_size_t)]),
    "mg_tile_mxfp8_weight_scales": (c_int, [c_int, c_int64, c_int64, c_void_p, c_void_p, c_void_p, c_void_p,
                                            c_void_p, c_void_p, c_void_p]),
    "mg_grouped_linear_options_init": (None, [P(GroupedLinearOptions)]),
    "mg_grouped_linear_options_init_sized": (c_int, [P(GroupedLinearOptions), c_size_t]),
    "mg_grouped_linear_workspace_bytes": (c_int, [P(GroupedLinearOptions), P(c_size_t)]),
    "mg_grouped_linear_create": (c_int, [P(GroupedLinearOptions), c_void_p, P(_h)]),
    "mg_grouped_linear_destroy": (None, [_h]),
    "mg_grouped_linear_forward": (c_int, [_h, P(ForwardArgs), c_int, c_void_p]),
    "mg_grouped_linear_backward": (c_int, [_h, P(BackwardArgs), c_int, c_void_p]),
    "mg_grouped_linear_backward_dw": (c_int, [_h, c_void_p]),
    "mg_grouped_linear_weights_changed": (c_int, [_h, c_void_p, c_void_p]),
    "mg_grouped_linear_check_device_errors": (c_int, [_h, c_void_p]),
    "mg_nccl_unique_id": (c_int, [ctypes.c_char_p, c_size_t]),
    "mg_ep_comm_create_nccl": (c_int, [c_int, c_int, ctypes.c_char_p, P(_h)]),
    "mg_ep_comm_create_from_environment": (c_int, [P(_h)]),
    "mg_ep_comm_wrap_nccl": (c_int, [c_void_p, P(_h)]),
    "mg_ep_comm_split": (c_int, [_h, c_int, c_int, P(_h)]),
    "mg_ep_emulated_group_create": (c_int, [c_int, P(_h)]),
    "mg_ep_comm_destroy": (None, [_h]),
    "mg_ep_comm_rank": (c_int, [_h, P(c_int)]),
    "mg_ep_comm_ranks": (c_int, [_h, P(c_int)]),
    "mg_ep_comm_wait": (c_int, [_h, c_void_p, c_int64, P(c_int)]),
    "mg_ep_comm_abort": (c_int, [_h]),
    "mg_shard_rows": (c_int, [c_int, c_int64, c_int, c_int, P(c_int64), P(c_int64)]),
    "mg_moe_layer_options_init": (None, [P(MoeLayerOptions)]),
    "mg_moe_layer_options_init_sized": (c_int, [P(MoeLayerOptions), c_size_t]),
    "mg_moe_layer_workspace_bytes": (c_int, [P(MoeLayerOptions), P(c_size_t)]),
    "mg_moe_layer_window_bytes": (c_int, [P(MoeLayerOptions), P(c_size_t)]),
    "mg_moe_layer_create": (c_int, [P(MoeLayerOptions), P(MoeLayerWeights), c_void_p, P(_h)]),
    "mg_moe_layer_create_ep": (c_int, [P(MoeLayerOptions), P(MoeLayerWeights), c_void_p, _h, P(_h)]),
    "mg_moe_layer_destroy": (None, [_h]),
    "mg_moe_layer_forward": (c_int, [_h, P(MoeLayerIO), c_int, c_void_p]),
    "mg_moe_layer_backward": (c_int, [_h, P(MoeLayerIO), c_void_p]),
    "mg_moe_layer_backward_dw": (c_int, [_h, c_void_p]),
    "mg_moe_layer_weights_changed": (c_int, [_h, c_void_p]),
    "mg_moe_layer_set_weights": (c_int, [_h, P(MoeLayerWeights)]),
    "mg_moe_layer_read_dropped": (c_int, [_h, c_void_p, P(ctypes.c_uint64)]),
    "mg_moe_layer_check_device_errors": (c_int, [_h, c_void_p]),
    "mg_config_load": (c_int, [ctypes.c_char_p, P(_h)]),
    "mg_config_parse": (c_int, [ctypes.c_char_p, P(_h)]),
    "mg_config_default": (c_int, [P(_h)]),
    "mg_config_destroy": (None, [_h]),
    "mg_config_shape_of": (c_int, [_h, P(ConfigShape)]),
    "mg_config_set_training": (c_int, [_h, c_int]),
    "mg_step_graphs_create": (c_int, [_h, P(StepWeights), P(StepGraphsOptions), P(_h)]),
    "mg_step_graphs_destroy": (None, [_h]),
    "mg_step_graphs_num_buckets": (c_int, [_h, P(c_int)]),
    "mg_step_graphs_bucket_tokens": (c_int, [_h, c_int, P(c_int64)]),
    "mg_step_graphs_bucket_for": (c_int, [_h, c_int64, P(c_int)]),
    "mg_step_graphs_io": (c_int, [_h, c_int, P(BucketIO)]),
    "mg_step_graphs_replay": (c_int, [_h, c_int, c_int, c_void_p]),
    "mg_step_graphs_run_eager": (c_int, [_h, c_int, c_int, c_void_p]),
    "mg_step_graphs_weights_changed": (c_int, [_h, c_void_p]),
    "mg_step_graphs_check_device_errors": (c_int, [_h, c_void_p]),
    "mg_step_graphs_read_dropped": (c_int, [_h, c_void_p, P(ctypes.c_uint64)]),
}


def library_path():
    """Where the library is taken from (see the module docstring), or None when nothing names one."""
    env = os.environ.get("MOEGRAPH_LIBRARY")
    if env:
        return env
    try:
        libdir = subprocess.run(["pkg-config", "--variable=libdir", "moegraph"], capture_output=True, text=True,
                                check=True).stdout.strip()
        candidate = pathlib.Path(libdir) / f"libmoegraph.so.{ABI_MAJOR}"
        if candidate.exists():
            return str(candidate)
    except (OSError, subprocess.CalledProcessError):
        pass
    return ctypes.util.find_library("moegraph")


_lib = None


def lib():
    """The loaded library with every signature declared (loaded on first use)."""
    global _lib
    if _lib is None:
        path = library_path()
        if path is None:
            raise OSError("libmoegraph not found: set MOEGRAPH_LIBRARY to its path, or install moegraph "
                          "where pkg-config finds moegraph.pc")
        handle = ctypes.CDLL(path)
        # The version first (every release has mg_version): a library without a newer symbol then
        # reads as the wrong version, not as a missing attribute.
        handle.mg_version.restype, handle.mg_version.argtypes = ctypes.c_int, []
        major = handle.mg_version() // 10000
        if major != ABI_MAJOR:
            raise OSError(f"{path} is moegraph {handle.mg_version()}, these bindings need major version {ABI_MAJOR}")
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(handle, name, None)
            if fn is None:
                raise OSError(f"{path} (moegraph {handle.mg_version()}) lacks {name}: these bindings need a library "
                              f"at least as new as themselves")
            fn.restype, fn.argtypes = restype, argtypes
        _lib = handle
    return _lib


def call(name, *args):
    """Calls a status-returning function; raises MoegraphError with the library's message on failure."""
    status = getattr(lib(), name)(*args)
    if status != 0:
        raise MoegraphError(status, lib().mg_last_error().decode(errors="replace"))


def version():
    v = lib().mg_version()
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
