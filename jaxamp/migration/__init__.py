"""Migration namespaces: jmp's, mpx's and Haliax's names on jaxamp's pieces.

A port is an import change::

    from jaxamp.migration import jmp      # was: import jmp
    from jaxamp.migration import mpx      # was: import mpx
    from jaxamp.migration import haliax   # was: haliax's mixed-precision names

Each namespace holds that library's public names (those jaxamp ports) and
nothing else; ``docs/migration.md`` lists them with the deliberate
differences. With :func:`jaxamp.amp` none of these hand casts are needed.
"""

from . import haliax as haliax
from . import jmp as jmp
from . import mpx as mpx

__all__ = ("haliax", "jmp", "mpx")
