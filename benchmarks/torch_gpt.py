"""PyTorch reference: one GPT training step, fp32 vs autocast bf16 (issue 12).

    python benchmarks/torch_gpt.py                                # both GPU models
    python benchmarks/torch_gpt.py --size gpt1024 --out /tmp/torch_gpt.md
    python benchmarks/torch_gpt.py --device cpu --size tiny --steps 1 --rounds 1

The PyTorch counterpart of ``benchmarks/gpu_attention.py`` for issue 12's
comparison (PyTorch autocast + ``torch.compile`` against jaxamp on JAX). Same
model and sizes: tied embedding plus learned positions, ``L`` pre-LayerNorm
blocks (LayerNorm with a gain and no bias, eps 1e-5; causal attention through
``scaled_dot_product_attention(is_causal=True)``; tanh-GELU MLP with 4 x d
hidden; residuals; no biases), final LayerNorm, float32 logits ``h @ emb.T``,
mean cross-entropy. Each layer is wrapped in
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` like the JAX
``jax.checkpoint`` on the scanned layer; the update is SGD ``p -= 1e-3 * grad``.
Parameters are drawn with torch's generator (not JAX's), rounded to bfloat16
and kept in float32, so losses match the JAX run only in size, not digits.

Variants: ``torch fp32`` (TF32 left at PyTorch's default, recorded in the
header: matmuls in IEEE float32 unless the user changed it); ``torch autocast
bf16 eager`` and ``torch autocast bf16 + compile`` (``torch.autocast`` around
forward and loss; ``torch.compile`` of the forward+loss function in default
mode, AOTAutograd compiles the backward; the foreach SGD update runs eager).
On CPU the compile variant is skipped.

Columns: step time (median of ``--rounds`` interleaved rounds of ``--steps``
steps, each after one warm-up step), tokens/s, MFU against 989 TFLOP/s with
gpu_attention.py's ``model_flops``, peak memory (``max_memory_allocated``, reset
per variant: parameters, gradients and activations, unlike XLA's temp bytes),
the loss at the initial parameters, and the seconds of the first step (the
compile, for the compiled variant). Prints the Markdown table last; ``--out``
writes it, and the rows as JSON next to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

SIZES = {  # d_model, layers, seq, batch, heads, vocab (as in gpu_attention.py)
    "tiny": (64, 2, 32, 2, 4, 128),
    "gpt1024": (1024, 12, 1024, 8, 16, 8192),
    "gpt2048": (2048, 8, 512, 16, 16, 8192),
}
PEAK = 989e12  # H100 SXM dense bf16 FLOP/s (datasheet)
LR = 1e-3


def model_flops(size: str) -> float:
    """Forward + backward FLOPs of one step (no recompute), as gpu_attention.py.

    Args:
        size: A key of ``SIZES``.

    Returns:
        6 x matmul parameters x tokens plus 12 x B x T^2 x d per layer.
    """
    d, L, T, B, _, V = SIZES[size]
    matmul_params = L * 12 * d * d + V * d
    return 6 * matmul_params * B * T + 12 * B * T * T * d * L


class GPT(nn.Module):
    """The model of gpu_attention.py's ``make_loss`` (float32 parameters).

    Args:
        size: A key of ``SIZES``.
        seed: Seed of the torch generator for the initial parameters.
    """

    def __init__(self, size: str, seed: int = 0):
        super().__init__()
        d, L, T, _, self.heads, V = SIZES[size]
        g = torch.Generator().manual_seed(seed)

        def n(*shape, scale):  # normal, pre-rounded to bfloat16, kept float32
            w = torch.randn(*shape, generator=g) * scale
            return nn.Parameter(w.to(torch.bfloat16).float())

        self.emb, self.pos = n(V, d, scale=0.02), n(T, d, scale=0.01)
        self.layers = nn.ModuleList()
        for _ in range(L):
            layer = nn.Module()
            layer.ln1 = nn.Parameter(torch.ones(d))
            layer.ln2 = nn.Parameter(torch.ones(d))
            layer.qkv = n(d, 3 * d, scale=d**-0.5)
            layer.o = n(d, d, scale=(2 * L * d) ** -0.5)
            layer.up = n(d, 4 * d, scale=d**-0.5)
            layer.down = n(4 * d, d, scale=(8 * L * d) ** -0.5)
            self.layers.append(layer)
        self.lnf = nn.Parameter(torch.ones(d))

    def block(self, x, ln1, qkv, o, ln2, up, down):
        """One pre-LayerNorm block: causal attention then GELU MLP, residuals."""
        B, T, d = x.shape
        h = F.layer_norm(x, (d,), ln1, None, 1e-5)
        q, k, v = (h @ qkv).split(d, -1)
        sh = lambda t: t.view(B, T, self.heads, -1).transpose(1, 2)
        a = F.scaled_dot_product_attention(sh(q), sh(k), sh(v), is_causal=True)
        x = x + a.transpose(1, 2).reshape(B, T, d) @ o
        h = F.layer_norm(x, (d,), ln2, None, 1e-5)
        return x + F.gelu(h @ up, approximate="tanh") @ down

    def forward(self, x, y):
        """Mean cross-entropy of next-token logits (float32) for tokens ``x``."""
        h = F.embedding(x, self.emb) + self.pos
        for w in self.layers:
            ws = (w.ln1, w.qkv, w.o, w.ln2, w.up, w.down)
            h = checkpoint(self.block, h, *ws, use_reentrant=False)
        h = F.layer_norm(h, (h.shape[-1],), self.lnf, None, 1e-5)
        logits = (h @ self.emb.T).float()
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def make_step(model: GPT, device: str, amp: bool, compile_: bool):
    """A train step ``step(x, y) -> loss``: forward+loss, backward, SGD.

    Args:
        model: The model, updated in place.
        device: ``"cuda"`` or ``"cpu"`` (the autocast device type).
        amp: Run forward and loss under ``torch.autocast(device, bfloat16)``.
        compile_: ``torch.compile`` the forward+loss function (default mode).

    Returns:
        The step function; it returns the loss as a detached tensor.
    """

    def loss_fn(x, y):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            return model(x, y)

    fwd = torch.compile(loss_fn) if compile_ else loss_fn
    params = list(model.parameters())

    def step(x, y):
        loss = fwd(x, y)
        loss.backward()
        with torch.no_grad():
            torch._foreach_add_(params, [p.grad for p in params], alpha=-LR)
        for p in params:
            p.grad = None
        return loss.detach()

    return step


def measure(size: str, steps: int, rounds: int, device: str) -> list[dict]:
    """One row per variant, timed in interleaved rounds from the same start.

    Args:
        size: A key of ``SIZES``.
        steps: Timed steps per round.
        rounds: Interleaved rounds; the step time is the median over them.
        device: Torch device string.

    Returns:
        Rows with ``step_ms``, ``tokens_per_s``, ``mfu``, ``peak_mib``,
        ``loss``, ``first_step_s``, or ``missing`` saying why not.
    """
    _, _, T, B, _, V = SIZES[size]
    cuda = device.startswith("cuda")
    torch._dynamo.reset()  # a fresh compile per size, no dynamic-shape recompile
    model = GPT(size).to(device)
    init = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, V, (B, T + 1), generator=g).to(device)
    x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
    dev_type = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else lambda: None
    specs = {
        "torch fp32": (False, False),
        "torch autocast bf16 eager": (True, False),
        "torch autocast bf16 + compile": (True, True),
    }
    rows, fns = {}, {}
    for name, (amp, comp) in specs.items():
        rows[name] = {"variant": name}
        if comp and not cuda:
            rows[name]["missing"] = "skipped on CPU: torch.compile timed on CUDA only"
            continue
        model.load_state_dict(init)
        try:
            fn = make_step(model, dev_type, amp, comp)
            t0 = time.perf_counter()
            loss = fn(x, y)  # first step: includes torch.compile
            sync()
            rows[name].update(first_step_s=time.perf_counter() - t0, loss=float(loss))
            for _ in range(2):  # more warm-up (backward recompiles, autotuning)
                fn(x, y)
            sync()
        except Exception as e:  # report, keep the other variants
            rows[name]["missing"] = f"failed: {type(e).__name__}: {e}"[:200]
            continue
        fns[name] = fn
    times: dict[str, list[float]] = {n: [] for n in fns}
    peak: dict[str, float] = {n: 0.0 for n in fns}
    for _ in range(rounds):  # interleaved: every variant sees the same machine
        for name, fn in fns.items():
            model.load_state_dict(init)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            fn(x, y)  # warm-up
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                fn(x, y)
            sync()
            times[name].append((time.perf_counter() - t0) / steps)
            if cuda:
                peak[name] = max(peak[name], torch.cuda.max_memory_allocated() / 2**20)
    flops = model_flops(size)
    for name, ts in times.items():
        s = statistics.median(ts)
        rows[name].update(step_ms=1e3 * s, tokens_per_s=B * T / s, mfu=flops / s / PEAK)
        if cuda:
            rows[name]["peak_mib"] = peak[name]
    return list(rows.values())


COLUMNS = [
    ("step ms", "step_ms", "{:.1f}"),
    ("tokens/s", "tokens_per_s", "{:,.0f}"),
    ("MFU", "mfu", "{:.1%}"),
    ("peak MiB", "peak_mib", "{:.0f}"),
    ("loss (step 1)", "loss", "{:.4f}"),
    ("1st step s (compile)", "first_step_s", "{:.1f}"),
]


def markdown(results: dict[str, list[dict]], meta: dict) -> str:
    """The Markdown report: a header and one table per size.

    Args:
        results: Size -> rows from ``measure``.
        meta: ``command``, ``device``, ``torch``, ``note``.

    Returns:
        The Markdown text.
    """
    lines = ["# PyTorch reference: one GPT training step", ""]
    lines += [f"Command: `{meta['command']}`", ""]
    lines += [f"Device: {meta['device']}; torch {meta['torch']}; {meta['note']}", ""]
    for size, rows in results.items():
        d, L, T, B, H, V = SIZES[size]
        lines += [
            f"## {size}: d_model {d}, {L} layers (checkpoint per layer), seq {T}, "
            f"batch {B}, {H} heads, vocab {V}; {model_flops(size) / 1e12:.2f} "
            "TFLOP/step",
            "",
            "| variant | " + " | ".join(c for c, _, _ in COLUMNS) + " |",
            "|---" * (len(COLUMNS) + 1) + "|",
        ]
        for r in rows:
            if "missing" in r:
                lines.append(f"| {r['variant']} | {r['missing']} |")
                continue
            cells = [fmt.format(r[k]) if k in r else "" for _, k, fmt in COLUMNS]
            lines.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="gpt1024,gpt2048", help="comma-separated")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="", help="Markdown path (+ .json beside it)")
    args = ap.parse_args(argv)
    sizes = [s for s in args.size.split(",") if s]
    results = {s: measure(s, args.steps, args.rounds, args.device) for s in sizes}
    cuda = args.device.startswith("cuda")
    meta = {
        "command": "python benchmarks/torch_gpt.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": torch.cuda.get_device_name(args.device) if cuda else "cpu",
        "torch": torch.__version__ + (f" (CUDA {torch.version.cuda})" if cuda else ""),
        "note": f"median of {args.rounds} interleaved rounds of {args.steps} steps; "
        "fp32 matmul precision left at the default "
        f"({torch.get_float32_matmul_precision()!r}: TF32 off unless changed)",
    }
    md = markdown(results, meta)
    if args.out:
        out = Path(args.out)
        out.write_text(md + "\n")
        out.with_suffix(".json").write_text(
            json.dumps({"meta": meta, "results": results}, indent=1, default=float)
        )
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
