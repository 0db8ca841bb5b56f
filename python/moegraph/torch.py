"""PyTorch layers over the C ABI: GroupedLinear and MoELayer as nn.Modules.

Their forward and backward are torch.library custom ops (moegraph::*) with fake implementations
and autograd registered with a separate setup_context, so they run under torch.cuda.graph and
torch.compile(fullgraph=True) without graph breaks. The ops reach their C handle through an integer
id (a constant to the compiler).

Contracts the C layer brings (moegraph/moegraph.h):
- A training forward saves its context inside the handle, in one of `wgrad_slots` slots; backward
  takes the oldest (forward order, as pipeline schedules run them). A backward out of that order
  is refused (RuntimeError): summing the losses of several pending micro-batches and calling one
  backward runs their backwards last-first. With one slot, a second training forward before the
  first one's backward is refused. Inference (torch.no_grad, or no input requiring grad) saves
  nothing; a training forward whose output is dropped without a backward (an evaluation pass run
  with grad enabled) keeps its slot, so evaluate under torch.no_grad().
- GroupedLinear makes one C operator, with its workspace, per distinct row count it is called with:
  feed it a few fixed row counts (pad to buckets), not every batch's own.
- Activation checkpointing: torch.utils.checkpoint with use_reentrant=True works. The non-reentrant
  variant re-runs forward inside backward as a second training forward, which the slot rules
  refuse (and the first forward's slot stays taken): do not checkpoint through these modules that way.
- torch.compile guards on each module's handle id (a constant to the compiler), so every instance
  compiles its own graph: compile the enclosing model once, or raise
  torch._dynamo.config.recompile_limit when compiling more than its default of 8 modules one by one.
- Handles are created (and their device memory set up) on a module's first call for a shape:
  run each shape once before capturing it into a CUDA graph, as torch.cuda.graph's warm-up does.
- main_grad=True: weight gradients accumulate into fp32 `param.main_grad` (their .grad stays None);
  delay_wgrad=True (needs main_grad) queues them until module.backward_dw(). Eagerly, several
  training forwards may be pending with main_grad (wgrad_slots > 1); under
  torch.compile the compiled graph saves main_grad itself, so the second pending forward's backward
  fails autograd's in-place check there (one pending forward at a time works).
- Parameters and main_grad are read and written through their addresses: each must keep the shape
  and dtype the module was built with (fp32 for main_grad), be contiguous and stay on the device of
  the module's first call (ValueError otherwise; .half() or .to(another GPU) needs a new module).
- Sharded parameters (docs/sharding.md): under FSDP2 (fully_shard) the modules see the full
  parameters FSDP2 gathers, wherever it puts them, and FSDP2 reduce-scatters their gradients.
  Parameters that are DTensors when forward runs (Shard(0) over a 1-D mesh, uneven splits and
  ranks holding no rows included) are gathered here, and their gradients come back as DTensors of
  the same mesh and placements holding this rank's rows of the sum over ranks (not with main_grad).
"""
import collections
import ctypes
import itertools
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _lib, shard_rows

__all__ = ["GroupedLinear", "MoELayer"]

_DTYPE = {torch.bfloat16: _lib.DTYPE["bf16"], torch.float16: _lib.DTYPE["fp16"]}
_handles = {}
_ids = itertools.count(1)


def _ptr(t):
    return None if t is None or t.numel() == 0 else t.data_ptr()


def _stream(device):
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def _empty(like):
    return like.new_empty((0,))


def _some_rows(t):
    """t, or for a tensor of no rows one row like it: the library touches no row at or past the
    token count, but refuses null buffers."""
    return t if t.numel() > 0 else t.new_empty((1,) + tuple(t.shape[1:]))


def _ticket(device):
    """A tensor that names one training forward by its address: made inside the forward op and saved
    for its backward (an op's own output, so autograd's partitioner cannot recompute it elsewhere, as
    it may an input). Never read or written on the device."""
    return torch.empty((1,), dtype=torch.int32, device=device)


class _Pending:
    """The training forwards whose backward has not run, oldest first, by their tickets. The library
    pairs every backward with the oldest; autograd may run them in another order (one backward of a
    sum of micro-batch losses runs the last one first), which would pair a backward with another
    micro-batch's saved context. The queue holds the tickets themselves, not their addresses: a
    ticket of a forward whose output was dropped stays allocated while it is pending, so the
    allocator cannot give its address to a later forward's ticket, which would then pass as it."""

    def __init__(self):
        self.queue = collections.deque()

    def push(self, ticket):
        self.queue.append(ticket)

    def check(self, ticket, what):
        if self.queue and self.queue[0].data_ptr() != ticket.data_ptr():
            raise RuntimeError(f"moegraph {what}: this backward is not the oldest pending training forward's "
                               f"({len(self.queue)} pending); the library runs backwards in forward order: call "
                               f"backward on each micro-batch's loss in the order of their forwards")

    def pop(self):
        if self.queue:
            self.queue.popleft()


def _main_grad_of(param, name):
    """param.main_grad, which main_grad=True needs the caller to have set (fp32, the parameter's shape)."""
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None:
        raise ValueError(f"main_grad=True needs {name}.main_grad, an fp32 tensor of the parameter's shape: the module "
                         f"sets it when built, but a parameter replaced since (e.g. by FSDP2) has none")
    return main_grad


def _check_device(t, device, name):
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the module's parameters on {device}")


def _check_read_by_address(t, name, shape, dtype, device):
    """A tensor the C layer reads or writes through its address: the shape and dtype it was built
    for (a module converted by .half() or .float() would be misread, a bf16 main_grad overrun by fp32
    writes), on the parameters' device, and contiguous."""
    if t is None:
        return
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{name} must be {list(shape)} {dtype} (as the module was built), got {list(t.shape)} "
                         f"{t.dtype}")
    _check_device(t, device, name)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous: the layer reads it through its address")


class _OwnsHandles:
    """A module whose C handles live in _handles under its own id. A copy (copy.deepcopy, pickling,
    torch.save of the module) gets a new id and new handles, made on its first call, instead of
    sharing the original's: the two would share their saved micro-batches, and whichever was freed
    first would take the other's handles with it."""

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_id", None)
        # main_grad is an attribute of the parameter, which a copy of the parameter does not carry.
        state["_main_grads"] = {n: p.main_grad for n, p in self._parameters.items() if hasattr(p, "main_grad")}
        return state

    def __setstate__(self, state):
        state = dict(state)
        main_grads = state.pop("_main_grads", {})
        super().__setstate__(state)
        for name, main_grad in main_grads.items():
            self._parameters[name].main_grad = main_grad
        self._id = next(_ids)
        _handles[self._id] = self._new_handles()

    def __del__(self):
        if _handles is not None:  # None once the module is torn down at exit
            _handles.pop(getattr(self, "_id", None), None)


def _handles_of(handle_id):
    """The C handles an op names by its module's id."""
    h = _handles.get(handle_id)
    if h is None:
        raise RuntimeError("moegraph: the module this op belongs to was deleted (its C operators with it): keep a "
                           "module alive until the backward of each of its training forwards has run")
    return h


def _check_same_device(handles, device):
    """The C operators live on the device of the module's first call."""
    if handles.device is None:
        handles.device = device
    elif handles.device != device:
        raise ValueError(f"the module ran on {handles.device} and is now on {device}: its C operators and "
                         f"workspace stay on the first; make a new module on {device}")


# ---------------------------------------------------------------------------------------------------
# DTensor parameters. Under FSDP2 (fully_shard) a module's forward and backward see the full
# parameters, re-gathered by FSDP2 into new storage each time (the C layer is re-bound to them), and
# FSDP2 reduce-scatters the gradients. A module called with its parameters still sharded (outside
# FSDP2's hooks, or made DTensors by hand) gathers them here, and its backward returns each rank's
# rows of the summed gradient as a DTensor with the parameter's own mesh and placements.


def _dtensor_types():
    try:
        from torch.distributed.tensor import DTensor, Shard
        return DTensor, Shard
    except ImportError:  # a PyTorch without torch.distributed
        return None, None


def _shard_geometry(p):
    """(group, ranks, per-rank rows, this rank's first row and rows) of a DTensor sharded on dim 0."""
    DTensor, Shard = _dtensor_types()
    mesh, placements = p.device_mesh, tuple(p.placements)
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(f"moegraph.torch takes DTensor parameters sharded on dim 0 over a 1-D mesh (Shard(0), as "
                         f"FSDP2 shards); got placements {placements} over a {mesh.ndim}-D mesh")
    ranks, rank, rows = mesh.size(), mesh.get_local_rank(), p.shape[0]
    first, mine = shard_rows(rows, ranks, rank, "chunk")
    local = p.to_local()
    if local.shape[0] != mine or tuple(local.shape[1:]) != tuple(p.shape[1:]):
        raise ValueError(f"rank {rank}'s shard of a {tuple(p.shape)} parameter is {tuple(local.shape)}, but Shard(0) "
                         f"over {ranks} ranks gives it rows [{first}, {first + mine}) (torch.chunk's split)")
    per = -(-rows // ranks)
    return mesh.get_group(), ranks, per, first, mine


class _GatherShards(torch.autograd.Function):
    """A Shard(0) DTensor -> the full tensor on every rank (all-gather of equal blocks of
    ceil(R / W) rows, the short ones padded inside the collective's buffer only). Backward sums the
    ranks' full gradients in fp32 and keeps this rank's rows (reduce-scatter), rounded once to the
    parameter's dtype, as a DTensor of its mesh and placements: the gradient of the sum of every
    rank's loss."""

    @staticmethod
    def forward(ctx, p):
        import torch.distributed as dist
        group, ranks, per, first, mine = _shard_geometry(p)
        local = p.to_local()
        send = local if mine == per else torch.cat([local, local.new_zeros((per - mine,) + tuple(p.shape[1:]))])
        gathered = local.new_empty((per * ranks,) + tuple(p.shape[1:]))
        dist.all_gather_into_tensor(gathered, send.contiguous(), group=group)
        ctx.param = (p.device_mesh, p.placements, p.shape, p.stride(), group, ranks, per, mine)
        return gathered[:p.shape[0]]

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        DTensor, _ = _dtensor_types()
        mesh, placements, shape, stride, group, ranks, per, mine = ctx.param
        # Summed in fp32 and rounded once (as FSDP2 with reduce_dtype=torch.float32).
        summed = grad.new_zeros((per * ranks,) + tuple(shape[1:]), dtype=torch.float32)
        summed[:shape[0]].copy_(grad)
        out = summed.new_empty((per,) + tuple(shape[1:]))
        dist.reduce_scatter_tensor(out, summed, group=group)
        local = out[:mine].to(grad.dtype)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _full(p):
    """The full tensor of a parameter: itself, or gathered when it is a DTensor."""
    DTensor, _ = _dtensor_types()
    if p is None or DTensor is None or not isinstance(p, DTensor):
        return p
    return _GatherShards.apply(p)


# ---------------------------------------------------------------------------------------------------
# GroupedLinear: y_e = x_e W_e^T (+ b_e) for G groups of rows; splits [G] int32 on the device.


class _LinearHandles:
    """The C operators of one GroupedLinear module, one per row count (capacity_rows)."""

    def __init__(self, groups, in_features, out_features, bias, dtype, row_align, wgrad_slots, delay_wgrad):
        self.options = dict(num_groups=groups, in_features=in_features, out_features=out_features,
                            row_align=row_align, dtype=_DTYPE[dtype], bias=int(bias), wgrad_slots=wgrad_slots,
                            delay_wgrad=int(delay_wgrad), recipe=_lib.RECIPE["bf16"])
        self.delay_wgrad = delay_wgrad
        self.ops = {}  # rows -> (handle, workspace tensor)
        self.pending = collections.defaultdict(_Pending)  # rows -> training forwards awaiting backward
        self.queued_wgrads = collections.deque()  # delay_wgrad: the row count of each queued wgrad, oldest first
        self.device = None  # of the first call: every handle and workspace lives there

    def op(self, rows, device):
        _check_same_device(self, device)
        if rows not in self.ops:
            o = _lib.GroupedLinearOptions(capacity_rows=rows, **self.options)
            size = ctypes.c_size_t()
            _lib.call("mg_grouped_linear_workspace_bytes", ctypes.byref(o), ctypes.byref(size))
            workspace = torch.empty(max(size.value, 1), dtype=torch.uint8, device=device)  # caching allocator
            handle = ctypes.c_void_p()
            _lib.call("mg_grouped_linear_create", ctypes.byref(o), ctypes.c_void_p(workspace.data_ptr()),
                      ctypes.byref(handle))
            self.destroy = _lib.lib().mg_grouped_linear_destroy
            self.ops[rows] = (handle, workspace)
        return self.ops[rows][0]

    def __del__(self):
        destroy = getattr(self, "destroy", None)  # bound at creation: module globals may be gone at exit
        for handle, _ in getattr(self, "ops", {}).values():
            destroy(handle)


@torch.library.custom_op("moegraph::grouped_linear", mutates_args=())
def _linear_forward(x: Tensor, splits: Tensor, weight: Tensor, bias: Optional[Tensor], main_grad: Optional[Tensor],
                    handle: int, train: bool) -> Tuple[Tensor, Tensor]:
    h = _handles_of(handle)
    with torch.cuda.device(x.device):
        op = h.op(x.shape[0], x.device)
        y = torch.zeros((x.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)  # rows past sum(splits): 0
        args = _lib.ForwardArgs(x=x.data_ptr(), splits=splits.data_ptr(), weight=weight.data_ptr(), bias=_ptr(bias),
                                y=y.data_ptr())
        _lib.call("mg_grouped_linear_forward", op, ctypes.byref(args), int(train), _stream(x.device))
        ticket = _ticket(x.device)
    if train:
        h.pending[x.shape[0]].push(ticket)
    return y, ticket


@_linear_forward.register_fake
def _(x, splits, weight, bias, main_grad, handle, train):
    return x.new_empty((x.shape[0], weight.shape[1])), x.new_empty((1,), dtype=torch.int32)


@torch.library.custom_op("moegraph::grouped_linear_backward", mutates_args=("main_grad",))
def _linear_backward(dy: Tensor, ticket: Tensor, weight: Tensor, bias: Optional[Tensor], main_grad: Optional[Tensor],
                     handle: int, need_dx: bool) -> Tuple[Tensor, Tensor, Tensor]:
    h = _handles_of(handle)
    pending = h.pending[dy.shape[0]]
    pending.check(ticket, "GroupedLinear")
    with torch.cuda.device(dy.device):
        op = h.op(dy.shape[0], dy.device)
        dx = torch.zeros((dy.shape[0], weight.shape[2]), dtype=dy.dtype, device=dy.device) if need_dx else _empty(dy)
        dw = torch.empty_like(weight) if main_grad is None else _empty(dy)
        db = torch.empty_like(bias) if bias is not None else _empty(dy)
        args = _lib.BackwardArgs(dy=dy.data_ptr(), weight=weight.data_ptr(), bias=_ptr(bias), dx=_ptr(dx),
                                 dbias=_ptr(db), dweight=_ptr(dw), main_grad=_ptr(main_grad))
        _lib.call("mg_grouped_linear_backward", op, ctypes.byref(args), int(h.delay_wgrad), _stream(dy.device))
    pending.pop()
    if h.delay_wgrad:
        h.queued_wgrads.append(dy.shape[0])  # backward_dw runs it on the operator of this row count
    return dx, dw, db


@_linear_backward.register_fake
def _(dy, ticket, weight, bias, main_grad, handle, need_dx):
    dx = dy.new_empty((dy.shape[0], weight.shape[2])) if need_dx else dy.new_empty((0,))
    dw = torch.empty_like(weight) if main_grad is None else dy.new_empty((0,))
    db = torch.empty_like(bias) if bias is not None else dy.new_empty((0,))
    return dx, dw, db


def _linear_setup(ctx, inputs, output):
    x, splits, weight, bias, main_grad, handle, train = inputs
    ctx.save_for_backward(output[1], weight, bias)  # the ticket: which forward this is
    # main_grad is accumulated into by every backward: saved as a tensor, the first of two pending
    # micro-batches' backwards would fail the second's in-place check (see the module docstring).
    ctx.main_grad = main_grad
    ctx.handle = handle
    ctx.mark_non_differentiable(output[1])


def _linear_grad(ctx, dy, _ticket_grad):
    (ticket, weight, bias), main_grad = ctx.saved_tensors, ctx.main_grad
    need_dx = ctx.needs_input_grad[0]
    dx, dw, db = torch.ops.moegraph.grouped_linear_backward(dy.contiguous(), ticket, weight, bias, main_grad,
                                                            ctx.handle, need_dx)
    return (dx if need_dx else None, None, dw if main_grad is None else None, db if bias is not None else None,
            None, None, None)


torch.library.register_autograd("moegraph::grouped_linear", _linear_grad, setup_context=_linear_setup)


class GroupedLinear(_OwnsHandles, torch.nn.Module):
    """G linear layers over rows grouped by expert: forward(x [rows, in], splits [G] int32 cuda) ->
    [rows, out]; group e is rows [sum(splits[:e]), sum(splits[:e+1])); rows past sum(splits) give 0.
    weight [G, out, in], bias [G, out]."""

    def __init__(self, num_groups, in_features, out_features, bias=False, dtype=torch.bfloat16, device="cuda",
                 main_grad=False, delay_wgrad=False, wgrad_slots=1):
        super().__init__()
        if dtype not in _DTYPE:
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        if delay_wgrad and not main_grad:
            raise ValueError("delay_wgrad needs main_grad=True (the queued gradient lands in weight.main_grad)")
        self.weight = torch.nn.Parameter(torch.empty(num_groups, out_features, in_features, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(num_groups, out_features, dtype=dtype, device=device)) if bias else None
        bound = in_features ** -0.5
        torch.nn.init.uniform_(self.weight, -bound, bound)
        if main_grad:
            self.weight.main_grad = torch.zeros(self.weight.shape, dtype=torch.float32, device=device)
        self.main_grad, self._dtype = main_grad, dtype
        self._handle_args = (num_groups, in_features, out_features, bias, dtype, 1, wgrad_slots, delay_wgrad)
        self._id = next(_ids)
        _handles[self._id] = self._new_handles()

    def _new_handles(self):
        return _LinearHandles(*self._handle_args)

    def forward(self, x, splits):
        groups, out_features, in_features = self.weight.shape
        if x.dim() != 2 or x.shape[1] != in_features or x.dtype != self._dtype:
            raise ValueError(f"x must be [rows, {in_features}] {self._dtype}, got {tuple(x.shape)} {x.dtype}")
        if splits.dim() != 1 or splits.shape[0] != groups or splits.dtype != torch.int32:
            raise ValueError(f"splits must be [{groups}] torch.int32, got {tuple(splits.shape)} {splits.dtype}")
        _check_device(x, self.weight.device, "x")
        _check_device(splits, self.weight.device, "splits")
        x, splits = x.contiguous(), splits.contiguous()
        params = [self.weight] + ([self.bias] if self.bias is not None else [])
        train = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
        weight, bias = _full(self.weight), _full(self.bias)
        if self.main_grad and (weight is not self.weight or bias is not self.bias):
            raise ValueError("main_grad=True with DTensor parameters: their gradients are DTensors in .grad")
        main_grad = _main_grad_of(self.weight, "weight") if self.main_grad else None
        device, shape = self.weight.device, (groups, out_features, in_features)
        _check_read_by_address(weight, "weight", shape, self._dtype, device)
        _check_read_by_address(bias, "bias", shape[:2], self._dtype, device)
        _check_read_by_address(main_grad, "weight.main_grad", shape, torch.float32, device)
        if x.shape[0] == 0:
            # No rows: no operator of capacity 0 exists, and there is nothing to compute. Plain torch
            # gives the empty output, an empty dx and zero weight and bias gradients (main_grad: none).
            # With delay_wgrad nothing is queued either: backward_dw() has no wgrad for this forward.
            w0 = weight[0].detach() if main_grad is not None else weight[0]
            y = x @ w0.t()
            return y + bias[0] if bias is not None else y
        y, _ = torch.ops.moegraph.grouped_linear(x, splits, weight, bias, main_grad, self._id, train)
        return y

    def backward_dw(self):
        """Runs the oldest queued weight gradient (delay_wgrad) into weight.main_grad, on the current stream.
        A forward of zero rows queues none (it adds nothing to main_grad)."""
        h = _handles[self._id]
        if not h.queued_wgrads:
            raise RuntimeError("backward_dw without a queued weight gradient (run a training backward with "
                               "delay_wgrad=True first)")
        handle = h.ops[h.queued_wgrads[0]][0]  # the operator of that micro-batch's row count
        with torch.cuda.device(self.weight.device):
            _lib.call("mg_grouped_linear_backward_dw", handle, _stream(self.weight.device))
        h.queued_wgrads.popleft()

    def check_device_errors(self):
        """Synchronizes and raises MoegraphError if the device saw invalid splits since the last check
        (splits are read on the device only: a negative one, or a sum past the rows)."""
        for handle, _ in _handles[self._id].ops.values():
            with torch.cuda.device(self.weight.device):
                _lib.call("mg_grouped_linear_check_device_errors", handle, _stream(self.weight.device))


# ---------------------------------------------------------------------------------------------------
# MoELayer: router -> top-k dispatch -> SwiGLU experts -> weighted combine, in one C layer.


class _LayerHandle:
    """One MoE module's C layer. It is bound to addresses: its parameters', their main_grad buffers',
    and (in backward) fresh gradient tensors. When they move (FSDP2 re-gathers parameters into new
    storage for every forward and backward), the layer is re-bound (mg_moe_layer_set_weights), which
    keeps the micro-batches it saved."""

    def __init__(self, options):
        self.options = options
        self.handle, self.bound = None, None
        self.pending = _Pending()  # training forwards awaiting backward
        self.device = None  # of the first call: the layer and its workspace live there

    def layer(self, params, main_grads, grads=None):
        router, w1, b1, w2, b2 = params
        g = grads or {}
        w = _lib.MoeLayerWeights(router=_ptr(router), w1=_ptr(w1), b1=_ptr(b1), w2=_ptr(w2), b2=_ptr(b2),
                                 main_grad_router=_ptr(main_grads[0]), main_grad1=_ptr(main_grads[1]),
                                 main_grad2=_ptr(main_grads[2]), **{k: _ptr(v) for k, v in g.items()})
        key = bytes(w)
        _check_same_device(self, router.device)
        if self.handle is None:
            handle = ctypes.c_void_p()
            _lib.call("mg_moe_layer_create", ctypes.byref(self.options), ctypes.byref(w), None, ctypes.byref(handle))
            self.destroy = _lib.lib().mg_moe_layer_destroy  # bound now: module globals may be gone at exit
            self.handle = handle
        elif key != self.bound:
            _lib.call("mg_moe_layer_set_weights", self.handle, ctypes.byref(w))
        self.bound = key
        return self.handle

    def close(self):
        if getattr(self, "handle", None) is not None:
            self.destroy(self.handle)
            self.handle = None

    def __del__(self):
        self.close()


def _num_tokens(n, device):
    return torch.full((1,), n, dtype=torch.int32, device=device)


def _main_grads(mg_router, mg1, mg2):
    return [mg_router, mg1, mg2]


@torch.library.custom_op("moegraph::moe_layer", mutates_args=())
def _moe_forward(x: Tensor, router: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
                 mg_router: Optional[Tensor], mg1: Optional[Tensor], mg2: Optional[Tensor], handle: int,
                 train: bool) -> Tuple[Tensor, Tensor, Tensor]:
    h = _handles_of(handle)
    with torch.cuda.device(x.device):
        layer = h.layer([router, w1, b1, w2, b2], _main_grads(mg_router, mg1, mg2))
        y = torch.empty_like(x)
        aux = torch.zeros((1,), dtype=torch.float32, device=x.device)
        # Named, as are the row buffers for no tokens: each must outlive the call that reads it.
        tokens = _num_tokens(x.shape[0], x.device)
        x_rows, y_rows = _some_rows(x), _some_rows(y)
        io = _lib.MoeLayerIO(x=x_rows.data_ptr(), num_tokens=tokens.data_ptr(), y=y_rows.data_ptr(),
                             aux_loss=aux.data_ptr() if h.options.aux_loss_coef > 0 else None)
        _lib.call("mg_moe_layer_forward", layer, ctypes.byref(io), int(train), _stream(x.device))
        ticket = _ticket(x.device)
    if train:
        h.pending.push(ticket)
    return y, aux, ticket


@_moe_forward.register_fake
def _(x, router, w1, b1, w2, b2, mg_router, mg1, mg2, handle, train):
    return torch.empty_like(x), x.new_empty((1,), dtype=torch.float32), x.new_empty((1,), dtype=torch.int32)


@torch.library.custom_op("moegraph::moe_layer_backward", mutates_args=("mg_router", "mg1", "mg2"))
def _moe_backward(dy: Tensor, x: Tensor, ticket: Tensor, router: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor,
                  b2: Optional[Tensor], mg_router: Optional[Tensor], mg1: Optional[Tensor], mg2: Optional[Tensor],
                  handle: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    h = _handles_of(handle)
    # Fresh gradient tensors for every backward, bound before it runs: autograd owns them from here
    # on, and a later backward writes its own (no copies, no gradient buffer kept by the layer).
    grads = {}
    if mg1 is None:
        grads.update(d_router=torch.empty_like(router), dw1=torch.empty_like(w1), dw2=torch.empty_like(w2))
    if b1 is not None:
        grads.update(db1=torch.empty_like(b1), db2=torch.empty_like(b2))
    h.pending.check(ticket, "MoELayer")
    with torch.cuda.device(x.device):
        layer = h.layer([router, w1, b1, w2, b2], _main_grads(mg_router, mg1, mg2), grads)
        n, max_tokens = x.shape[0], h.options.max_tokens
        dx = torch.empty((max_tokens, x.shape[1]), dtype=x.dtype, device=x.device)  # rows [n, max) written as 0
        tokens = _num_tokens(n, x.device)
        x_rows, dy_rows = _some_rows(x), _some_rows(dy)
        io = _lib.MoeLayerIO(x=x_rows.data_ptr(), num_tokens=tokens.data_ptr(), dy=dy_rows.data_ptr(),
                             dx=dx.data_ptr())
        _lib.call("mg_moe_layer_backward", layer, ctypes.byref(io), _stream(x.device))
    h.pending.pop()
    grad = lambda name: grads[name] if name in grads else _empty(x)  # noqa: E731
    return dx[:n].clone(), grad("d_router"), grad("dw1"), grad("db1"), grad("dw2"), grad("db2")


@_moe_backward.register_fake
def _(dy, x, ticket, router, w1, b1, w2, b2, mg_router, mg1, mg2, handle):
    grad = lambda t, keep: torch.empty_like(t) if keep else x.new_empty((0,))  # noqa: E731
    fp32 = mg1 is not None
    return (torch.empty_like(x), grad(router, not fp32), grad(w1, not fp32), grad(b1, b1 is not None),
            grad(w2, not fp32), grad(b2, b2 is not None))


def _moe_setup(ctx, inputs, output):
    x, router, w1, b1, w2, b2, mg_router, mg1, mg2, handle, train = inputs
    ctx.save_for_backward(x, output[2], router, w1, b1, w2, b2)  # output[2]: the ticket
    ctx.main_grads = (mg_router, mg1, mg2)  # not saved tensors: as in _linear_setup
    ctx.handle = handle
    # aux loss: its gradient is applied inside the layer's backward; the ticket names the forward.
    ctx.mark_non_differentiable(output[1], output[2])


def _moe_grad(ctx, dy, _aux_grad, _ticket_grad):
    x, ticket, router, w1, b1, w2, b2 = ctx.saved_tensors
    mg_router, mg1, mg2 = ctx.main_grads
    dx, dr, dw1, db1, dw2, db2 = torch.ops.moegraph.moe_layer_backward(dy.contiguous(), x, ticket, router, w1, b1,
                                                                       w2, b2, mg_router, mg1, mg2, ctx.handle)
    fp32 = mg1 is not None
    return (dx, None if fp32 else dr, None if fp32 else dw1, db1 if b1 is not None else None,
            None if fp32 else dw2, db2 if b2 is not None else None, None, None, None, None, None)


torch.library.register_autograd("moegraph::moe_layer", _moe_grad, setup_context=_moe_setup)


class MoELayer(_OwnsHandles, torch.nn.Module):
    """A whole MoE layer: forward(x [n, hidden]) -> (y [n, hidden], aux_loss [1] fp32), n <= max_tokens.

    Parameters: router [E, hidden], w1 [E, 2 * ffn, hidden] (gate | up), w2 [E, hidden, ffn], and
    with bias b1 [E, 2 * ffn], b2 [E, hidden]. aux_loss is returned for logging and is not
    differentiable: its gradient (coefficient aux_loss_coef) is applied inside the layer's backward,
    as if aux_loss were added to the loss once."""

    def __init__(self, experts, hidden, ffn, top_k=2, max_tokens=4096, bias=False, score="softmax",
                 renormalize=True, aux_loss_coef=0.0, capacity_factor=0.0, dtype=torch.bfloat16, device="cuda",
                 main_grad=False, delay_wgrad=False, wgrad_slots=1, training=True):
        super().__init__()
        if dtype not in _DTYPE:
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
        if delay_wgrad and not main_grad:
            raise ValueError("delay_wgrad needs main_grad=True (the queued gradients land in .main_grad)")
        if score not in _lib.ROUTER_SCORE:
            raise ValueError(f"score must be one of {sorted(_lib.ROUTER_SCORE)}, got {score!r}")
        o = _lib.MoeLayerOptions(experts=experts, hidden=hidden, ffn=ffn, top_k=top_k, bias=int(bias),
                                 score=_lib.ROUTER_SCORE[score], renormalize=int(renormalize),
                                 aux_loss_coef=aux_loss_coef, capacity_factor=capacity_factor, max_tokens=max_tokens,
                                 row_align=1, dtype=_DTYPE[dtype], training=int(training), wgrad_slots=wgrad_slots,
                                 delay_wgrad=int(delay_wgrad), main_grad_fp32=int(main_grad),
                                 recipe=_lib.RECIPE["bf16"])
        size = ctypes.c_size_t()
        _lib.call("mg_moe_layer_workspace_bytes", ctypes.byref(o), ctypes.byref(size))  # refuses bad options now
        p = lambda *shape: torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))  # noqa: E731
        self.router, self.w1, self.w2 = p(experts, hidden), p(experts, 2 * ffn, hidden), p(experts, hidden, ffn)
        torch.nn.init.normal_(self.router, std=hidden ** -0.5)
        torch.nn.init.uniform_(self.w1, -hidden ** -0.5, hidden ** -0.5)
        torch.nn.init.uniform_(self.w2, -ffn ** -0.5, ffn ** -0.5)
        self.b1 = torch.nn.Parameter(torch.zeros(experts, 2 * ffn, dtype=dtype, device=device)) if bias else None
        self.b2 = torch.nn.Parameter(torch.zeros(experts, hidden, dtype=dtype, device=device)) if bias else None
        if main_grad:
            for w in (self.router, self.w1, self.w2):
                w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=device)
        self.main_grad, self.max_tokens, self.trainable = main_grad, max_tokens, bool(training)
        self.hidden, self._dtype = hidden, dtype
        self._shapes = dict(router=(experts, hidden), w1=(experts, 2 * ffn, hidden), b1=(experts, 2 * ffn),
                            w2=(experts, hidden, ffn), b2=(experts, hidden))
        self._options = bytes(o)  # plain bytes: a copy or a pickle of the module carries them
        self._id = next(_ids)
        _handles[self._id] = self._new_handles()

    def _new_handles(self):
        return _LayerHandle(_lib.MoeLayerOptions.from_buffer_copy(self._options))

    def forward(self, x):
        if x.dim() != 2 or x.shape[1] != self.hidden or x.dtype != self._dtype:
            raise ValueError(f"x must be [tokens, {self.hidden}] {self._dtype}, got {tuple(x.shape)} {x.dtype}")
        _check_device(x, self.w1.device, "x")
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"{x.shape[0]} tokens, more than max_tokens {self.max_tokens}")
        params = (self.router, self.w1, self.w2) + ((self.b1, self.b2) if self.b1 is not None else ())
        train = self.trainable and torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in params))
        own = (self.router, self.w1, self.b1, self.w2, self.b2)
        router, w1, b1, w2, b2 = full = [_full(p) for p in own]
        if self.main_grad and any(f is not p for f, p in zip(full, own)):
            raise ValueError("main_grad=True with DTensor parameters: their gradients are DTensors in .grad")
        mg = ([_main_grad_of(w, n) for n, w in (("router", self.router), ("w1", self.w1), ("w2", self.w2))]
              if self.main_grad else [None] * 3)
        device = self.w1.device
        for name, t in zip(("router", "w1", "b1", "w2", "b2"), full):
            _check_read_by_address(t, name, self._shapes[name], self._dtype, device)
        for name, t in zip(("router", "w1", "w2"), mg):
            _check_read_by_address(t, name + ".main_grad", self._shapes[name], torch.float32, device)
        y, aux, _ = torch.ops.moegraph.moe_layer(x.contiguous(), router, w1, b1, w2, b2, *mg, self._id, train)
        return y, aux

    def backward_dw(self):
        """Runs the oldest queued weight gradients (delay_wgrad) into the .main_grad buffers."""
        h = _handles[self._id]
        if h.handle is None:
            raise RuntimeError("backward_dw before any forward")
        with torch.cuda.device(self.w1.device):
            _lib.call("mg_moe_layer_backward_dw", h.handle, _stream(self.w1.device))

    def check_device_errors(self):
        """Synchronizes and raises MoegraphError if the device saw invalid inputs since the last check."""
        h = _handles[self._id]
        if h.handle is not None:
            with torch.cuda.device(self.w1.device):
                _lib.call("mg_moe_layer_check_device_errors", h.handle, _stream(self.w1.device))
