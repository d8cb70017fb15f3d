"""The policy value for the key ``"attention"``: how amp runs attention."""

from __future__ import annotations

from typing import Any

from ..._policy._kinds import ATTENTION_KEY as ATTENTION_KEY
from ..._policy._kinds import AttentionRule as AttentionRule


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
        An :class:`AttentionRule`, valid only under the key ``"attention"``.

    Raises:
        ValueError: for another ``implementation``.

    Example:
        >>> import jaxamp
        >>> policy = {**jaxamp.default_amp_policy,
        ...           "attention": jaxamp.attention_rule("xla")}
    """
    return AttentionRule(implementation)


def mode(ctx: Any, scopes: tuple[str, ...]) -> str | None:
    """The implementation the policy asks for here, or None: leave alone
    (``amp_stop``, or a scope rule that is not an attention rule)."""
    policy = ctx.policy
    rule = policy.lookup(ATTENTION_KEY, scopes)
    if isinstance(rule, AttentionRule):
        return rule.implementation
    if rule is policy.default_rule:
        return "auto"
    return None
