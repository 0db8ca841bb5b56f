"""Pure-Python tests (no GPU, no PyTorch): the ctypes bindings against the header, and the library
calls that need no device. Without the library (MOEGRAPH_LIBRARY unset and nothing installed) the
library tests are skipped; the header comparison always runs."""
import ctypes
import pathlib
import re
import unittest

from moegraph import _lib

HEADER = pathlib.Path(__file__).resolve().parents[2] / "include" / "moegraph" / "moegraph.h"


def header_structs():
    """{name: [field names]} of every `typedef struct { ... } name;` in moegraph.h."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    structs = {}
    for body, name in re.findall(r"typedef struct \{(.*?)\}\s*(\w+);", text, flags=re.S):
        fields = []
        for decl in body.split(";"):
            decl = decl.strip()
            if decl:
                fields.append(re.search(r"(\w+)\s*$", decl).group(1))
        structs[name] = fields
    return structs


def header_functions():
    return set(re.findall(r"MOEGRAPH_API\s[^;(]*?\b(mg_\w+)\s*\(", HEADER.read_text()))


class BindingsMatchTheHeader(unittest.TestCase):
    def test_every_struct_has_the_header_fields_in_order(self):
        structs = header_structs()
        self.assertEqual(set(structs), set(_lib.STRUCTS), "structs bound vs declared")
        for name, cls in _lib.STRUCTS.items():
            self.assertEqual([f for f, _ in cls._fields_], structs[name], name)

    def test_every_function_is_bound(self):
        self.assertEqual(header_functions(), set(_lib.SIGNATURES))


def have_library():
    try:
        _lib.lib()
        return True
    except OSError:
        return False


@unittest.skipUnless(have_library(), "libmoegraph not found (set MOEGRAPH_LIBRARY)")
class LibraryWithoutAGpu(unittest.TestCase):
    def test_version_and_status_strings(self):
        import moegraph
        self.assertRegex(moegraph.version(), r"^\d+\.\d+\.\d+$")
        self.assertEqual(_lib.lib().mg_status_string(8), b"config refused")
        self.assertEqual(_lib.lib().mg_status_string(99), b"unknown status")

    def test_struct_sizes_are_accepted(self):
        o = _lib.GroupedLinearOptions(num_groups=4, in_features=64, out_features=128, capacity_rows=256, row_align=1,
                                      wgrad_slots=1)
        size = ctypes.c_size_t()
        _lib.call("mg_grouped_linear_workspace_bytes", ctypes.byref(o), ctypes.byref(size))
        self.assertGreater(size.value, 0)
        o.struct_size = 8
        with self.assertRaises(_lib.MoegraphError) as e:
            _lib.call("mg_grouped_linear_workspace_bytes", ctypes.byref(o), ctypes.byref(size))
        self.assertEqual(e.exception.status_name, "MG_ERR_INVALID_ARGUMENT")

    def test_expert_parallel_fields_and_calls(self):
        o = _lib.MoeLayerOptions()
        _lib.call("mg_moe_layer_options_init_sized", ctypes.byref(o), ctypes.sizeof(o))
        self.assertEqual((o.struct_size, o.expert_parallel, o.ep_recv_rows), (ctypes.sizeof(o), 1, 0))
        self.assertEqual((o.ep_exchange, o.ep_chunk_rows), (0, 0))  # MG_EP_PEER_STORES, worst-case chunks
        o.experts, o.hidden, o.ffn, o.top_k, o.max_tokens = 8, 256, 256, 2, 64
        size = ctypes.c_size_t()
        _lib.call("mg_moe_layer_window_bytes", ctypes.byref(o), ctypes.byref(size))
        self.assertEqual(size.value, 0)
        o.expert_parallel = 2
        _lib.call("mg_moe_layer_window_bytes", ctypes.byref(o), ctypes.byref(size))
        self.assertGreater(size.value, 0)
        o.ep_exchange, o.ep_chunk_rows = 1, 16  # MG_EP_SEND_RECV, chunks of 16 rows: a smaller window
        chunked = ctypes.c_size_t()
        _lib.call("mg_moe_layer_window_bytes", ctypes.byref(o), ctypes.byref(chunked))
        self.assertGreater(chunked.value, 0)
        self.assertLess(chunked.value, size.value)
        o.ep_exchange, o.ep_chunk_rows = 0, 0
        o.expert_parallel = 3
        with self.assertRaises(_lib.MoegraphError) as e:
            _lib.call("mg_moe_layer_window_bytes", ctypes.byref(o), ctypes.byref(size))
        self.assertIn("expert_parallel", str(e.exception))
        short = ctypes.create_string_buffer(256)
        with self.assertRaises(_lib.MoegraphError) as e:
            _lib.call("mg_nccl_unique_id", short, len(short))
        self.assertEqual(e.exception.status_name, "MG_ERR_INVALID_ARGUMENT")
        import moegraph
        shape = moegraph.Config.parse('{"layer": {"experts": 8, "hidden": 256, "ffn": 256, "top_k": 2}, '
                                      '"parallel": {"expert_parallel": 2}, "buckets": [64]}').shape()
        self.assertEqual(shape["expert_parallel"], 2)

    def test_shard_rows_follow_the_named_policies(self):
        import moegraph
        # 10 rows over 4 ranks: chunk gives 3, 3, 3, 1 (torch.chunk); balanced 3, 3, 2, 2.
        chunk = [moegraph.shard_rows(10, 4, r) for r in range(4)]
        self.assertEqual(chunk, [(0, 3), (3, 3), (6, 3), (9, 1)])
        self.assertEqual([moegraph.shard_rows(10, 4, r, "balanced") for r in range(4)], [(0, 3), (3, 3), (6, 2), (8, 2)])
        # 5 rows over 4 ranks: the last rank holds none, at the end of the tensor.
        self.assertEqual([moegraph.shard_rows(5, 4, r) for r in range(4)], [(0, 2), (2, 2), (4, 1), (5, 0)])
        with self.assertRaises(ValueError):
            moegraph.shard_rows(5, 4, 0, "even")
        with self.assertRaises(_lib.MoegraphError) as e:
            moegraph.shard_rows(5, 4, 4)
        self.assertEqual(e.exception.status_name, "MG_ERR_INVALID_ARGUMENT")

    def test_mxfp8_weight_fields_and_calls(self):
        data, scales = ctypes.c_size_t(), ctypes.c_size_t()
        _lib.call("mg_mxfp8_weight_bytes", 3, 96, 160, ctypes.byref(data), ctypes.byref(scales))
        self.assertEqual((data.value, scales.value), (3 * 96 * 160, 3 * 96 * 160 // 32))
        with self.assertRaises(_lib.MoegraphError) as e:
            _lib.call("mg_mxfp8_weight_bytes", 1, 48, 32, ctypes.byref(data), ctypes.byref(scales))
        self.assertIn("n must be a multiple of 32", str(e.exception))
        self.assertEqual((data.value, scales.value), (0, 0))
        # Refused before any GPU use: no w to read.
        with self.assertRaises(_lib.MoegraphError) as e:
            _lib.call("mg_quantize_mxfp8_weights", _lib.DTYPE["bf16"], None, 1, 32, 32, None, None, None, None, None)
        self.assertEqual(e.exception.status_name, "MG_ERR_INVALID_ARGUMENT")
        self.assertIn("w must be a 16-byte aligned device pointer", str(e.exception))

        # The options' appended field sits where the library reads it: set with the bf16 recipe it
        # is refused by name (a field out of place would be read as another, or as an unknown tail).
        size = ctypes.c_size_t()
        g = _lib.GroupedLinearOptions()
        _lib.call("mg_grouped_linear_options_init_sized", ctypes.byref(g), ctypes.sizeof(g))
        self.assertEqual((g.struct_size, g.prequantized_weights), (ctypes.sizeof(g), 0))
        g.num_groups, g.in_features, g.out_features, g.capacity_rows, g.row_align = 4, 128, 128, 256, 32
        m = _lib.MoeLayerOptions()
        _lib.lib().mg_moe_layer_options_init(ctypes.byref(m))  # the function form: this header's sizeof
        self.assertEqual(m.prequantized_weights, 0)
        m.experts, m.hidden, m.ffn, m.top_k, m.max_tokens, m.row_align = 8, 256, 256, 2, 64, 32
        for options, call in ((g, "mg_grouped_linear_workspace_bytes"), (m, "mg_moe_layer_workspace_bytes")):
            options.prequantized_weights = 1
            with self.assertRaises(_lib.MoegraphError) as e:
                _lib.call(call, ctypes.byref(options), ctypes.byref(size))
            self.assertIn("prequantized_weights needs the mxfp8 recipe", str(e.exception))
            options.recipe = _lib.RECIPE["mxfp8"]
            _lib.call(call, ctypes.byref(options), ctypes.byref(size))
            self.assertGreater(size.value, 0)

        # A config of prequantized weights says so, and its step checks each MXFP8 pointer of
        # StepWeights in order (refused before any device is looked for; the pointers are never read).
        import moegraph
        text = ('{"layer": {"experts": 8, "hidden": 256, "ffn": 256, "top_k": 2}, "row_align": 32, "buckets": [64], '
                '"precision": {"recipe": "mxfp8", "prequantized_weights": true}}')
        config = moegraph.Config.parse(text)
        self.assertEqual(config.shape()["prequantized_weights"], 1)
        self.assertEqual(moegraph.Config.default().shape()["prequantized_weights"], 0)
        fake = ctypes.create_string_buffer(32)
        addr = (ctypes.addressof(fake) + 15) // 16 * 16
        w = _lib.StepWeights(w1_mxfp8_data=addr, w1_mxfp8_scales=addr)
        step = ctypes.c_void_p()
        for field, then_missing in ((None, "w1_mxfp8.data_t and .scales_t"),
                                    ("w1_mxfp8_data_t", "w1_mxfp8.data_t and .scales_t"),
                                    ("w1_mxfp8_scales_t", "w2_mxfp8.data and .scales"),
                                    ("w2_mxfp8_data", "w2_mxfp8.data and .scales"),
                                    ("w2_mxfp8_scales", "w2_mxfp8.data_t and .scales_t"),
                                    ("w2_mxfp8_data_t", "w2_mxfp8.data_t and .scales_t"),
                                    ("w2_mxfp8_scales_t", "the router weight")):
            if field:
                setattr(w, field, addr)
            with self.assertRaises(_lib.MoegraphError) as e:
                _lib.call("mg_step_graphs_create", config._handle, ctypes.byref(w), None, ctypes.byref(step))
            self.assertIn("StepWeights needs " + then_missing, str(e.exception))
            self.assertIsNone(step.value)
        # The tiled scales (optional): each field is where the library reads it, a misaligned one
        # refused by name; the sizes are the C++ API's.
        for field, name in (("w1_mxfp8_scales_tiled", "w1_mxfp8.scales_tiled"),
                            ("w1_mxfp8_scales_t_tiled", "w1_mxfp8.scales_t_tiled"),
                            ("w2_mxfp8_scales_tiled", "w2_mxfp8.scales_tiled"),
                            ("w2_mxfp8_scales_t_tiled", "w2_mxfp8.scales_t_tiled")):
            setattr(w, field, addr + 4)
            with self.assertRaises(_lib.MoegraphError) as e:
                _lib.call("mg_step_graphs_create", config._handle, ctypes.byref(w), None, ctypes.byref(step))
            self.assertIn("StepWeights needs " + name + " 16-byte aligned", str(e.exception))
            setattr(w, field, addr)
        tiled = ctypes.c_size_t()
        _lib.call("mg_mxfp8_tiled_scale_bytes", 3, 96, 160, ctypes.byref(tiled))
        self.assertEqual(tiled.value, 512 * 3 * 1 * 2)
        with self.assertRaises(_lib.MoegraphError) as e:
            _lib.call("mg_tile_mxfp8_weight_scales", 1, 32, 32, None, None, None, None, None, None, None)
        self.assertIn("tile_mxfp8_weight_scales: nothing to write", str(e.exception))

    def test_config_shape_and_errors(self):
        import moegraph
        c = moegraph.Config.parse('{"layer": {"experts": 16, "hidden": 512, "ffn": 256, "top_k": 2}, "buckets": [64]}')
        s = c.shape()
        self.assertEqual((s["experts"], s["hidden"], s["ffn"], s["top_k"], s["max_tokens"]), (16, 512, 256, 2, 64))
        self.assertEqual(moegraph.Config.default().shape()["whole_layer"], 1)
        self.assertEqual((s["shard_ranks"], s["shard_policy"], s["shard_unit"]), (1, 0, 0))
        sharded = moegraph.Config.parse('{"layer": {"experts": 8, "hidden": 256, "ffn": 128}, "buckets": [32], '
                                        '"parallel": {"sharding": {"ranks": 4, "policy": "balanced", "unit": "row"}}}')
        self.assertEqual([sharded.shape()[k] for k in ("shard_ranks", "shard_policy", "shard_unit")], [4, 1, 1])
        with self.assertRaises(moegraph.MoegraphError) as e:
            moegraph.Config.parse('{"layer": {"expertz": 1}}')
        self.assertEqual(e.exception.status_name, "MG_ERR_CONFIG")
        self.assertIn("expertz", str(e.exception))

    def test_a_config_cannot_be_copied(self):
        # A copy shared the C handle; the first of the two destroyed freed it under the other.
        import copy
        import pickle
        import moegraph
        c = moegraph.Config.default()
        for make_copy in (copy.copy, copy.deepcopy, pickle.dumps):
            with self.assertRaisesRegex(TypeError, "owns a C handle"):
                make_copy(c)
        self.assertEqual(c.shape()["whole_layer"], 1)


if __name__ == "__main__":
    unittest.main()
