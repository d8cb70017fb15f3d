"""Fused attention under amp: re-dispatch attention for the dtypes amp chose.

amp traces the user's function in float32, so ``jax.nn.dot_product_attention``
picks its XLA path (``implementation=None``) or refuses to trace
(``implementation="cudnn"``: cuDNN takes only 16-bit inputs). PyTorch's autocast
gets flash attention because ``scaled_dot_product_attention`` dispatches on the
dtypes it receives at run time; this module does the same for jaxamp:

* **Interception** (``_intercept.py``, active while ``amp`` traces the user's
  function): a ``jax.nn.dot_product_attention`` call on float32 (or wider)
  q/k/v is emitted as one recognisable ``jit`` equation whose body is JAX's own
  XLA path.
* **Pattern matching** (``_match.py``): the hand-written form that Flax,
  Equinox and user code produce (q·k ``dot_general`` -> optional scale by a
  scalar -> optional bias ``add`` / boolean-mask ``select_n`` (also inside
  ``jnp.where``'s jit) -> softmax over the key axis (``jax.nn.softmax``'s
  ``custom_jvp_call`` or its inline form) -> p·v ``dot_general``), where the
  intermediates have no other users and share one ``named_scope`` stack. Only
  exact matches are replaced, as PyTorch Inductor's ``fuse_attention`` patterns
  replace matmul-softmax-matmul with ``scaled_dot_product_attention``.
* **Dispatch** (``_kernels.py``): q/k/v cast to the compute dtype; cuDNN
  (``jax.nn.dot_product_attention(implementation="cudnn")``) when they are
  bfloat16/float16, the default backend is an NVIDIA GPU and JAX accepts the
  call; otherwise JAX's XLA path, which computes the logits and softmax in
  float32 and the p·v product in the compute dtype.

The policy key ``"attention"`` (``_rule.py``: :func:`attention_rule`) turns
this off or forces an implementation; ``amp_stop`` regions are left alone.
``_rewrite.py`` plugs the matched groups into the interpreter as regions
(:data:`REWRITE`, one ``_walk._loop.PatternRewrite``).
"""

from ._intercept import intercept as intercept
from ._kernels import FUSED_SCOPE as FUSED_SCOPE
from ._kernels import dispatch as dispatch
from ._rewrite import REWRITE as REWRITE
from ._rule import AttentionRule as AttentionRule
from ._rule import attention_rule as attention_rule
