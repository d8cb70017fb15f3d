"""The extension API: the registries jaxamp reads and the types they take.

What a library or a user adds to jaxamp without editing it, as ``jax.extend``
holds JAX's extension points:

* a higher-order primitive (a call, a loop, a kernel with sub-jaxprs):
  :func:`register_higher_order` records its rewrite rule and its
  :class:`Structure` (built from :class:`SubJaxpr` values, or by
  :func:`describe_call` for a call); :func:`rewrite_subjaxprs` is the rewrite
  rule of a primitive whose sub-jaxprs keep their signatures, and
  :func:`rewrite_jaxpr` rewrites one sub-jaxpr inside a rule of one's own;
  :func:`unregister_higher_order` removes a registration;
* an 8-bit format (a float8 type, another int8 layout):
  :func:`register_format` records a :class:`QFormat`, which the codec, the
  8-bit policies, the stored residuals and the reports read;
  :func:`unregister_format` removes it;
* a rule that reads more than dtypes (``jaxamp.rules.CastRule.with_context``):
  it is called with a :class:`RuleContext`.

Every registration is read when it is needed, so one made after
``import jaxamp`` (or after a policy was built) applies to every later walk.
"""

from .._base._formats import QFormat as QFormat
from .._base._formats import register_format as register_format
from .._base._formats import unregister_format as unregister_format
from .._base._structure import Structure as Structure
from .._base._structure import SubJaxpr as SubJaxpr
from .._base._structure import describe_call as describe_call
from .._policy._context import RuleContext as RuleContext
from .._walk._higher_order import rewrite_jaxpr as rewrite_jaxpr
from .._walk._higher_order import rewrite_subjaxprs as rewrite_subjaxprs
from .._walk._register import register_higher_order as register_higher_order
from .._walk._register import unregister_higher_order as unregister_higher_order

__all__ = (
    "QFormat",
    "RuleContext",
    "Structure",
    "SubJaxpr",
    "describe_call",
    "register_format",
    "register_higher_order",
    "rewrite_jaxpr",
    "rewrite_subjaxprs",
    "unregister_format",
    "unregister_higher_order",
)
