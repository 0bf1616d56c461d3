"""A torch function mode for the exercises' device rules (exercises 2 and 11): what makes a GPU's
host wait for the device, refused where tensors have values (the CPU), as the meta device refuses
it where they have none."""

import torch
from torch.overrides import TorchFunctionMode


class HostReads(TorchFunctionMode):
    """Refuses what makes a GPU's host wait for the device: a value read on the host (.tolist(),
    .item(), int(), bool(), a tensor as a Python index) or a boolean mask, whose result's size only
    the device knows (nonzero)."""

    READS = frozenset({"tolist", "item", "__int__", "__index__", "__bool__", "__float__", "nonzero", "argwhere",
                       "numpy"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        masked = name in ("__getitem__", "__setitem__") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (
                args[1] if isinstance(args[1], tuple) else (args[1],)))
        if name in self.READS or masked:
            raise RuntimeError(f"a host read: {name}{' with a boolean mask' if masked else ''}")
        return func(*args, **(kwargs or {}))
