"""moegraph: Mixture-of-Experts operators for NVIDIA Hopper whose per-expert row counts live on the
GPU, so whole MoE steps are captured into CUDA graphs. This package calls the library's C ABI:
`moegraph.Config` here needs only the library; `moegraph.torch` (GroupedLinear, MoELayer) needs PyTorch."""
import ctypes

from ._lib import MoegraphError, library_path, version
from . import _lib

__all__ = ["Config", "MoegraphError", "library_path", "shard_rows", "version"]


def shard_rows(global_rows, ranks, rank, policy="chunk"):
    """(first_row, rows) of `rank`'s shard of a tensor of `global_rows` rows split over `ranks`:
    "chunk" gives ceil(R / W) rows per rank in rank order, the last ranks fewer or none (torch.chunk,
    FSDP2's Shard(0)); "balanced" gives the first R mod W ranks one row more (docs/sharding.md)."""
    if policy not in _lib.SHARD_POLICY:
        raise ValueError(f"policy must be one of {sorted(_lib.SHARD_POLICY)}, got {policy!r}")
    first, rows = ctypes.c_int64(), ctypes.c_int64()
    _lib.call("mg_shard_rows", _lib.SHARD_POLICY[policy], global_rows, ranks, rank, ctypes.byref(first),
              ctypes.byref(rows))
    return first.value, rows.value


class Config:
    """A parsed, validated JSON config (docs/config.md): Config.load(path), Config.parse(text), Config.default()."""

    def __init__(self, handle):
        self._handle = ctypes.c_void_p(handle)

    @classmethod
    def load(cls, path):
        out = ctypes.c_void_p()
        _lib.call("mg_config_load", str(path).encode(), ctypes.byref(out))
        return cls(out.value)

    @classmethod
    def parse(cls, text):
        out = ctypes.c_void_p()
        _lib.call("mg_config_parse", text.encode(), ctypes.byref(out))
        return cls(out.value)

    @classmethod
    def default(cls):
        out = ctypes.c_void_p()
        _lib.call("mg_config_default", ctypes.byref(out))
        return cls(out.value)

    def shape(self):
        """The layer's shape and training fields (mg_config_shape) as a dict."""
        s = _lib.ConfigShape()
        _lib.call("mg_config_shape_of", self._handle, ctypes.byref(s))
        return {name: getattr(s, name) for name, _ in _lib.ConfigShape._fields_ if name != "struct_size"}

    # A copy would share the C handle, and the first of the two destroyed would free it under the
    # other (or under a Config later given the same address): load or parse the config again instead.
    def __copy__(self):
        raise TypeError("a moegraph.Config owns a C handle and cannot be copied: load or parse the config again")

    def __deepcopy__(self, memo):
        return self.__copy__()

    def __reduce__(self):
        raise TypeError("a moegraph.Config owns a C handle and cannot be pickled: save the JSON text instead")

    def __del__(self):
        if getattr(self, "_handle", None) and _lib._lib is not None:
            _lib.lib().mg_config_destroy(self._handle)
            self._handle = None
