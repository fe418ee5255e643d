"""Tensors on the wrong device, caught on a CPU machine: `with FakeDevice(): ...` runs the code on the CPU while
keeping track of which tensors would be on the accelerator, and raises where CUDA would.

Code under test gets `FAKE` (torch.device("cpu", 7)) as its device. Every tensor moved or created there is marked
as on the device; every op's outputs inherit the mark of its inputs; `tensor.device` answers `FAKE` for marked
tensors, so `torch.zeros(..., device=x.device)` lands where it would on a GPU. An op that mixes marked tensors with
unmarked (CPU) ones raises, with CUDA's exceptions: 0-dim CPU tensors (scalars), copies between devices (`to`,
`copy_`, `cpu`), and a device tensor indexed by a CPU index. Only calls that pass through torch's Python API are
seen (ops inside autograd's backward are not; the gradients get their parameter's mark).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

FAKE = torch.device("cpu", 7)
_MARK = "_tandem_on_fake_device"
_MOVES = {"to", "type_as", "cuda", "cpu", "copy_", "tolist", "item", "numpy", "__repr__", "__format__", "__str__", "data_ptr",
          "untyped_storage", "pin_memory", "__reduce_ex__", "__array__", "__bool__", "__int__", "__float__",
          "__index__", "__len__", "__deepcopy__"}

_NEUTRAL = {"_has_compatible_shallow_copy_type", "is_floating_point", "is_complex", "size", "dim", "numel", "stride",
            "is_contiguous", "element_size", "storage_offset", "_is_view", "get_device", "requires_grad_",
            "register_hook", "retain_grad", "_set_grad_enabled"}  # no computation: nothing to check or mark

_SHAPE_OF_OTHER = {"view_as", "reshape_as", "expand_as"}  # the other tensor gives only its shape


def on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, _MARK, False)


def _target(args, kwargs):
    """Where a move or a factory puts its result: True (the device), False (the CPU) or None (not said)."""
    for a in [kwargs.get("device"), *args]:
        if isinstance(a, torch.Tensor):  # x.to(other)
            return on_device(a)
        if isinstance(a, (str, torch.device)):
            d = torch.device(a)
            return d.type == "cuda" or d == FAKE
    return None


def _mark(out, value: bool):
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            setattr(t, _MARK, value)
    return out


def _describe(tensors) -> str:
    return ", ".join(f"{'device' if on_device(t) else 'cpu'}{tuple(t.shape)}" for t in tensors)


_COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "send",
                "recv")


class FakeDevice(TorchFunctionMode):
    """`collectives`: where torch.distributed's collectives must find their tensors while active: "cpu" (gloo, as
    colocated workers sync), "device" (nccl) or None (not checked)."""

    def __init__(self, collectives: str | None = None):
        super().__init__()
        self.collectives, self._saved = collectives, {}

    def __enter__(self):
        import torch.distributed as dist

        for name in _COLLECTIVES if self.collectives else ():
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._checked(name, self._saved[name]))
        return super().__enter__()

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved = {}
        return super().__exit__(*exc)

    def _checked(self, name, fn):
        want_device = self.collectives == "device"

        def collective(*args, **kwargs):
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            wrong = [t for t in tensors if on_device(t) != want_device]
            if wrong:
                raise RuntimeError(f"fake device: dist.{name} over a {'nccl' if want_device else 'gloo'} group got "
                                   f"{_describe(wrong)}")
            return fn(*args, **kwargs)
        return collective

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        descriptor = getattr(getattr(func, "__self__", None), "__name__", None)
        if name == "__get__":  # properties: .device answers FAKE; tensor-valued ones (.grad, .data, .T) inherit
            if descriptor == "device":
                return FAKE if on_device(args[0]) else func(*args)
            out = func(*args)
            return _mark(out, on_device(args[0])) if isinstance(out, torch.Tensor) and out is not args[0] else out
        if name == "__set__":
            func(*args)
            if descriptor == "data":
                _mark(args[0], on_device(args[1]))
            return None
        if name in _NEUTRAL:
            return func(*args, **kwargs)
        if name in _SHAPE_OF_OTHER:
            return _mark(func(*args, **kwargs), on_device(args[0]))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if name in _MOVES:
            out = func(*args, **kwargs)
            target = _target(args[1:], kwargs) if name in ("to", "type_as") else {"cuda": True, "cpu": False}.get(name)
            if name in ("tolist", "item", "numpy", "data_ptr") or not isinstance(out, torch.Tensor):
                return out
            if target is None:
                target = on_device(args[0])
            if out is args[0] and target != on_device(args[0]):
                out = out.clone()  # a move never changes where the original lives
            return _mark(out, target)
        if name in ("__getitem__", "__setitem__") and tensors:
            self_t, index = args[0], [t for t in tree_flatten(args[1])[0] if isinstance(t, torch.Tensor)]
            if not on_device(self_t) and any(on_device(t) for t in index):
                raise RuntimeError(f"fake device: {name}: indices should be either on cpu or on the same device "
                                   f"as the indexed tensor (cpu); got {_describe([self_t, *index])}")
            if name == "__setitem__":
                return func(*args, **kwargs)
            return _mark(func(*args, **kwargs), on_device(self_t))
        device_side = [t for t in tensors if on_device(t)]
        cpu_side = [t for t in tensors if not on_device(t) and t.dim() > 0]
        if device_side and cpu_side:
            raise RuntimeError(f"fake device: {getattr(func, '__qualname__', name)}: expected all tensors to be on "
                               f"the same device, got {_describe(tensors)}")
        out = func(*args, **kwargs)
        target = _target((), kwargs)
        return _mark(out, bool(device_side) if target is None else target)
