"""What torch.save writes, without torch: for the tests of data/ptfile.py and data/import_slime.py.

    from ptwriter import Tensor, save_pt
    save_pt(path, {"rollout_id": 3, "samples": [{"tokens": [1, 2, 3], "experts": Tensor(np.zeros((2, 4), np.int32))}]})

The layout follows torch/serialization.py (_save) as of torch 2.x: a zip archive with
<name>/data.pkl (the object pickled with protocol 2, the default), <name>/byteorder,
<name>/data/<key> (each storage's raw bytes, keys "0", "1", ... in order of first use),
<name>/version ("3") and <name>/.data/serialization_id. A Tensor pickles as torch's own do
(torch/_tensor.py, _reduce_ex_internal): the global torch._utils._rebuild_tensor_v2 called with
(storage, storage_offset, size, stride, requires_grad, backward_hooks = collections.OrderedDict()),
the storage as the persistent id ("storage", torch.<Type>Storage, key, "cpu", numel). Python's
own pickler does the pickling, as in torch; the torch names it needs come from stand-in modules
put into sys.modules only while save_pt runs. Tensor(a, offset=, size=, stride=) describes a
view into the flat array a (how a slice of a bigger tensor is saved).
"""
import collections
import io
import os
import pickle
import sys
import types
import zipfile

import numpy as np

_STORAGE_OF = {np.dtype("f8"): "DoubleStorage", np.dtype("f4"): "FloatStorage", np.dtype("f2"): "HalfStorage",
               np.dtype("i8"): "LongStorage", np.dtype("i4"): "IntStorage", np.dtype("i2"): "ShortStorage",
               np.dtype("i1"): "CharStorage", np.dtype("u1"): "ByteStorage", np.dtype("?"): "BoolStorage"}


class Tensor:
    """A tensor to save: a flat storage array and a view of it. bf16=True: the storage is uint16
    bit patterns of bfloat16 (torch.BFloat16Storage)."""

    def __init__(self, array, offset=0, size=None, stride=None, bf16=False):
        a = np.asarray(array)
        self.storage = np.ascontiguousarray(a.reshape(-1))
        self.offset = offset
        self.size = tuple(a.shape) if size is None else tuple(size)
        if stride is None:
            stride, acc = [], 1
            for n in reversed(self.size):
                stride.insert(0, acc)
                acc *= n
        self.stride = tuple(stride)
        self.kind = "BFloat16Storage" if bf16 else _STORAGE_OF[self.storage.dtype]


class _StorageRef:
    def __init__(self, tensor):
        self.tensor = tensor


def _stand_ins():
    torch = types.ModuleType("torch")
    utils = types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args):
        raise RuntimeError("stand-in")
    _rebuild_tensor_v2.__module__, _rebuild_tensor_v2.__qualname__ = "torch._utils", "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    torch._utils = utils
    for name in set(_STORAGE_OF.values()) | {"BFloat16Storage"}:
        setattr(torch, name, type(name, (), {"__module__": "torch"}))
    return {"torch": torch, "torch._utils": utils}


def save_pt(path, obj, archive=None):
    """Write obj as torch.save(obj, path) would; Tensor objects become tensors."""
    mods = _stand_ins()
    keys, blobs = {}, []

    class Pickler(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, _StorageRef):
                t = o.tensor
                if id(t.storage) not in keys:
                    keys[id(t.storage)] = str(len(keys))
                    blobs.append((keys[id(t.storage)], t.storage))
                return ("storage", getattr(mods["torch"], t.kind), keys[id(t.storage)], "cpu", t.storage.shape[0])
            return None

        def reducer_override(self, o):
            if isinstance(o, Tensor):
                return (mods["torch._utils"]._rebuild_tensor_v2,
                        (_StorageRef(o), o.offset, o.size, o.stride, False, collections.OrderedDict()))
            return NotImplemented

    saved = {k: sys.modules.get(k) for k in mods}
    sys.modules.update(mods)
    try:
        buf = io.BytesIO()
        Pickler(buf, protocol=2).dump(obj)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    name = archive or os.path.splitext(os.path.basename(path))[0]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{name}/data.pkl", buf.getvalue())
        z.writestr(f"{name}/byteorder", "little")
        for key, arr in blobs:
            z.writestr(f"{name}/data/{key}", arr.astype(arr.dtype.newbyteorder("<")).tobytes())
        z.writestr(f"{name}/version", "3\n")
        z.writestr(f"{name}/.data/serialization_id", "1234567890123456789012345678901234567890")
