"""Read a file written by torch.save without torch, and without running code from the file.

    from ptfile import load_pt
    obj = load_pt("rollout_3.pt")      # tensors come back as numpy arrays (bfloat16 as float32)

torch.save (torch/serialization.py, _save) writes a zip archive (stored, not compressed):
    <name>/data.pkl       the object, pickled (protocol 2) with each tensor as
                          torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
                          requires_grad, backward_hooks[, metadata]) and each storage as the
                          persistent id ("storage", torch.<Type>Storage, key, location, numel)
    <name>/byteorder      "little" or "big" (absent in files of old versions: little)
    <name>/data/<key>     the raw bytes of each storage
    <name>/version, <name>/.data/serialization_id
<name> is the archive's folder, whatever it is called.

The unpickler resolves only the globals in _ALLOWED below (tensor and storage rebuilds,
OrderedDict, sets, complex numbers, bytes, numpy arrays, scalars and dtypes; torch dtypes and
devices become strings, torch.Size a tuple) and refuses every other one with PtError naming it, so no function named by the file is
ever called. Files in the pre-1.6 format (_use_new_zipfile_serialization=False) are refused.
"""
import _compat_pickle
import collections
import io
import pickle
import zipfile

import numpy as np


MAX_ELEMENTS = 1 << 31      # per tensor: a stride-0 view may not make the reader allocate without bound


class PtError(ValueError):
    """The file is not a torch.save zip archive this reader understands, or names a global it refuses."""


# torch.<Name>Storage -> numpy dtype ("bf16": stored as uint16, returned as float32)
_STORAGE = {"DoubleStorage": "f8", "FloatStorage": "f4", "HalfStorage": "f2", "BFloat16Storage": "bf16",
            "LongStorage": "i8", "IntStorage": "i4", "ShortStorage": "i2", "CharStorage": "i1",
            "ByteStorage": "u1", "BoolStorage": "?", "ComplexFloatStorage": "c8",
            "ComplexDoubleStorage": "c16", "UntypedStorage": "u1"}
_TORCH_DTYPES = {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
                 "bool", "complex64", "complex128", "float", "double", "half", "long", "int", "short"}


class _StorageType:
    def __init__(self, name):
        self.name, self.code = name, _STORAGE[name]


class _Storage:
    __slots__ = ("array", "bf16")

    def __init__(self, array, bf16):
        self.array, self.bf16 = array, bf16


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None):
    if not isinstance(storage, _Storage):
        raise PtError(f"data.pkl: a tensor rebuild got {type(storage).__name__} instead of a storage")
    try:
        offset = int(storage_offset)
        size = tuple(int(s) for s in size)
        stride = tuple(int(s) for s in stride)
    except (TypeError, ValueError):
        raise PtError("data.pkl: a tensor's offset, size or stride is not integers") from None
    a = storage.array
    if len(size) != len(stride) or offset < 0 or any(s < 0 for s in size) or any(s < 0 for s in stride):
        raise PtError(f"data.pkl: bad tensor geometry: offset {offset}, size {size}, stride {stride}")
    if int(np.prod(size, dtype=np.float64)) > MAX_ELEMENTS:
        raise PtError(f"data.pkl: a tensor of size {size} is larger than this reader takes ({MAX_ELEMENTS} elements)")
    if 0 in size:
        out = np.zeros(size, dtype=a.dtype)
    else:
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= a.shape[0]:
            raise PtError(f"data.pkl: tensor of size {size}, stride {stride}, offset {offset} reaches element "
                          f"{last} of a storage of {a.shape[0]}")
        out = np.lib.stride_tricks.as_strided(a[offset:], shape=size, strides=[s * a.itemsize for s in stride],
                                              writeable=False).copy()
    if storage.bf16:
        out = (out.astype(np.uint32) << 16).view(np.float32)
    return out


def _rebuild_tensor(storage, storage_offset, size, stride):
    return _rebuild_tensor_v2(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
    return data


def _codecs_encode(text, encoding="utf-8"):
    # protocol 2 pickles bytes as _codecs.encode(latin-1 text, "latin1")
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise PtError(f"data.pkl: _codecs.encode called with encoding {encoding!r}")
    return text.encode("latin1")


def _allowed():
    table = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
        ("builtins", "complex"): complex, ("builtins", "bytearray"): bytearray,
        ("_codecs", "encode"): _codecs_encode,
        ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
        ("torch", "Size"): tuple,                                        # a shape: a tuple
        ("torch", "device"): lambda *a: ":".join(str(x) for x in a),    # a device: "cuda:0"
    }
    # numpy moved these from numpy.core to numpy._core in 2.0; resolve them from whichever exists
    try:
        from numpy._core import multiarray as ma      # numpy >= 2
    except ImportError:
        from numpy.core import multiarray as ma
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        table[(mod, "_reconstruct")] = ma._reconstruct
        table[(mod, "scalar")] = ma.scalar
    return table


_ALLOWED = _allowed()


class _Unpickler(pickle.Unpickler):
    def __init__(self, data, zf, prefix, byteorder, path):
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self.zf, self.prefix, self.order, self.path = zf, prefix, "<" if byteorder == "little" else ">", path
        self.storages = {}

    def find_class(self, module, name):
        # protocol 2 names Python 2 modules (__builtin__.set); map them as pickle's own find_class does
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        if module == "torch" and name in _STORAGE:
            return _StorageType(name)
        if module == "torch" and name in _TORCH_DTYPES:
            return f"torch.{name}"
        fn = _ALLOWED.get((module, name))
        if fn is None:
            raise PtError(f"{self.path}: data.pkl names the global {module}.{name}, which this reader does not "
                          f"load (it maps only tensors, storages, OrderedDict, sets, bytes and numpy arrays; "
                          f"no code from the file is run)")
        return fn

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")
                and isinstance(pid[1], _StorageType)):
            raise PtError(f"{self.path}: data.pkl: unknown persistent id {pid!r:.80}")
        _, stype, key, location, numel = pid
        key = key.decode("ascii") if isinstance(key, bytes) else str(key)
        if key in self.storages:
            return self.storages[key]
        name = f"{self.prefix}data/{key}"
        try:
            raw = self.zf.read(name)
        except KeyError:
            raise PtError(f"{self.path}: the storage record {name} named in data.pkl is missing") from None
        bf16 = stype.code == "bf16"
        dt = np.dtype("u2" if bf16 else stype.code)
        if dt.itemsize > 1:
            dt = dt.newbyteorder(self.order)
        if len(raw) % dt.itemsize or (isinstance(numel, int) and len(raw) // dt.itemsize != numel):
            raise PtError(f"{self.path}: storage {name}: {len(raw)} bytes for {numel} elements of "
                          f"{stype.name}")
        arr = np.frombuffer(raw, dtype=dt)
        if dt.byteorder == ">":
            arr = arr.astype(dt.newbyteorder("="))
        self.storages[key] = s = _Storage(arr, bf16)
        return s


def load_pt(path):
    """The object torch.save wrote to `path`, with tensors as numpy arrays. Raises PtError."""
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        with open(path, "rb") as f:
            head = f.read(16)
        if head[:2] == b"\x80\x02":
            raise PtError(f"{path}: a torch file in the pre-1.6 format (_use_new_zipfile_serialization=False); "
                          f"save it again with a current torch, or load it with torch") from None
        raise PtError(f"{path}: not a torch.save file (not a zip archive)") from None
    with zf:
        pkls = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            if any(n.endswith("constants.pkl") for n in zf.namelist()):
                raise PtError(f"{path}: a TorchScript archive, not a torch.save file")
            raise PtError(f"{path}: no <name>/data.pkl record: not a torch.save file")
        prefix = pkls[0][:-len("data.pkl")]
        byteorder = "little"
        if prefix + "byteorder" in zf.namelist():
            byteorder = zf.read(prefix + "byteorder").decode("ascii", "replace").strip()
            if byteorder not in ("little", "big"):
                raise PtError(f"{path}: byteorder record says {byteorder!r}")
        u = _Unpickler(zf.read(pkls[0]), zf, prefix, byteorder, path)
        try:
            return u.load()
        except PtError:
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
            raise PtError(f"{path}: data.pkl could not be read: {type(e).__name__}: {e}") from None
