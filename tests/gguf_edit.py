"""Rewrite the header of a GGUF file: change, add or drop key/values and tensor infos, keep the data.

For the hostile-input corpus (tests/test_hostile.py) and the header fuzz (scripts/fuzz_inputs.py):
it makes files that are well-formed GGUF but describe impossible models, which byte flips alone
rarely reach. Unchanged key/values are copied byte for byte.

>>> import struct
>>> g = Gguf.parse(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv_bytes("general.architecture", STRING, "llama"))
>>> g.get("general.architecture"), len(g.to_bytes()) == len(g.raw)
('llama', True)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import List, Tuple

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_FMT = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f", BOOL: "<?",
        UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def value_bytes(vtype: int, value) -> bytes:
    """The bytes of one GGUF value (arrays: ``value`` = (element type, list))."""
    if vtype == STRING:
        return _str(value)
    if vtype == ARRAY:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(value_bytes(etype, v) for v in items)
    return struct.pack(_FMT[vtype], value)


def kv_bytes(key: str, vtype: int, value) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + value_bytes(vtype, value)


@dataclass
class Tensor:
    name: str
    shape: List[int]
    ggml_type: int
    offset: int

    def to_bytes(self) -> bytes:
        return (_str(self.name) + struct.pack("<I", len(self.shape)) + b"".join(struct.pack("<Q", d) for d in self.shape)
                + struct.pack("<IQ", self.ggml_type, self.offset))


@dataclass
class Gguf:
    version: int
    kv: List[Tuple[str, int, bytes]]          # (key, type, raw value bytes)
    tensors: List[Tensor]
    data: bytes                               # the data section, from the aligned data start
    raw: bytes = b""
    extra_kv_count: int = 0                   # added to the stored key count (a lie, for the corpus)
    extra_tensor_count: int = 0
    spans: List[Tuple[int, int]] = field(default_factory=list)  # parse(): byte ranges of counts, scalar
                                                                 # key/values, array heads, tensor infos

    @classmethod
    def parse(cls, raw: bytes) -> "Gguf":
        pos = 4
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", raw, pos)
        pos += 20

        def read_str(p):
            (n,) = struct.unpack_from("<Q", raw, p)
            return raw[p + 8:p + 8 + n].decode("utf-8", "replace"), p + 8 + n

        def skip_value(vtype, p):
            if vtype == STRING:
                return read_str(p)[1]
            if vtype == ARRAY:
                etype, count = struct.unpack_from("<IQ", raw, p)
                p += 12
                for _ in range(count):
                    p = skip_value(etype, p)
                return p
            return p + struct.calcsize(_FMT[vtype])

        kv = []
        spans = [(0, 24)]  # the bytes that describe the model (the vocabulary's strings are left out)
        for _ in range(n_kv):
            start = pos
            key, pos = read_str(pos)
            (vtype,) = struct.unpack_from("<I", raw, pos)
            pos += 4
            end = skip_value(vtype, pos)
            kv.append((key, vtype, raw[pos:end]))
            spans.append((start, pos + 12 if vtype == ARRAY else end))
            pos = end
        tensor_start = pos
        tensors = []
        for _ in range(n_tensors):
            name, pos = read_str(pos)
            (n_dims,) = struct.unpack_from("<I", raw, pos)
            shape = list(struct.unpack_from(f"<{n_dims}Q", raw, pos + 4))
            pos += 4 + 8 * n_dims
            ggml_type, offset = struct.unpack_from("<IQ", raw, pos)
            pos += 12
            tensors.append(Tensor(name, shape, ggml_type, offset))
        spans.append((tensor_start, pos))
        g = cls(version, kv, tensors, b"", raw, spans=spans)
        align = g.get("general.alignment", 32)
        start = (pos + align - 1) // align * align if tensors else pos
        g.data = raw[start:]
        return g

    def get(self, key: str, default=None):
        for k, t, b in self.kv:
            if k == key:
                if t == STRING:
                    return b[8:].decode()
                return struct.unpack(_FMT[t], b)[0] if t in _FMT else b
        return default

    def set(self, key: str, vtype: int, value) -> "Gguf":
        raw = value_bytes(vtype, value)
        for i, (k, _, _) in enumerate(self.kv):
            if k == key:
                self.kv[i] = (key, vtype, raw)
                return self
        self.kv.append((key, vtype, raw))
        return self

    def drop(self, key: str) -> "Gguf":
        self.kv = [e for e in self.kv if e[0] != key]
        return self

    def tensor(self, pattern: str) -> Tensor:
        return next(t for t in self.tensors if pattern in t.name)

    def to_bytes(self) -> bytes:
        head = b"GGUF" + struct.pack("<IQQ", self.version, len(self.tensors) + self.extra_tensor_count,
                                     len(self.kv) + self.extra_kv_count)
        head += b"".join(_str(k) + struct.pack("<I", t) + b for k, t, b in self.kv)
        head += b"".join(t.to_bytes() for t in self.tensors)
        align = self.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0:
            align = 32
        if self.tensors:
            head += b"\0" * ((-len(head)) % align)
        return head + self.data
