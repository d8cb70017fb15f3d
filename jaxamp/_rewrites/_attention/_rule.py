"""The policy value for the key ``"attention"``: how amp runs attention."""

from __future__ import annotations

from typing import Any

from ..._policy._rules import follow_compute_precision

ATTENTION_KEY = "attention"
IMPLEMENTATIONS = ("auto", "xla", "cudnn", "off")


class AttentionRule:
    """Value of the ``"attention"`` policy key (see :func:`attention_rule`).

    Called as an ordinary rule (e.g. if also put under a primitive key) it acts
    as :func:`jaxamp.follow_compute_precision`.
    """

    __slots__ = ("implementation",)

    def __init__(self, implementation: str):
        self.implementation = implementation

    def __call__(self, compute_dtype, original_dtypes, *invars, **params):
        return follow_compute_precision(
            compute_dtype, original_dtypes, *invars, **params
        )

    def __repr__(self) -> str:
        return f"attention_rule({self.implementation!r})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, AttentionRule)
            and other.implementation == self.implementation
        )

    def __hash__(self) -> int:
        return hash((AttentionRule, self.implementation))


def attention_rule(implementation: str = "auto") -> AttentionRule:
    """The policy value for the key ``"attention"``: how amp runs attention.

    Without the key amp behaves as ``attention_rule("auto")``. Put it under
    ``amp_policy={**jaxamp.default_amp_policy, "attention": ...}``, or inside a
    nested scope policy (``{"encoder": {"attention": ...}}``).

    Args:
        implementation: ``"auto"``: cuDNN flash attention when the cast q/k/v
            are bfloat16/float16, the default backend is an NVIDIA GPU and JAX
            supports the call (head dim, bias, masks, sequence lengths, GQA,
            sliding window), else JAX's XLA path with float32 logits and
            softmax. ``"xla"``: always the XLA path with float32 logits.
            ``"cudnn"``: always cuDNN; JAX's own error if it cannot run the
            call (also on CPU). ``"off"``: no re-dispatch; the recognised
            equations run under the ordinary rules (a
            ``jax.nn.dot_product_attention`` call as its XLA path, also when it
            asked for ``"cudnn"``).

    Returns:
        An :class:`AttentionRule` (a callable, so policies validate it).

    Raises:
        ValueError: for another ``implementation``.

    Example:
        >>> import jaxamp
        >>> policy = {**jaxamp.default_amp_policy,
        ...           "attention": jaxamp.attention_rule("xla")}
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention_rule(implementation={implementation!r}): expected one of "
            f"{IMPLEMENTATIONS}."
        )
    return AttentionRule(implementation)


class _Key:
    """Stands in for a primitive in ``AmpPolicy.lookup`` (looked up by name)."""

    name = ATTENTION_KEY


_KEY = _Key()


def mode(ctx: Any, scopes: tuple[str, ...]) -> str | None:
    """The implementation the policy asks for here, or None: leave alone
    (``amp_stop``, or a scope rule that is not an attention rule)."""
    policy = ctx.policy
    rule = policy.lookup(_KEY, scopes)
    if isinstance(rule, AttentionRule):
        return rule.implementation
    if rule is policy.default_rule:
        return "auto"
    return None
