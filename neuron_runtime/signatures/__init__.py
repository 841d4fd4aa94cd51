"""What a call is, as data: shared by `aten/` (which builds signatures), `executables/` (which keys and
resolves them) and `compiler/` (which compiles them). The bottom of the runtime; imports only torch.

    _ops.py        an aten op's kind and argument kinds, decided once from its schema (ops as data)
    _signature.py  a call's signature (canonical JSON) and its cache key (sha256 with the fingerprint)
    _shapes.py     shape classes: one executable for a family of shapes

Nothing here is public API.
"""

__all__: list[str] = []
