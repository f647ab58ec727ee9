"""Microbenchmarks of every model op at model shapes, each candidate checked against a plain
reference before and after it is timed (`oxserve bench kernels`)."""

from oxserve.profiling.opbench import ops_attention, ops_kda, ops_misc, ops_moe  # noqa: F401  (they register)
from oxserve.profiling.opbench.registry import REGISTRY, BenchShapes, register_candidate

__all__ = ["REGISTRY", "BenchShapes", "register_candidate"]
