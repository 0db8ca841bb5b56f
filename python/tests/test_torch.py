"""GPU tests of moegraph.torch against PyTorch references in float64: every output and gradient,
eager, under torch.cuda.graph and under torch.compile(fullgraph=True). Skipped without PyTorch or
a GPU."""
import os
import pathlib
import subprocess
import sys
import unittest

try:
    import torch
    HAVE_TORCH, HAVE_GPU = True, torch.cuda.is_available()
except ImportError:
    HAVE_TORCH = HAVE_GPU = False

if HAVE_TORCH:
    from moegraph import MoegraphError
    from moegraph.torch import GroupedLinear, MoELayer

TOL = 2e-2  # relative Frobenius error of bf16 results against float64


def rel_err(got, want):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def linear_reference(x, splits, w, b, dy):
    """y, dx, dw, db of per-group linear layers in float64."""
    x, w, dy = x.double(), w.double(), dy.double()
    y, dx, dw = torch.zeros_like(dy), torch.zeros_like(x), torch.zeros_like(w)
    db = torch.zeros(w.shape[:2], dtype=torch.float64, device=x.device)
    start = 0
    for e, n in enumerate(splits.tolist()):
        rows = slice(start, start + n)
        y[rows] = x[rows] @ w[e].t() + (b[e].double() if b is not None else 0)
        dx[rows] = dy[rows] @ w[e]
        dw[e] = dy[rows].t() @ x[rows]
        db[e] = dy[rows].sum(0)
        start += n
    return y, dx, dw, db


def moe_reference(x, router, w1, b1, w2, b2, dy, top_k, renormalize, aux_coef):
    """y, aux and gradients (x, router, w1, b1, w2, b2) of the softmax top-k SwiGLU MoE layer, float64."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, router, w1, b1, w2, b2)]
    x, router, w1, b1, w2, b2 = leaves
    n, E, F = x.shape[0], router.shape[0], w2.shape[2]
    scores = torch.softmax(x @ router.t(), dim=-1)
    top, ids = torch.topk(scores, top_k, dim=-1)
    weights = top / top.sum(-1, keepdim=True) if renormalize else top
    y = torch.zeros_like(x)
    for e in range(E):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ w1[e].t() + (b1[e] if b1 is not None else 0)
        out = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ w2[e].t() + (b2[e] if b2 is not None else 0)
        y = y.index_add(0, tok, weights[tok, slot].unsqueeze(1) * out)
    counts = torch.bincount(ids.reshape(-1), minlength=E).double()
    aux = aux_coef * E / (top_k * n * n) * (counts * scores.sum(0)).sum()
    loss = (y * dy.double()).sum() + (aux if aux_coef > 0 else 0)
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(loss, present))
    return y.detach(), aux.detach(), [next(grads) if t is not None else None for t in leaves]


def untied_tokens(n, hidden, router, top_k, generator):
    """Random tokens whose k-th and (k+1)-th router scores are apart, so bf16 rounding cannot flip
    the choice of experts between the layer and the reference."""
    x = torch.randn(n, hidden, generator=generator, device="cuda").bfloat16()
    for _ in range(100):
        s = torch.softmax(x.double() @ router.double().t(), -1).sort(-1, descending=True).values
        close = (s[:, top_k - 1] - s[:, top_k]) < 2e-3
        if not bool(close.any()):
            return x
        x[close] = torch.randn(int(close.sum()), hidden, generator=generator, device="cuda").bfloat16()
    raise AssertionError("could not draw untied tokens")


@unittest.skipUnless(HAVE_TORCH, "needs PyTorch")
class ChecksBeforeTheLibraryTest(unittest.TestCase):
    """What the modules decide before any C call, on CPU tensors (no GPU needed)."""

    def test_parameters_the_layer_cannot_read_are_refused(self):
        # Read and written through their addresses: each must be what the module was built for.
        layer = GroupedLinear(5, 128, 64, bias=True, main_grad=True, device="cpu")
        x = torch.randn(40, 128).bfloat16()
        splits = torch.tensor([10, 0, 20, 5, 5], dtype=torch.int32)
        good = layer.weight.main_grad
        for bad, reason in ((good.bfloat16(), "weight.main_grad must be"),  # fp32 writes would overrun it
                            (good[:4], "weight.main_grad must be"),
                            (good.transpose(1, 2).contiguous().transpose(1, 2), "contiguous")):
            layer.weight.main_grad = bad
            with self.assertRaisesRegex(ValueError, reason):
                layer(x, splits)
        layer.weight.main_grad = good
        with torch.no_grad():
            layer.weight.data = layer.weight.data.transpose(1, 2).contiguous().transpose(1, 2)
        with self.assertRaisesRegex(ValueError, "weight must be contiguous"):
            layer(x, splits)
        layer.weight.data = layer.weight.data.contiguous()
        layer.half()  # now fp16 parameters: the C operators were built for bf16
        with self.assertRaisesRegex(ValueError, r"weight must be \[5, 64, 128\] torch.bfloat16"):
            layer(x, splits)

        moe = MoELayer(8, 256, 128, top_k=2, max_tokens=64, bias=True, main_grad=True, device="cpu")
        xm = torch.randn(10, 256).bfloat16()
        good = moe.w1.main_grad
        moe.w1.main_grad = good.bfloat16()
        with self.assertRaisesRegex(ValueError, "w1.main_grad must be"):
            moe(xm)
        moe.w1.main_grad = good
        moe.half()
        with self.assertRaisesRegex(ValueError, "router must be"):
            moe(xm)

    def test_copies_get_their_own_handles(self):
        # A deep copy, a pickle or torch.save of a module: new handles, main_grad carried, and the copy
        # outlives the original (they used to share one handle id, freed with whichever went first).
        import copy
        import gc
        import io
        import pickle
        from moegraph.torch import _handles
        a = GroupedLinear(5, 128, 64, bias=True, main_grad=True, device="cpu")
        a.weight.main_grad.fill_(3.0)
        m = MoELayer(8, 256, 128, top_k=2, max_tokens=64, main_grad=True, device="cpu")
        buf = io.BytesIO()
        torch.save(a, buf)
        buf.seek(0)
        copies = [copy.deepcopy(a), torch.load(buf, weights_only=False), pickle.loads(pickle.dumps(m))]
        for original, c in zip((a, a, m), copies):
            self.assertNotEqual(c._id, original._id)
            self.assertIsNot(_handles[c._id], _handles[original._id])
        self.assertEqual(_handles[copies[2]._id].options.max_tokens, 64)
        for c in copies[:2]:
            self.assertIsNot(c.weight.main_grad, a.weight.main_grad)
            self.assertTrue(torch.equal(c.weight.main_grad, a.weight.main_grad))
        self.assertEqual(tuple(copies[2].w1.main_grad.shape), (8, 256, 256))
        ids = [c._id for c in copies]
        del a, m
        gc.collect()
        self.assertTrue(all(i in _handles for i in ids))

    def test_pending_forwards_keep_their_tickets(self):
        # By address alone, a dropped forward's freed ticket could be reallocated to a later forward's,
        # whose backward would then pass as the oldest and take the dropped forward's saved context.
        import weakref
        from moegraph.torch import _Pending
        pending = _Pending()
        ticket = torch.empty(1, dtype=torch.int32)
        alive = weakref.ref(ticket)
        pending.push(ticket)
        del ticket
        self.assertIsNotNone(alive(), "a pending ticket stays allocated, so no later ticket gets its address")
        with self.assertRaisesRegex(RuntimeError, "not the oldest pending"):
            pending.check(torch.empty(1, dtype=torch.int32), "GroupedLinear")
        pending.pop()
        self.assertIsNone(alive())

    def test_plain_errors(self):
        from moegraph.torch import _handles_of
        with self.assertRaisesRegex(ValueError, "score must be one of"):
            MoELayer(8, 256, 128, score="relu", device="cpu")
        with self.assertRaisesRegex(RuntimeError, "was deleted"):  # a backward after its module was deleted
            _handles_of(-1)
        layer = GroupedLinear(5, 128, 64, main_grad=True, delay_wgrad=True, device="cpu")
        with self.assertRaisesRegex(RuntimeError, "backward_dw without a queued weight gradient"):
            layer.backward_dw()  # it used to ask for one row count instead
        del layer.weight.main_grad
        with self.assertRaisesRegex(ValueError, "needs weight.main_grad"):
            layer(torch.randn(40, 128).bfloat16(), torch.tensor([10, 0, 20, 5, 5], dtype=torch.int32))

    def test_no_rows(self):
        # GroupedLinear of no rows: an empty output, an empty dx and zero weight and bias gradients
        # (with main_grad, weight.grad stays None), without the library.
        for main_grad in (False, True):
            layer = GroupedLinear(5, 128, 64, bias=True, main_grad=main_grad, device="cpu")
            x = torch.zeros(0, 128, dtype=torch.bfloat16, requires_grad=True)
            y = layer(x, torch.zeros(5, dtype=torch.int32))
            self.assertEqual((tuple(y.shape), y.dtype), ((0, 64), torch.bfloat16))
            y.backward(torch.zeros_like(y))
            self.assertEqual(tuple(x.grad.shape), (0, 128))
            self.assertEqual(float(layer.bias.grad.abs().sum()), 0.0)
            if main_grad:
                self.assertIsNone(layer.weight.grad)
                self.assertEqual(float(layer.weight.main_grad.abs().sum()), 0.0)
            else:
                self.assertEqual(float(layer.weight.grad.abs().sum()), 0.0)


@unittest.skipUnless(HAVE_GPU, "needs PyTorch and a GPU")
class GroupedLinearTest(unittest.TestCase):
    def setUp(self):
        self.g = torch.Generator(device="cuda").manual_seed(1)
        self.splits = torch.tensor([37, 0, 64, 5, 150], dtype=torch.int32, device="cuda")

    def inputs(self, layer):
        rows = int(self.splits.sum())
        x = torch.randn(rows, layer.weight.shape[2], generator=self.g, device="cuda").bfloat16().requires_grad_()
        dy = torch.randn(rows, layer.weight.shape[1], generator=self.g, device="cuda").bfloat16()
        return x, dy

    def check(self, layer, x, dy, y, dw):
        b = layer.bias
        ry, rdx, rdw, rdb = linear_reference(x.detach(), self.splits, layer.weight.detach(),
                                             None if b is None else b.detach(), dy)
        self.assertLess(rel_err(y, ry), TOL)
        self.assertLess(rel_err(x.grad, rdx), TOL)
        self.assertLess(rel_err(dw, rdw), TOL)
        if b is not None:
            self.assertLess(rel_err(b.grad, rdb), TOL)

    def test_forward_and_every_gradient(self):
        layer = GroupedLinear(5, 128, 256, bias=True)
        torch.nn.init.uniform_(layer.bias, -0.5, 0.5)
        x, dy = self.inputs(layer)
        y = layer(x, self.splits)
        y.backward(dy)
        self.check(layer, x, dy, y, layer.weight.grad)

    def test_main_grad_with_delayed_wgrad(self):
        layer = GroupedLinear(5, 128, 64, main_grad=True, delay_wgrad=True, wgrad_slots=2)
        x, dy = self.inputs(layer)
        y = layer(x, self.splits)
        y.backward(dy)
        self.assertIsNone(layer.weight.grad)
        self.assertEqual(float(layer.weight.main_grad.abs().sum()), 0.0)  # queued, not yet run
        layer.backward_dw()
        self.check(layer, x, dy, y, layer.weight.main_grad)

    def test_inference_saves_nothing_and_training_forwards_are_counted(self):
        layer = GroupedLinear(5, 128, 64)
        x, _ = self.inputs(layer)
        with torch.no_grad():
            for _ in range(3):  # one slot: a saving forward would be refused the second time
                layer(x, self.splits)
        layer(x, self.splits)
        with self.assertRaises(MoegraphError):
            layer(x, self.splits)  # the first training forward still awaits its backward

    def test_compile_fullgraph(self):
        layer = GroupedLinear(5, 128, 256, bias=True)
        compiled = torch.compile(layer, fullgraph=True)
        x, dy = self.inputs(layer)
        y = compiled(x, self.splits)
        y.backward(dy)
        self.check(layer, x, dy, y, layer.weight.grad)

    def test_inputs_the_layer_cannot_read_are_refused(self):
        layer = GroupedLinear(5, 128, 64)
        x, _ = self.inputs(layer)
        for bad_x, bad_splits in ((x[:, :64], self.splits), (x.float(), self.splits), (x.unsqueeze(0), self.splits),
                                  (x, self.splits.long()), (x, self.splits[:4]), (x, self.splits.cpu())):
            with self.assertRaises(ValueError):
                layer(bad_x, bad_splits)
        y = layer(x.t().contiguous().t(), self.splits)  # a column-major view: made contiguous, not misread
        self.assertLess(rel_err(y, linear_reference(x.detach(), self.splits, layer.weight.detach(), None, y)[0]), TOL)

    def test_invalid_splits_are_reported(self):
        layer = GroupedLinear(5, 128, 64)
        x, _ = self.inputs(layer)
        bad = self.splits.clone()
        bad[0] += 1000  # more rows than x holds: seen on the device only
        with torch.no_grad():
            layer(x, bad)
        with self.assertRaises(MoegraphError):
            layer.check_device_errors()
        layer.check_device_errors()  # the record was taken by the first check

    def test_main_grad_with_two_pending_forwards(self):
        # Two micro-batches in flight (a pipeline schedule), each backward accumulating into main_grad:
        # the first backward's update must not fail the second's saved-tensor check.
        layer = GroupedLinear(5, 128, 64, main_grad=True, wgrad_slots=2)
        (x1, dy1), (x2, dy2) = self.inputs(layer), self.inputs(layer)
        y1, y2 = layer(x1, self.splits), layer(x2, self.splits)
        y1.backward(dy1)
        y2.backward(dy2)
        w = layer.weight.detach()
        want = sum(linear_reference(x.detach(), self.splits, w, None, dy)[2] for x, dy in ((x1, dy1), (x2, dy2)))
        self.assertLess(rel_err(layer.weight.main_grad, want), TOL)

    def test_backward_out_of_forward_order_is_refused(self):
        layer = GroupedLinear(5, 128, 64, wgrad_slots=2)
        (x1, dy1), (x2, dy2) = self.inputs(layer), self.inputs(layer)
        y1, y2 = layer(x1, self.splits), layer(x2, self.splits)
        with self.assertRaisesRegex(RuntimeError, "not the oldest pending"):
            y2.backward(dy2, retain_graph=True)
        y1.backward(dy1)
        y2.backward(dy2)
        for x, dy in ((x1, dy1), (x2, dy2)):  # each backward paired with its own forward
            self.assertLess(rel_err(x.grad, linear_reference(x.detach(), self.splits, layer.weight.detach(), None,
                                                             dy)[1]), TOL)


@unittest.skipUnless(HAVE_GPU, "needs PyTorch and a GPU")
class MoELayerTest(unittest.TestCase):
    E, H, F, K, N = 8, 256, 128, 2, 200

    def make(self, **kw):
        torch.manual_seed(3)
        layer = MoELayer(self.E, self.H, self.F, top_k=self.K, max_tokens=256, bias=True, aux_loss_coef=0.01, **kw)
        with torch.no_grad():
            layer.b1.uniform_(-0.1, 0.1), layer.b2.uniform_(-0.1, 0.1)
        g = torch.Generator(device="cuda").manual_seed(5)
        x = untied_tokens(self.N, self.H, layer.router.detach(), self.K, g).requires_grad_()
        dy = torch.randn(self.N, self.H, generator=g, device="cuda").bfloat16()
        return layer, x, dy

    def check(self, layer, x, dy, y, aux, grads):
        ref_y, ref_aux, ref = moe_reference(x, layer.router, layer.w1, layer.b1, layer.w2, layer.b2, dy, self.K,
                                            True, 0.01)
        self.assertLess(rel_err(y, ref_y), TOL)
        self.assertLess(abs(float(aux) - float(ref_aux)) / float(ref_aux), 1e-3)
        for name, got, want in zip(("dx", "d_router", "dw1", "db1", "dw2", "db2"), grads, ref):
            self.assertLess(rel_err(got, want), TOL, name)

    def grads(self, layer, x):
        return [x.grad, layer.router.grad, layer.w1.grad, layer.b1.grad, layer.w2.grad, layer.b2.grad]

    def test_forward_and_every_gradient(self):
        layer, x, dy = self.make()
        y, aux = layer(x)
        y.backward(dy)
        self.check(layer, x, dy, y, aux, self.grads(layer, x))

    def test_main_grad(self):
        layer, x, dy = self.make(main_grad=True)
        y, aux = layer(x)
        y.backward(dy)
        self.assertIsNone(layer.w1.grad)
        g = [x.grad, layer.router.main_grad, layer.w1.main_grad, layer.b1.grad, layer.w2.main_grad, layer.b2.grad]
        self.check(layer, x, dy, y, aux, g)

    def test_cuda_graph_replays_new_inputs(self):
        layer, x, dy = self.make()
        static_x, static_dy = x.detach().clone().requires_grad_(), dy.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: creates the layer's handle outside capture
            for _ in range(2):
                y, _ = layer(static_x)
                y.backward(static_dy)
        torch.cuda.current_stream().wait_stream(side)
        for p in [static_x, *layer.parameters()]:
            p.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y, static_aux = layer(static_x)
            static_y.backward(static_dy)
        g = torch.Generator(device="cuda").manual_seed(9)
        for _ in range(2):  # new tokens each replay
            fresh = untied_tokens(self.N, self.H, layer.router.detach(), self.K, g)
            with torch.no_grad():
                static_x.copy_(fresh)
            graph.replay()
            torch.cuda.synchronize()
            self.check(layer, static_x, static_dy, static_y, static_aux, self.grads(layer, static_x))

    def test_compile_fullgraph(self):
        layer, x, dy = self.make()
        compiled = torch.compile(layer, fullgraph=True)
        y, aux = compiled(x)
        y.backward(dy)
        self.check(layer, x, dy, y, aux, self.grads(layer, x))

    def test_too_many_tokens_is_refused(self):
        layer, _, _ = self.make()
        with self.assertRaises(ValueError):
            layer(torch.zeros(257, self.H, dtype=torch.bfloat16, device="cuda"))

    def test_tokens_the_layer_cannot_read_are_refused(self):
        layer, x, _ = self.make()
        for bad in (x[:, :128], x.float(), x.unsqueeze(0), x.detach().cpu()):
            with self.assertRaises(ValueError):
                layer(bad)

    def test_main_grad_with_two_pending_forwards(self):
        layer, x1, dy1 = self.make(main_grad=True, wgrad_slots=2)
        g = torch.Generator(device="cuda").manual_seed(6)
        x2 = untied_tokens(self.N - 50, self.H, layer.router.detach(), self.K, g).requires_grad_()
        dy2 = torch.randn(self.N - 50, self.H, generator=g, device="cuda").bfloat16()
        (y1, _), (y2, _) = layer(x1), layer(x2)
        y1.backward(dy1)
        y2.backward(dy2)
        refs = [moe_reference(x, layer.router, layer.w1, layer.b1, layer.w2, layer.b2, dy, self.K, True, 0.01)[2]
                for x, dy in ((x1, dy1), (x2, dy2))]
        for name, got, i in (("router", layer.router.main_grad, 1), ("w1", layer.w1.main_grad, 2),
                             ("w2", layer.w2.main_grad, 4)):
            self.assertLess(rel_err(got, refs[0][i] + refs[1][i]), TOL, name)

    def test_no_tokens(self):
        layer, x, _ = self.make()
        x0 = x.detach()[:0].clone().requires_grad_()
        y, aux = layer(x0)
        self.assertEqual(tuple(y.shape), (0, self.H))
        y.backward(torch.zeros_like(y))
        self.assertEqual(tuple(x0.grad.shape), (0, self.H))
        for name, g in zip(("d_router", "dw1", "db1", "dw2", "db2"), self.grads(layer, x0)[1:]):
            self.assertTrue(bool(torch.isfinite(g).all()) and float(g.abs().max()) == 0.0, name)

    def test_backward_out_of_forward_order_is_refused(self):
        layer, x1, dy1 = self.make(wgrad_slots=2)
        g = torch.Generator(device="cuda").manual_seed(6)
        x2 = untied_tokens(self.N - 50, self.H, layer.router.detach(), self.K, g).requires_grad_()
        dy2 = torch.randn(self.N - 50, self.H, generator=g, device="cuda").bfloat16()
        (y1, _), (y2, _) = layer(x1), layer(x2)
        with self.assertRaisesRegex(RuntimeError, "not the oldest pending"):
            y2.backward(dy2, retain_graph=True)
        y1.backward(dy1)
        y2.backward(dy2)
        for x, dy in ((x1, dy1), (x2, dy2)):  # each backward paired with its own forward
            _, _, ref = moe_reference(x, layer.router, layer.w1, layer.b1, layer.w2, layer.b2, dy, self.K, True, 0.01)
            self.assertLess(rel_err(x.grad, ref[0]), TOL)


@unittest.skipUnless(HAVE_GPU, "needs PyTorch and a GPU")
class WithoutTheCachingAllocator(unittest.TestCase):
    """Every tensor the modules hand the library must outlive the call that reads it. PyTorch's caching
    allocator keeps freed memory mapped, which hides a pointer to a dropped temporary; without it
    (PYTORCH_NO_CUDA_MEMORY_CACHING=1) each tensor is freed when it is dropped, so such a pointer
    fails. Runs the eager tests of both modules that way in a fresh process."""

    def test_eager_modules(self):
        here = pathlib.Path(__file__).resolve().parent
        env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1",
                   PYTHONPATH=os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")]))
        tests = [f"test_torch.{case}" for case in ("GroupedLinearTest.test_forward_and_every_gradient",
                                                    "GroupedLinearTest.test_main_grad_with_delayed_wgrad",
                                                    "MoELayerTest.test_forward_and_every_gradient",
                                                    "MoELayerTest.test_main_grad")]
        run = subprocess.run([sys.executable, "-m", "unittest", *tests], cwd=here, env=env, capture_output=True,
                             text=True, timeout=600)
        self.assertEqual(run.returncode, 0, run.stderr[-4000:])
        self.assertIn(f"Ran {len(tests)} tests", run.stderr)


if __name__ == "__main__":
    unittest.main()
