"""Wire structs declared as field tables; packing and unpacking are derived.

A header class lists `FIELDS = (("name", bits), ...)` in wire order, most
significant bit first, as the spec's diagrams draw them.  Names starting with
"resv" are reserved: sent as the given value (0 by default) and kept on decode
so a decoder can report them.  The class gets `SIZE` (bytes), a dataclass-like
constructor, `pack()`, `unpack(buf, off)` and `as_dict()`.
"""
from __future__ import annotations

from typing import Any, ClassVar

from .errors import DecodeReason, EncodeError, MalformedPacket


class Header:
    FIELDS: ClassVar[tuple[tuple[str, int], ...]] = ()
    SIZE: ClassVar[int] = 0
    NAME: ClassVar[str] = ""
    _DEFAULTS: ClassVar[dict[str, int]] = {}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        bits = sum(b for _, b in cls.FIELDS)
        if bits % 8:
            raise TypeError(f"{cls.__name__}: {bits} bits is not a whole number of bytes")
        cls.SIZE = bits // 8
        cls.NAME = cls.NAME or cls.__name__

    def __init__(self, **values: int) -> None:
        for name, nbits in self.FIELDS:
            v = values.pop(name, self._DEFAULTS.get(name, 0))
            v = int(v)
            if v < 0 or v >> nbits:
                raise EncodeError(f"{self.NAME}.{name}={v} does not fit in {nbits} bits")
            setattr(self, name, v)
        if values:
            raise EncodeError(f"{self.NAME}: unknown field(s) {sorted(values)}")

    def pack(self) -> bytes:
        acc = 0
        for name, nbits in self.FIELDS:
            acc = (acc << nbits) | getattr(self, name)
        return acc.to_bytes(self.SIZE, "big")

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview, off: int = 0):
        end = off + cls.SIZE
        if end > len(buf):
            raise MalformedPacket(DecodeReason.TRUNCATED_EXT,
                                  f"{cls.NAME} needs {cls.SIZE} bytes, {max(0, len(buf) - off)} left", off)
        acc = int.from_bytes(buf[off:end], "big")
        vals = {}
        shift = cls.SIZE * 8
        for name, nbits in cls.FIELDS:
            shift -= nbits
            vals[name] = (acc >> shift) & ((1 << nbits) - 1)
        return cls(**vals)

    def as_dict(self) -> dict[str, int]:
        return {n: getattr(self, n) for n, _ in self.FIELDS}

    def replace(self, **changes: int):
        d = self.as_dict()
        d.update(changes)
        return type(self)(**d)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.as_dict() == other.as_dict()  # type: ignore[union-attr]

    def __hash__(self) -> int:
        return hash((type(self), self.pack()))

    def __repr__(self) -> str:
        body = ", ".join(f"{n}={getattr(self, n):#x}" for n, _ in self.FIELDS)
        return f"{self.NAME}({body})"
