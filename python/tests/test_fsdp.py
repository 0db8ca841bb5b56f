"""Sharded parameters on W = 2 and 4 ranks (one process each): MoELayer under FSDP2 (fully_shard)
and with DTensor parameters. The experts (5) do not divide by W, and over 4 ranks torch.chunk
leaves the last rank no rows. Every parameter's rows are random, so a gradient row landing on
another rank's or another expert's place fails the comparison.

With W GPUs each rank has its own and the ranks talk through NCCL (NVLink multicast off); with
fewer, the ranks share GPU 0 and talk through gloo. Skipped without PyTorch, torch.distributed or a
GPU."""
import faulthandler
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import unittest

try:
    import torch
    import torch.distributed as dist
    HAVE_GPU = torch.cuda.is_available() and dist.is_available()
except ImportError:
    HAVE_GPU = False

EXPERTS, HIDDEN, FFN, TOP_K = 5, 64, 64, 2
TOL = 1e-2  # relative error of bf16 gradients summed in fp32 in another order, then rounded


def rel_err(got, want):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def make_layer(device):
    from moegraph.torch import MoELayer
    torch.manual_seed(7)
    layer = MoELayer(EXPERTS, HIDDEN, FFN, top_k=TOP_K, max_tokens=64, bias=True, device=device)
    with torch.no_grad():  # non-zero biases, so their gradients identify rows too
        layer.b1.uniform_(-0.5, 0.5)
        layer.b2.uniform_(-0.5, 0.5)
    return layer


def batch(step, rank, device):
    """Rank `rank`'s tokens and output gradient at `step` (each rank a different count)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    n = 24 + 8 * rank
    x = torch.randn(n, HIDDEN, generator=g).bfloat16().to(device)
    dy = torch.randn(n, HIDDEN, generator=g).bfloat16().to(device)
    return x, dy


WORST = [0.0]  # the largest relative error check_rows saw in this process


def check_rows(test, name, got, full, first, rows):
    """got: this rank's gradient rows; full: the unsharded gradient. The rows one expert off must
    not match (the data identifies each row's place), and this rank's rows must."""
    want = full[first:first + rows]
    test.assertEqual(tuple(got.shape), tuple(want.shape), name)
    if rows == 0:
        return
    err = rel_err(got, want)
    WORST[0] = max(WORST[0], err)
    test.assertLess(err, TOL, f"{name}: rows [{first}, {first + rows}) differ from the unsharded gradient")
    other = full[(first + 1) % full.shape[0]:][:rows] if full.shape[0] > 1 else None
    if other is not None and other.shape == want.shape:
        test.assertGreater(rel_err(got, other), 10 * TOL, f"{name}: the data does not tell rows apart")


def summed_gradients(model, ranks, device, step, seen, scale=1.0):
    """{name: gradient} of the sum over ranks of the model's loss on every rank's batch (times
    `scale`): each rank's bf16 gradient summed in fp32, rounded once. seen(output, rank) per rank."""
    acc = {n: torch.zeros(p.shape, dtype=torch.float32, device=device) for n, p in model.named_parameters()}
    for r in range(ranks):
        x, dy = batch(step, r, device)
        out = model(x)
        seen(out, r)
        (out[0] if isinstance(out, tuple) else out).backward(dy)
        for n, p in model.named_parameters():
            acc[n] += p.grad.float()
            p.grad = None
    return {n: (a * scale).to(torch.bfloat16) for n, a in acc.items()}


def dtensor_parameters(rank, ranks, device):
    """A layer whose parameters are Shard(0) DTensors: forward on this rank's batch; each gradient
    is a DTensor of the parameter's mesh and placements holding this rank's rows of the gradient of
    the sum of every rank's loss."""
    import moegraph
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    t = unittest.TestCase()  # its assertions, outside a test run
    mesh = init_device_mesh("cuda", (ranks,))
    ref, layer = make_layer(device), make_layer(device)
    names = ("router", "w1", "b1", "w2", "b2")
    for name in names:
        full = getattr(layer, name).detach()
        first, rows = moegraph.shard_rows(full.shape[0], ranks, rank)
        local = full[first:first + rows].clone()
        setattr(layer, name, torch.nn.Parameter(
            DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())))
    x, dy = batch(0, rank, device)
    y, _ = layer(x)
    y.backward(dy)
    want = summed_gradients(ref, ranks, device, 0, lambda out, r: t.assertTrue(
        r != rank or torch.equal(out[0], y), "the output differs from the unsharded layer's"))
    for name in names:
        p = getattr(layer, name)
        g = p.grad
        t.assertIsInstance(g, DTensor, name)
        t.assertEqual(g.device_mesh, p.device_mesh, name)
        t.assertEqual(tuple(g.placements), tuple(p.placements), name)
        t.assertEqual(g.shape, p.shape, name)
        first, rows = moegraph.shard_rows(p.shape[0], ranks, rank)
        check_rows(t, name, g.to_local(), want[name], first, rows)


def dtensor_grouped_linear(rank, ranks, device):
    """GroupedLinear with Shard(0) DTensor weight and bias (5 groups): as dtensor_parameters, for the
    other module. Each rank sends its own rows through the groups (splits differ per rank)."""
    import moegraph
    from moegraph.torch import GroupedLinear
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    t = unittest.TestCase()  # its assertions, outside a test run
    mesh = init_device_mesh("cuda", (ranks,))

    def make():
        torch.manual_seed(5)
        m = GroupedLinear(EXPERTS, HIDDEN, 2 * HIDDEN, bias=True, device=device)
        with torch.no_grad():
            m.bias.uniform_(-0.5, 0.5)
        return m

    def inputs(r):
        g = torch.Generator().manual_seed(77 + r)
        splits = torch.tensor([3 + r, 0, 7, 1 + 2 * r, 5], dtype=torch.int32)
        n = int(splits.sum())
        x = torch.randn(n, HIDDEN, generator=g).bfloat16().to(device)
        dy = torch.randn(n, 2 * HIDDEN, generator=g).bfloat16().to(device)
        return x, splits.to(device), dy

    ref, layer = make(), make()
    for name in ("weight", "bias"):
        full = getattr(layer, name).detach()
        first, rows = moegraph.shard_rows(full.shape[0], ranks, rank)
        setattr(layer, name, torch.nn.Parameter(DTensor.from_local(
            full[first:first + rows].clone(), mesh, [Shard(0)], run_check=False, shape=full.shape,
            stride=full.stride())))
    x, splits, dy = inputs(rank)
    y = layer(x, splits)
    y.backward(dy)
    acc = {n: torch.zeros(p.shape, dtype=torch.float32, device=device) for n, p in ref.named_parameters()}
    for r in range(ranks):
        xr, sr, dyr = inputs(r)
        yr = ref(xr, sr)
        yr.backward(dyr)
        if r == rank:
            t.assertTrue(torch.equal(yr, y), "the output differs from the unsharded module's")
        for n, p in ref.named_parameters():
            acc[n] += p.grad.float()
            p.grad = None
    for name in ("weight", "bias"):
        p = getattr(layer, name)
        t.assertIsInstance(p.grad, DTensor, name)
        t.assertEqual(tuple(p.grad.placements), tuple(p.placements), name)
        first, rows = moegraph.shard_rows(p.shape[0], ranks, rank)
        check_rows(t, name, p.grad.to_local(), acc[name].bfloat16(), first, rows)


class Net(torch.nn.Module if HAVE_GPU else object):
    def __init__(self, device):
        super().__init__()
        torch.manual_seed(3)
        self.pre = torch.nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=torch.bfloat16, device=device)
        self.moe = make_layer(device)

    def forward(self, x):
        return self.moe(self.pre(x))[0]


def fsdp_training_loop(rank, ranks, device):
    """fully_shard on a model holding a MoELayer: three SGD steps on each rank's batch match the
    unsharded model stepped on the mean of every rank's loss (FSDP2 averages gradients); the first
    step's gradients are each rank's rows of the unsharded ones. FSDP2 frees the gathered parameters
    after forward and gathers them again, elsewhere, for backward."""
    import moegraph
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor
    t = unittest.TestCase()  # its assertions, outside a test run
    model, ref = Net(device), Net(device)
    ref.load_state_dict(model.state_dict())
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    # Gradients reduced in fp32 and rounded once, as the reference sums them.
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    fully_shard(model.moe, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(3):
        x, dy = batch(step, rank, device)
        y = model(x)
        y.backward(dy)
        want = summed_gradients(ref, ranks, device, step, lambda out, r: t.assertTrue(
            step > 0 or r != rank or torch.equal(out, y), "the first step's output differs from the unsharded one"),
            scale=1.0 / ranks)
        for name, p in model.named_parameters():
            if step == 0:
                t.assertIsInstance(p.grad, DTensor, name)
                t.assertEqual(tuple(p.grad.placements), tuple(p.placements), name)
                first, rows = moegraph.shard_rows(p.shape[0], ranks, rank)
                check_rows(t, name, p.grad.to_local(), want[name], first, rows)
            ref.get_parameter(name).grad = want[name]
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    for name, p in model.named_parameters():
        want = ref.get_parameter(name).detach()
        first, rows = moegraph.shard_rows(p.shape[0], ranks, rank)
        check_rows(t, name, p.to_local(), want, first, rows)
        moved = rel_err(want, start[name])
        t.assertGreater(moved, 10 * rel_err(p.to_local(), want[first:first + rows]) if rows else 0, name)


def _rank_main(test, rank, ranks, port, errors):
    # A rank still running shortly before the harness stops it prints where it waits.
    faulthandler.dump_traceback_later(max(1, RANK_LIMIT_S - 10), exit=False)
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
        if not HAVE_GPU:
            raise RuntimeError("a rank process found no GPU or no torch.distributed")
        gpus = torch.cuda.device_count()
        device = torch.device("cuda", rank if gpus >= ranks else 0)
        torch.cuda.set_device(device)
        nccl = gpus >= ranks
        dist.init_process_group("nccl" if nccl else "cuda:gloo,cpu:gloo", rank=rank, world_size=ranks,
                                device_id=device if nccl else None)
        try:
            globals()[test](rank, ranks, device)
            print(f"{test} rank {rank}/{ranks} ({'nccl' if nccl else 'gloo'}): largest relative error {WORST[0]:.2e}")
        finally:
            dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(errors, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1)


RANK_LIMIT_S = 120  # a test's ranks together (each test takes 10-20 s); under the suite's limit for the file
PEER_GRACE_S = 20   # after a rank fails, how long the others may take to notice before they are stopped


def run_ranks(test, ranks):
    """test(rank, ranks, device) in `ranks` processes (this file run as a script, so any test runner
    works); fails with every failing rank's traceback. A rank that fails usually leaves its peers
    waiting in a collective: they are stopped PEER_GRACE_S later, and the first failure is printed
    at once; a rank still running near RANK_LIMIT_S prints its Python stacks (faulthandler) before
    it is stopped. So an outer time limit does not swallow what went wrong."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    package = str(pathlib.Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = package + os.pathsep + env.get("PYTHONPATH", "")

    def error_of(errors, r):
        path = os.path.join(errors, f"rank{r}.txt")
        if not os.path.exists(path):
            return ""
        with open(path) as f:
            return f.read()

    with tempfile.TemporaryDirectory() as errors:
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", test, str(r), str(ranks), str(port), errors],
                                  env=env) for r in range(ranks)]
        try:
            codes = wait_for_ranks(test, procs, lambda r: error_of(errors, r))
        finally:  # interrupted, or the harness failed: no rank outlives it on the GPUs
            for p in procs:
                if p.poll() is None:
                    p.kill()
        failed = [f"rank {r} ({code}):\n{error_of(errors, r)}" for r, code in enumerate(codes) if code != 0]
        if failed:
            raise AssertionError(f"{test} on {len(procs)} ranks:\n" + "\n".join(failed))


def wait_for_ranks(test, procs, error_of):
    """Each rank's exit code, or why it was stopped (run_ranks)."""
    ranks = len(procs)
    codes = [None] * ranks
    start, first_failure = time.monotonic(), None
    while None in codes:
        now = time.monotonic()
        for r, p in enumerate(procs):
            if codes[r] is None and p.poll() is not None:
                codes[r] = p.returncode
                if codes[r] != 0 and first_failure is None:
                    first_failure = now
                    print(f"{test} on {ranks} ranks: rank {r} failed ({codes[r]}):\n{error_of(r)}",
                          file=sys.stderr, flush=True)
        stop = None
        if now - start > RANK_LIMIT_S:
            stop = f"no exit in {RANK_LIMIT_S} s"
        elif first_failure is not None and now - first_failure > PEER_GRACE_S:
            stop = f"stopped {PEER_GRACE_S} s after another rank failed"
        if stop is not None:
            for r, p in enumerate(procs):
                if codes[r] is None:
                    p.kill()
                    try:
                        p.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        pass  # stuck in the driver: left to the operating system
                    codes[r] = stop
            break
        time.sleep(0.05)
    return codes


@unittest.skipUnless(HAVE_GPU, "needs PyTorch with torch.distributed and a GPU")
class ShardedParameters(unittest.TestCase):
    def test_dtensor_parameters_on_2_ranks(self):
        run_ranks("dtensor_parameters", 2)

    def test_dtensor_parameters_on_4_ranks_one_holding_no_experts(self):
        run_ranks("dtensor_parameters", 4)

    def test_grouped_linear_dtensor_parameters_on_4_ranks(self):
        run_ranks("dtensor_grouped_linear", 4)

    def test_fsdp2_training_loop_on_2_ranks(self):
        run_ranks("fsdp_training_loop", 2)

    def test_fsdp2_training_loop_on_4_ranks_one_holding_no_experts(self):
        run_ranks("fsdp_training_loop", 4)


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--rank":
        _rank_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        unittest.main()
