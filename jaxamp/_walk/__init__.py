"""The walk: the equation loop and the higher-order rules.

Importing the package registers the built-in higher-order primitives
(``_higher_order.py``), so that ``jaxamp.default_amp_policy`` holds their
entries before anything copies it.
"""

from . import _higher_order as _higher_order
