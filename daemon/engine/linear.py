"""Linear layers with their weights packed once (CPU; float32 and bfloat16), as vLLM's CPU
path does.

``torch.nn.Linear`` on CPU calls the BLAS ``sgemm`` with the weight in its stored layout at every call. A weight
packed once reads faster: :func:`pack_linears` swaps a model's float32 ``nn.Linear`` modules for
:class:`PackedLinear`, whose packed copy is what the forward reads; the stored weights stay where another module
shares them (tied embeddings keep working) and are released otherwise. Two packings:

- the engine's own kernel (``csrc/gemm.cpp``, ``torch.ops.ringstream.packed_linear``), where the native kernels
  are built: 48-column panels and an 8 x 48 AVX-512 register block on hosts with AVX-512, 24-column panels and
  a 4 x 24 AVX2 block elsewhere, each prefetching the next panel while it computes the current one. Over a
  decode step's weights (314 MB, 16 rows, 2 threads) on a 2-core AVX-512 Xeon: 16.6 ms against 20.0 for
  oneDNN's packed matmul and 27.9 for ``F.linear``; on par with oneDNN at 256 rows. On a 2-core AMD EPYC (AVX2),
  the AVX2 kernel: 1.4-1.8x oneDNN at 16 rows, on par at 128-1,024 rows (``tools/bench_engine.py`` and
  ``ringstream-bench vllm`` give the engine-level figures). A bfloat16 weight is packed as bfloat16: in pairs of
  k for AVX512_BF16's ``VDPBF16PS`` where the host has it, else widened to float32 as it is read (by the AVX-512
  kernel, or the AVX2 kernel on hosts without AVX-512); on a 2-core
  AMD EPYC (AVX512_BF16) over a decode step's weights (157 MB), 16 rows: 4.4 ms against 5.1 for oneDNN's packed
  matmul and 11.8 for ``F.linear``, on par with oneDNN at 256 rows;
- oneDNN (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, the weight reordered into its
  blocked layout and run by its JIT ``brg_matmul`` kernels; what inductor's weight freezing emits on CPU):
  1.3-1.6x ``F.linear`` at 16 rows, about 1.2x at 300, on the same host. Used where the native kernels are not.

Sibling projections that read the same input (``q_proj`` / ``k_proj`` / ``v_proj`` of an attention block,
``gate_proj`` / ``up_proj`` of a gated MLP) are packed as one weight, as vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` hold them: one GEMM over the concatenated weight, whose output columns each member
returns as its slice (:class:`FusedLinearGroup`): fewer passes over the input, fewer and wider kernels.

Source: vLLM ``vllm/model_executor/layers/utils.py`` (``dispatch_cpu_unquantized_gemm``: a matmul over a
prepacked weight) and ``vllm/model_executor/layers/linear.py`` (the merged projections).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch
from torch import nn

__all__ = ["FUSED_GROUPS", "FusedLinearGroup", "FusedLinearSlice", "LinearKernel", "PackedLinear", "pack_linears",
           "refuse_autograd"]

BATCH_HINT = 16
"""Rows oneDNN's packed layout is chosen for (any row count runs; it only tunes the blocking)."""

FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Names of sibling projections that read one input in every supported family (Hugging Face's module names)."""


def refuse_autograd(*tensors: torch.Tensor | None) -> None:
    """Raise RuntimeError where autograd would record the native kernels, which have no backward (a gradient
    would be silently missing). The engine runs under ``torch.inference_mode()``, where this never raises."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError("the engine's native kernels have no backward: run the model under "
                           "torch.inference_mode() or torch.no_grad(), or build it with native_kernels = false")


class LinearKernel:
    """How packed weights are made and applied: ``pack(W [N, K]) -> packed`` and
    ``apply(x [..., K], packed, bias [N] or None, N) -> [..., N]``.

    ``LinearKernel.native(ops)`` uses the engine's kernel (``ops`` is ``torch.ops.ringstream`` with it loaded),
    ``LinearKernel.onednn()`` PyTorch's oneDNN ops. ``dtypes``: the weight dtypes it packs (float32; bfloat16 too
    for the engine's kernel, whose bfloat16 weights stream half the bytes and compute in float32, rounded to
    bfloat16 once per output).
    """

    def __init__(self, name: str, pack: Callable, apply: Callable,
                 dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
        self.name, self.pack, self.apply, self.dtypes = name, pack, apply, dtypes

    @classmethod
    def native(cls, ops) -> "LinearKernel":
        def apply(x, packed, bias, n):
            refuse_autograd(x, bias)
            return ops.packed_linear(x, packed, bias, n)

        try:  # bfloat16 weights (widened or paired by the host's kernel), computed in float32
            ops.pack_linear_weight(torch.zeros(1, 1, dtype=torch.bfloat16))
            dtypes = (torch.float32, torch.bfloat16)
        except RuntimeError:
            dtypes = (torch.float32,)
        return cls("native", ops.pack_linear_weight, apply, dtypes)

    @classmethod
    def onednn(cls, batch_hint: int = BATCH_HINT) -> "LinearKernel":
        return cls("onednn", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, batch_hint),
                   lambda x, packed, bias, n: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""))


class PackedLinear(nn.Module):
    """``y = x W^T + b`` over a packed copy of ``W``; ``x [..., in_features]`` -> ``[..., out_features]``."""

    def __init__(self, linear: nn.Linear, keep_weight: bool, kernel: LinearKernel) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel = kernel
        self.packed = kernel.pack(linear.weight.detach())
        # A weight shared with another module (tied embeddings) stays; any other is released, so the packed copy
        # does not double the weights' memory. Its place holds an empty tensor of the same dtype and device, for
        # code that reads ``weight.dtype`` / ``weight.device``.
        self.weight = linear.weight if keep_weight else nn.Parameter(linear.weight.new_empty(0), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.apply(x, self.packed, self.bias, self.out_features)


class FusedLinearGroup:
    """One packed GEMM for sibling linears that read the same input.

    ``output(i, x)`` returns member ``i``'s ``x W_i^T + b_i`` (a column slice of the fused output, shape
    ``[..., out_features_i]``). The first member called with an input computes every member's output; the others
    then take theirs without a GEMM while the input is the same tensor object, unchanged (outside inference mode
    its version counter guards against an in-place write in between; inference tensors have none, and the
    families' forwards write no projection input in place). A member called with any other input computes
    afresh, so call order never changes results: only how many GEMMs run. The pending outputs are kept per
    thread, so forwards on several threads at once (``generate()`` in threads over one model) never meet.
    """

    def __init__(self, linears: list[nn.Linear], kernel: LinearKernel) -> None:
        self.kernel = kernel
        self.packed = kernel.pack(torch.cat([linear.weight.detach() for linear in linears]))
        if any(linear.bias is not None for linear in linears):
            self.bias = torch.cat([linear.bias.detach() if linear.bias is not None
                                   else linear.weight.new_zeros(linear.out_features) for linear in linears])
        else:
            self.bias = None
        self.splits = [linear.out_features for linear in linears]
        self.out_features = sum(self.splits)
        self._state = threading.local()  # per thread: a model may run forwards on several threads at once

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        state = self._state
        version = -1 if x.is_inference() else x._version
        pending = getattr(state, "pending", None)
        if not pending or index not in pending or state.input is not x or version != state.version:
            fused = self.kernel.apply(x, self.packed, self.bias, self.out_features)
            pending = state.pending = dict(enumerate(fused.split(self.splits, dim=-1)))
            state.input, state.version = x, version
        out = pending.pop(index)
        if not pending:
            state.input = None  # every member served: hold no activation past the block
        return out


class FusedLinearSlice(nn.Module):
    """Member ``index`` of a :class:`FusedLinearGroup`, in the place of its ``nn.Linear``."""

    def __init__(self, linear: nn.Linear, group: FusedLinearGroup, index: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group, self.index = group, index
        if index == 0:  # one member holds the packed weight, so that module traversals see it once
            self.register_buffer("packed", group.packed, persistent=False)
        self.weight = nn.Parameter(linear.weight.new_empty(0), requires_grad=False)
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(self.index, x)


def _packable(module: nn.Module, kernel: LinearKernel) -> bool:
    return (type(module) is nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype in kernel.dtypes and (module.bias is None or module.bias.dtype == module.weight.dtype))


def pack_linears(model: nn.Module, ops=None) -> int:
    """Replace every float32 ``nn.Linear`` of ``model`` (on CPU; bfloat16 too where the engine's kernel packs it:
    :attr:`LinearKernel.dtypes`) by a :class:`PackedLinear`, and each group of
    :data:`FUSED_GROUPS` siblings with one input size and no shared weight by :class:`FusedLinearSlice` members of
    one :class:`FusedLinearGroup`, releasing the weights no other module shares;
    returns how many modules were replaced.

    ``ops``: ``torch.ops.ringstream`` with the native kernels loaded (from ``kernels.native_ops()``) to use the
    engine's GEMM; None for oneDNN's. Does nothing (returns 0) with neither (PyTorch built without oneDNN).
    """
    if ops is not None:
        kernel = LinearKernel.native(ops)
    elif torch.backends.mkldnn.is_available():
        kernel = LinearKernel.onednn()
    else:
        return 0
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[param.data_ptr()] = uses.get(param.data_ptr(), 0) + 1

    def shared(linear: nn.Linear) -> bool:
        return uses.get(linear.weight.data_ptr(), 0) > 1

    swapped = 0
    for parent in list(model.modules()):
        children = dict(parent.named_children())
        for names in FUSED_GROUPS:
            members = [children.get(name) for name in names]
            if not all(m is not None and _packable(m, kernel) and not shared(m) for m in members):
                continue
            if len({m.in_features for m in members}) != 1:
                continue
            group = FusedLinearGroup(members, kernel)
            for index, (name, member) in enumerate(zip(names, members)):
                setattr(parent, name, FusedLinearSlice(member, group, index))
                del children[name]
                swapped += 1
        for name, child in children.items():
            if _packable(child, kernel):
                setattr(parent, name, PackedLinear(child, keep_weight=shared(child), kernel=kernel))
                swapped += 1
    return swapped
