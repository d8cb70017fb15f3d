"""Compile for an NVIDIA H100 on a machine without one (deviceless ahead-of-time
compilation), to read what the GPU compiler decides: ``memory_analysis()`` (the
step's peak as XLA:GPU lays it out) and the optimised HLO (which kernels a policy
reaches, whether a rounding survived).

Needs the CUDA plugin of the installed jax version, no GPU, driver or CUDA
toolkit (about 5.5 GB of compiler wheels)::

    pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"

Run the process with ``JAX_PLATFORMS=cpu`` (the tests set it): the CUDA
backend is then never initialised; it serves only as a compile-only topology
(``jax.experimental.topologies``); jaxamp traces for the target
(``jaxamp._compat.target_backend``). Not measured: run time, and the GEMM
configurations autotuning would pick on a device (compare slopes, not absolute
temp bytes).

    from gpu_target import available, compile_for
    compiled = compile_for(step, params, state, batch, donate_argnums=(0, 1))
    compiled.memory_analysis(), compiled.as_text()
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxamp import _compat

TARGETS = ("cpu", "h100", "local")

# The GpuTargetConfigProto of an H100 SXM 80 GB (XLA's
# xla/backends/gpu/target_config/specs/h100_sxm.txtpb without its performance
# tables): what XLA:GPU's compiler reads of the device.
H100_SXM = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 feature_extension: ACCELERATED_FEATURES }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
  platform_version: "Compute Capability 9.0a"
  device_address_bits: 64
  pcie_bandwidth: 34359738368
  ecc_enabled: true
  name: "NVIDIA H100 80GB HBM3"
  driver_version: "13.0.0"
  runtime_version: "12.8.0"
  compile_time_toolkit_version: "12.8.0"
  dnn_version: "9.10.0"
  cub_version: "3.1.2"
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


def available() -> str | None:
    """None when the H100 target can be compiled for, else the reason it
    cannot (the install line)."""
    found = False
    for plugin in ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"):
        try:
            found = found or importlib.util.find_spec(plugin) is not None
        except ModuleNotFoundError:  # no jax_plugins package at all
            pass
    if not found:
        return (
            "the H100 target needs the CUDA plugin of this jax version: pip "
            f'install "jax[cuda12]=={jax.__version__}" (no GPU needed)'
        )
    return None


@functools.cache
def _sharding(target: str) -> NamedSharding:
    if target in ("cpu", "local"):  # this machine's CPU, or its first device
        devices = jax.devices("cpu" if target == "cpu" else None)
        mesh = jax.sharding.Mesh(devices[:1], ("x",))
        return NamedSharding(mesh, PartitionSpec())
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        platform="cuda", target_config=H100_SXM, topology="1x1x1"
    )
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    return NamedSharding(mesh, PartitionSpec())


def compile_for(
    fn: Callable,
    *args: Any,
    target: str = "h100",
    donate_argnums: Sequence[int] = (),
) -> Any:
    """``jax.jit(fn, donate_argnums=...)`` lowered and compiled for ``target``.

    Args:
        fn: the function to compile.
        *args: pytrees of ``jax.ShapeDtypeStruct`` (or arrays): the argument
            shapes and dtypes; placed, replicated, on one device of the target.
        target: ``"cpu"`` (this machine's XLA:CPU), ``"h100"`` (compile-only)
            or ``"local"`` (this machine's default device, e.g. a real GPU,
            whose compile autotunes).
        donate_argnums: the arguments whose buffers the program may reuse.

    Returns:
        The compiled executable (``memory_analysis()``, ``as_text()``).

    Raises:
        ValueError: for another ``target``.
        RuntimeError: for ``"h100"`` without the CUDA plugin (names the
            install line).
    """
    if target not in TARGETS:
        raise ValueError(f"compile_for(target={target!r}): one of {TARGETS}.")
    if target == "h100" and available() is not None:
        raise RuntimeError(available())
    sharding = _sharding(target)
    shapes = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args
    )
    jitted = jax.jit(fn, donate_argnums=tuple(donate_argnums))
    # jaxamp's backend-dependent choices (XLA:CPU's bfloat16 slices, its
    # transposed-product barrier, cuDNN attention) and chip-dependent ones
    # (jaxamp.eight_bit_policy's format) are the target's.
    backend = {"h100": "gpu", "cpu": "cpu"}.get(target, jax.default_backend())
    with _compat.target_backend(backend, sharding.mesh.devices.flat[0]):
        return jitted.lower(*shapes).compile()


def peak_bytes(compiled: Any) -> int:
    """The step's peak as XLA plans it: arguments + outputs - aliased + temp."""
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
